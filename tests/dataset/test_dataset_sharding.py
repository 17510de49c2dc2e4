"""MindSpore DistributedSampler semantics: equal-size shards, disjoint and complete when divisible."""
from __future__ import annotations

import numpy as np
import pytest

import autopar.dataset as ds
from autopar.dataset import config
from autopar.errors import DatasetError


def shard_values(n, shards, shuffle=True, epoch=0, **kw):
    out = []
    for k in range(shards):
        d = ds.NumpySlicesDataset(np.arange(n), shuffle=shuffle, num_shards=shards, shard_id=k, **kw)
        out.append([int(v) for (v,) in d.iter_epoch(epoch, output_numpy=True)])
    return out


@pytest.mark.parametrize("shuffle", [True, False])
def test_divisible_shards_are_disjoint_and_complete(shuffle):
    parts = shard_values(100, 4, shuffle)
    assert [len(p) for p in parts] == [25] * 4
    flat = sum(parts, [])
    assert sorted(flat) == list(range(100))
    if not shuffle:
        assert parts[1] == list(range(1, 100, 4))


def test_non_divisible_shards_have_equal_size_and_cover_everything():
    parts = shard_values(10, 4)
    assert [len(p) for p in parts] == [3, 3, 3, 3]
    flat = sum(parts, [])
    assert set(flat) == set(range(10)) and len(flat) == 12  # 2 rows wrapped around
    assert all(len(set(p)) == 3 for p in parts)
    d = ds.NumpySlicesDataset(np.arange(10), num_shards=4, shard_id=3).batch(2)
    assert d.get_dataset_size() == 2


def test_more_shards_than_records_warns_once_with_the_numbers():
    """num_shards > records: every shard still gets one row (equal steps), said once with how many repeat."""
    with pytest.warns(UserWarning) as got:
        parts = shard_values(3, 8, shuffle=False)
        shard_values(3, 8, shuffle=False)
    assert parts == [[0], [1], [2], [0], [1], [2], [0], [1]]
    said = [str(w.message) for w in got if "num_shards" in str(w.message)]
    assert said == ["autopar: NumpySlicesDataset: num_shards=8 is more than its 3 records: each shard sees 1 record "
                    "per pass, and 5 of the 8 shards see a copy of another shard's record (use at most 3 shards, "
                    "or more data)"]
    # shown at the user's line that made the dataset, not at autopar's own ``self._init_pipeline(...)``
    assert [w.filename for w in got if "num_shards" in str(w.message)] == [shard_values.__code__.co_filename]


def test_shards_stay_disjoint_every_epoch_and_reshuffle():
    e0, e1 = shard_values(60, 3, epoch=0), shard_values(60, 3, epoch=1)
    for parts in (e0, e1):
        assert sorted(sum(parts, [])) == list(range(60))
    assert e0 != e1
    config.set_seed(5)
    assert shard_values(60, 3, epoch=0) != e0


def test_cifar_shards_partition_the_records(cifar_small):
    seen = []
    for k in range(2):
        d = ds.Cifar10Dataset(cifar_small, usage="train", num_shards=2, shard_id=k).batch(40)
        assert d.get_dataset_size() == 4
        for img, _ in d.iter_epoch(0, output_numpy=True):
            seen.extend(row.tobytes() for row in img)
    assert len(seen) == 320 and len(set(seen)) == 320


def test_num_samples_caps_rows_per_shard():
    parts = shard_values(100, 4, num_samples=7)
    assert [len(p) for p in parts] == [7] * 4 and len(set(sum(parts, []))) == 28


@pytest.mark.parametrize("kwargs,match", [
    ({"num_shards": 2}, "num_shards and shard_id must be given together"),
    ({"shard_id": 0}, "num_shards and shard_id must be given together"),
    ({"num_shards": 2, "shard_id": 2}, r"shard_id must be in \[0, 2\), got 2"),
    ({"num_shards": 0, "shard_id": 0}, "num_shards must be >= 1"),
    ({"num_samples": 0}, "num_samples must be >= 1"),
    ({"num_shards": 2.0, "shard_id": 0}, "num_shards must be an integer"),
])
def test_shard_argument_errors(kwargs, match, cifar_small):
    with pytest.raises(DatasetError, match="NumpySlicesDataset: " + match):
        ds.NumpySlicesDataset(np.arange(4), **kwargs)
    with pytest.raises(DatasetError, match="Cifar10Dataset: " + match):
        ds.Cifar10Dataset(cifar_small, **kwargs)
