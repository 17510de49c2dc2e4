"""Sources read the real CIFAR-10 binary layout, accept both directory forms, and fail with one-line errors."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import autopar.dataset as ds
from autopar.errors import DatasetError


def read_records(path) -> np.ndarray:
    """Raw (n, 3073) records of one .bin file, read without autopar."""
    return np.fromfile(path, dtype=np.uint8).reshape(-1, 3073)


def all_rows(dataset):
    imgs, labels = [], []
    for img, label in dataset.create_tuple_iterator(output_numpy=True):
        imgs.append(img)
        labels.append(label)
    return np.stack(imgs), np.array(labels)


def test_cifar10_rows_equal_the_file_bytes(cifar_small):
    bindir = cifar_small / "cifar-10-batches-bin"
    rec = np.concatenate([read_records(bindir / f"data_batch_{i}.bin") for i in range(1, 6)])
    for path in (cifar_small, bindir):  # the parent or the cifar-10-batches-bin directory itself
        data = ds.Cifar10Dataset(str(path), usage="train", shuffle=False)
        assert data.get_dataset_size() == 320
        assert data.get_col_names() == ["image", "label"]
        imgs, labels = all_rows(data)
        assert imgs.shape == (320, 32, 32, 3) and imgs.dtype == np.uint8
        assert labels.dtype == np.uint32 and labels.shape == (320,)
        np.testing.assert_array_equal(labels, rec[:, 0])
        np.testing.assert_array_equal(imgs, rec[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))


def test_cifar10_usage_and_tensor_output(cifar_small):
    assert ds.Cifar10Dataset(cifar_small, usage="test").get_dataset_size() == 64
    assert ds.Cifar10Dataset(cifar_small, usage="all").get_dataset_size() == 384
    test = read_records(cifar_small / "cifar-10-batches-bin" / "test_batch.bin")
    img, label = next(iter(ds.Cifar10Dataset(cifar_small, usage="test", shuffle=False)))
    assert isinstance(img, torch.Tensor) and img.shape == (32, 32, 3) and img.dtype == torch.uint8
    assert label.shape == () and label.dtype == torch.uint32 and int(label) == test[0, 0]
    assert ds.Cifar10Dataset(cifar_small, num_samples=10).get_dataset_size() == 10
    with pytest.raises(DatasetError, match="usage must be"):
        ds.Cifar10Dataset(cifar_small, usage="validation")


def test_cifar10_missing_directory_and_files(tmp_path, cifar_small):
    with pytest.raises(DatasetError, match=f"dataset directory {tmp_path / 'nope'} does not exist"):
        ds.Cifar10Dataset(tmp_path / "nope")
    with pytest.raises(DatasetError, match="missing data_batch_1.bin, data_batch_2.bin"):
        ds.Cifar10Dataset(tmp_path)
    partial = tmp_path / "partial" / "cifar-10-batches-bin"
    shutil.copytree(cifar_small / "cifar-10-batches-bin", partial)
    (partial / "data_batch_3.bin").unlink()
    with pytest.raises(DatasetError) as err:
        ds.Cifar10Dataset(tmp_path / "partial")
    msg = str(err.value)
    assert "missing data_batch_3.bin in" in msg and str(partial) in msg and "\n" not in msg
    assert ds.Cifar10Dataset(tmp_path / "partial", usage="test").get_dataset_size() == 64


def test_cifar10_truncated_and_corrupt_files(tmp_path, cifar_small):
    bindir = tmp_path / "cifar-10-batches-bin"
    shutil.copytree(cifar_small / "cifar-10-batches-bin", bindir)
    bad = bindir / "data_batch_2.bin"
    data = bad.read_bytes()
    bad.write_bytes(data[:-100])
    with pytest.raises(DatasetError, match=rf"{bad} is truncated or corrupt: its size {len(data) - 100} bytes"):
        ds.Cifar10Dataset(tmp_path)
    corrupt = bytearray(data)
    corrupt[5 * 3073] = 12  # label byte of record 5
    bad.write_bytes(bytes(corrupt))
    with pytest.raises(DatasetError, match=rf"{bad} is corrupt: record 5 has label 12"):
        ds.Cifar10Dataset(tmp_path)
    bad.write_bytes(b"")
    with pytest.raises(DatasetError, match="truncated or corrupt"):
        ds.Cifar10Dataset(tmp_path)


def test_cifar10_gather_any_order_duplicates_and_file_boundaries(cifar_small):
    from autopar.dataset.sources import Cifar10Source

    bindir = cifar_small / "cifar-10-batches-bin"
    rec = np.concatenate([read_records(bindir / f"data_batch_{i}.bin") for i in range(1, 6)])
    source = Cifar10Source(cifar_small)
    rng = np.random.default_rng(0)
    for idx in (rng.permutation(320), np.array([63, 64, 65, 63, 0, 319, 319]), np.arange(0, 320, 3), np.arange(60, 70)):
        rows = source.gather(idx)
        np.testing.assert_array_equal(rows["label"], rec[idx, 0])
        np.testing.assert_array_equal(rows["image"], rec[idx, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    assert source.gather(np.array([], dtype=np.int64))["image"].shape == (0, 32, 32, 3)
    with pytest.raises(IndexError, match="outside 0..319"):
        source.gather(np.array([320]))


def _resident_file_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    pytest.skip("no RssFile in /proc/self/status")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_cifar10_epoch_does_not_pull_the_files_into_the_resident_set(tmp_path):
    """Full-size files (154 MB): opening them and reading a shuffled epoch keeps this process's file-backed resident
    memory nearly flat (a memory map held the whole dataset in every rank)."""
    from autopar.dataset.synth import write_synthetic_cifar10

    write_synthetic_cifar10(tmp_path, records_per_file=10000, seed=1)
    before = _resident_file_mb()
    data = ds.Cifar10Dataset(tmp_path, usage="train", shuffle=True).batch(256)
    n = 0
    for img, _ in data.create_tuple_iterator(output_numpy=True):
        n += img.shape[0]
    assert n == 50000
    assert _resident_file_mb() - before < 20


def test_numpy_slices_inputs():
    x = np.arange(12).reshape(6, 2)
    d = ds.NumpySlicesDataset({"a": x, "b": np.arange(6)}, shuffle=False)
    assert d.get_col_names() == ["a", "b"]
    rows = [(a.tolist(), int(b)) for a, b in d]
    assert rows == [([2 * i, 2 * i + 1], i) for i in range(6)]
    t = ds.NumpySlicesDataset((torch.arange(4), [5, 6, 7, 8]), shuffle=False)
    assert t.get_col_names() == ["column_0", "column_1"]
    assert [int(b) for _, b in t] == [5, 6, 7, 8]
    single = ds.NumpySlicesDataset([1, 2, 3], column_names=["v"], shuffle=False)
    assert single.get_col_names() == ["v"] and [int(v) for (v,) in single] == [1, 2, 3]
    with pytest.raises(DatasetError, match="different numbers of rows"):
        ds.NumpySlicesDataset({"a": np.zeros(3), "b": np.zeros(4)})
    with pytest.raises(DatasetError, match="2 column_names for 1 columns"):
        ds.NumpySlicesDataset(np.zeros(3), column_names=["a", "b"])
    with pytest.raises(DatasetError, match="no rows"):
        ds.NumpySlicesDataset(np.zeros((0, 3)))
