"""The datasets over in-memory arrays and CIFAR-10's binary files (MNIST and Python sources: ``mnist.py``,
``generator.py``), each a :class:`~autopar.dataset.pipeline.Dataset` over a source and a shard sampler."""
from __future__ import annotations

from typing import Any

from autopar.dataset.pipeline import Dataset
from autopar.dataset.sampler import ShardSampler, no_custom_sampler
from autopar.dataset.sources import Cifar10Source, NumpySlicesSource


class Cifar10Dataset(Dataset):
    """CIFAR-10 from the binary files (``cifar-10-batches-bin``, or a directory containing it).

    Columns ``image`` (uint8, 32x32x3 HWC) and ``label`` (uint32 scalar). ``usage``: 'train'
    (``data_batch_1..5.bin``), 'test' (``test_batch.bin``), or 'all' -- also what None (the default) reads, as in
    MindSpore: the 50000 training and the 10000 test images. ``shuffle=None`` means True.
    ``num_shards``/``shard_id``: MindSpore DistributedSampler sharding (equal-size shards); ``num_samples``
    caps the rows per shard. ``num_parallel_workers`` / ``cache`` are accepted and ignored.
    """

    def __init__(self, dataset_dir, usage=None, num_samples=None, num_parallel_workers=None, shuffle=None,
                 sampler=None, num_shards=None, shard_id=None, cache=None):
        no_custom_sampler(sampler, "Cifar10Dataset")
        shard_sampler = ShardSampler(shuffle, num_shards, shard_id, num_samples, where="Cifar10Dataset")
        source = Cifar10Source(dataset_dir, "all" if usage is None else usage)
        self._init_pipeline(source, shard_sampler.bind(source.num_rows))


class NumpySlicesDataset(Dataset):
    """Rows sliced from in-memory arrays: ``data`` is a dict of arrays (keys are the column names), a tuple of
    arrays (``column_0``, ``column_1`` ...) or a single array/list/tensor. Same sampling options as
    :class:`Cifar10Dataset`."""

    def __init__(self, data: Any, column_names=None, num_samples=None, num_parallel_workers=None, shuffle=None,
                 sampler=None, num_shards=None, shard_id=None):
        no_custom_sampler(sampler, "NumpySlicesDataset")
        shard_sampler = ShardSampler(shuffle, num_shards, shard_id, num_samples, where="NumpySlicesDataset")
        source = NumpySlicesSource(data, column_names)
        self._init_pipeline(source, shard_sampler.bind(source.num_rows))
