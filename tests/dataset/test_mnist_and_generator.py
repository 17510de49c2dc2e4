"""``MnistDataset`` on idx-ubyte files written here, ``GeneratorDataset`` on Python sources: what MindSpore reads,
sharded the same way as the file sources, through the same pipeline."""
import numpy as np
import pytest
import torch

import autopar as ms
import autopar.dataset as ds
from autopar.dataset.mnist import write_mnist, write_synthetic_mnist
from autopar.errors import DatasetError


@pytest.fixture
def mnist(tmp_path):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, (40, 28, 28)), rng.integers(0, 10, 40)
    test = rng.integers(0, 256, (8, 28, 28)), rng.integers(0, 10, 8)
    write_mnist(tmp_path, *train, usage="train")
    write_mnist(tmp_path, *test, usage="test")
    return tmp_path, train, test


def test_mnist_reads_the_idx_files_as_mindspore(mnist):
    path, (xtr, ytr), (xte, yte) = mnist
    for usage, size in ((None, 48), ("all", 48), ("train", 40), ("test", 8)):
        assert ds.MnistDataset(path, usage=usage).get_dataset_size() == size
    image, label = next(ds.MnistDataset(path, shuffle=False).batch(48).create_tuple_iterator(output_numpy=True))
    assert image.shape == (48, 28, 28, 1) and image.dtype == np.uint8 and label.dtype == np.uint32
    np.testing.assert_array_equal(image[:40, :, :, 0], xtr)  # train first, then test (usage None = all)
    np.testing.assert_array_equal(label, np.concatenate([ytr, yte]))


def test_mnist_shards_are_disjoint_and_cover_the_data(mnist):
    path = mnist[0]
    seen = []
    for k in range(3):
        part = ds.MnistDataset(path, num_shards=3, shard_id=k, shuffle=True)
        assert part.get_dataset_size() == 16
        seen.extend(img.tobytes() for img, _ in part.create_tuple_iterator(output_numpy=True))
    assert len(set(seen)) == 48


def test_mnist_through_the_samples_transforms(mnist):
    data = ds.MnistDataset(mnist[0])
    data = data.map([ds.vision.Rescale(1.0 / 255.0, 0), ds.vision.Normalize(mean=(0.1307,), std=(0.3081,)),
                     ds.vision.HWC2CHW()], "image")
    data = data.map(ds.transforms.TypeCast(ms.int32), "label").batch(32)
    image, label = next(data.create_tuple_iterator())
    assert image.shape == (32, 1, 28, 28) and image.dtype == torch.float32 and label.dtype == torch.int32
    assert -0.5 < float(image.min()) < 0 and float(image.max()) > 2.5


def test_mnist_file_errors_are_one_line(tmp_path, mnist):
    path = mnist[0]
    (path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no MNIST files for usage 'all'"):
        ds.MnistDataset(path / "empty")
    (path / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x01" + b"\x00" * 20)
    with pytest.raises(DatasetError, match=r"not an idx file of the expected kind \(magic 2049, expected 2051\)"):
        ds.MnistDataset(path, usage="train")
    write_synthetic_mnist(path, train=4, test=0)
    data = (path / "train-labels-idx1-ubyte").read_bytes()
    (path / "train-labels-idx1-ubyte").write_bytes(data[:-1])
    with pytest.raises(DatasetError, match="holds 4 images but train-labels-idx1-ubyte 3 labels|truncated"):
        ds.MnistDataset(path, usage="train")


def test_generator_function_iterable_and_random_access_sources():
    def generate():
        for i in range(6):
            yield np.full((2,), i, dtype=np.float32), np.array(i % 2)

    data = ds.GeneratorDataset(generate, ["x", "y"])
    assert data.get_col_names() == ["x", "y"] and data.get_dataset_size() == 6
    rows = [(x.tolist(), int(y)) for x, y in data.create_tuple_iterator(output_numpy=True)]
    assert rows == [([i, i], i % 2) for i in range(6)]  # an iterable source is served in order
    assert len(list(ds.GeneratorDataset(generate(), ["x", "y"]).batch(4))) == 2

    class Table:
        def __getitem__(self, i):
            return np.array([i, -i]), np.int32(i)

        def __len__(self):
            return 10

    halves = [[int(y) for _, y in ds.GeneratorDataset(Table(), ["x", "y"], num_shards=2, shard_id=k,
                                                       shuffle=False).create_tuple_iterator(output_numpy=True)]
              for k in range(2)]
    assert halves == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]  # MindSpore's DistributedSampler order
    shuffled = [int(y) for _, y in ds.GeneratorDataset(Table(), ["x", "y"]).create_tuple_iterator(output_numpy=True)]
    assert sorted(shuffled) == list(range(10)) and shuffled != list(range(10))  # random access: shuffled by default
    typed = ds.GeneratorDataset(Table(), ["x", "y"], column_types=[ms.float32, ms.int64], shuffle=False)
    x, y = next(typed.create_tuple_iterator())
    assert x.dtype == torch.float32 and y.dtype == torch.int64


def test_generator_errors_are_one_line():
    with pytest.raises(DatasetError, match="shuffle=True needs a random-accessible source"):
        ds.GeneratorDataset(lambda: iter([(1,)]), ["a"], shuffle=True)
    with pytest.raises(DatasetError, match="a row has 1 value"):
        ds.GeneratorDataset(lambda: iter([(1,)]), ["a", "b"])
    with pytest.raises(DatasetError, match="produced no rows"):
        ds.GeneratorDataset(lambda: iter([]), ["a"])
