"""Throughput of the MindSpore tutorial's CIFAR-10 input pipeline on autopar.dataset (not a test).

Generates full-size synthetic CIFAR-10 (60000 records) in a temporary directory, then times the tutorial's
``create_dataset`` (random crop + flip + resize + rescale + normalize + HWC2CHW, shuffle 10, batch 32) at
32x32 (no resize) and 224x224, and prints one JSON object with images/s.

    python bench/data_pipeline.py [--batches N] [--repeats R] [--prefetch P]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

import autopar.dataset as ds
import autopar.dataset.transforms as transforms
import autopar.dataset.vision as vision
from autopar.dataset.synth import write_synthetic_cifar10


def create_dataset(data_path, resize=None, batch_size=32, rank_id=0, rank_size=1):
    """The tutorial's create_dataset; ``resize=None`` leaves the 32x32 images unresized."""
    data_set = ds.Cifar10Dataset(data_path, num_shards=rank_size, shard_id=rank_id)
    c_trans = [vision.RandomCrop((32, 32), (4, 4, 4, 4)), vision.RandomHorizontalFlip()]
    if resize:
        c_trans.append(vision.Resize((resize, resize)))
    c_trans += [vision.Rescale(1.0 / 255.0, 0.0),
                vision.Normalize((0.4465, 0.4822, 0.4914), (0.2010, 0.1994, 0.2023)),
                vision.HWC2CHW()]
    data_set = data_set.map(operations=transforms.TypeCast(torch.int32), input_columns="label")
    data_set = data_set.map(operations=c_trans, input_columns="image")
    data_set = data_set.shuffle(buffer_size=10)
    return data_set.batch(batch_size=batch_size, drop_remainder=True)


def _run_once(data_set, batches: int) -> tuple[int, float, list]:
    it = data_set.create_tuple_iterator()
    start = time.perf_counter()
    n, shape = 0, None
    for i, (image, _label) in enumerate(it):
        n += image.shape[0]
        shape = list(image.shape)
        if i + 1 >= batches:
            break
    seconds = time.perf_counter() - start
    it.stop()
    return n, seconds, shape


def measure(data_set, batches: int, repeats: int) -> dict:
    """images/s over ``batches`` batches, ``repeats`` times (each a new epoch); best and median reported
    because a shared 2-core machine makes single runs noisy."""
    runs = [_run_once(data_set, batches) for _ in range(repeats)]
    rates = sorted(n / s for n, s, _ in runs)
    return {"images_per_s_best": round(rates[-1], 1), "images_per_s_median": round(rates[len(rates) // 2], 1),
            "images_per_run": runs[0][0], "runs": repeats, "batch_shape": runs[0][2]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=100, help="batches timed per run at 32x32 (1/4 at 224)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration")
    parser.add_argument("--prefetch", type=int, default=None, help="config.set_prefetch_size (default: keep 2)")
    args = parser.parse_args(argv)
    if args.prefetch is not None:
        ds.config.set_prefetch_size(args.prefetch)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = write_synthetic_cifar10(tmp)
        synth_s = time.perf_counter() - start
        result = {
            "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "prefetch_size": ds.config.get_prefetch_size(),
            "synth_cifar10_60000_s": round(synth_s, 2),
            "tutorial_32x32": measure(create_dataset(path, resize=None), args.batches, args.repeats),
            "tutorial_224x224": measure(create_dataset(path, resize=224), max(1, args.batches // 4), args.repeats),
        }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
