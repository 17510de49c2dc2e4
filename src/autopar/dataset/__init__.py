"""``autopar.dataset``: MindSpore's ``mindspore.dataset`` API on numpy/PyTorch.

``import autopar.dataset as ds`` then ``ds.Cifar10Dataset(path, num_shards=n, shard_id=r).map(...).shuffle(...)
.batch(...).repeat(...)``, exactly as in the MindSpore distributed-training tutorials. Sources are memory-mapped,
transforms run vectorised on whole batches, a background thread prefetches, and every random decision is keyed
by (seed, epoch, shard, step) so any epoch can be replayed from any step (exact resume).
"""
from autopar.dataset import config, transforms, vision
from autopar.dataset.arrays import Cifar10Dataset, NumpySlicesDataset
from autopar.dataset.generator import GeneratorDataset
from autopar.dataset.iterator import DatasetIterator
from autopar.dataset.mnist import MnistDataset
from autopar.dataset.pipeline import Dataset

__all__ = ["Cifar10Dataset", "Dataset", "DatasetIterator", "GeneratorDataset", "MnistDataset", "NumpySlicesDataset",
           "config", "transforms", "vision"]
