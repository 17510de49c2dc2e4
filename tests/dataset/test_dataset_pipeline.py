"""Pipeline semantics: sizes, shuffles, epochs, exact resume, maps, prefetch thread lifecycle."""
from __future__ import annotations

import gc
import itertools
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import autopar.dataset as ds
import autopar.dataset.transforms as transforms
import autopar.dataset.vision as vision
from autopar.dataset import config
from autopar.errors import DatasetError


def numbers(n=10, shuffle=False):
    return ds.NumpySlicesDataset({"x": np.arange(n)}, shuffle=shuffle)


def values(dataset, epoch=0, start_step=0):
    return [item[0].tolist() for item in dataset.iter_epoch(epoch, start_step, output_numpy=True)]


def image_pipeline(n=70, batch=8, **batch_kw):
    imgs = np.random.default_rng(0).integers(0, 256, size=(n, 12, 12, 3), dtype=np.uint8)
    d = ds.NumpySlicesDataset({"image": imgs, "label": np.arange(n, dtype=np.uint32)})
    d = d.map([vision.RandomCrop(10, 2), vision.RandomHorizontalFlip(), vision.Rescale(1 / 255, 0)], "image")
    d = d.map(transforms.TypeCast(torch.int32), "label").shuffle(7)
    return d.batch(batch, **batch_kw) if batch else d


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_batch_drop_remainder_and_repeat_sizes():
    d = numbers(10)
    assert d.batch(3).get_dataset_size() == 4
    assert values(d.batch(3))[-1] == [9]
    assert d.batch(3, drop_remainder=True).get_dataset_size() == 3
    assert values(d.batch(3, drop_remainder=True))[-1] == [6, 7, 8]
    r = d.batch(3).repeat(3)
    assert r.get_dataset_size() == 12 and len(values(r)) == 12 and r.get_repeat_count() == 3
    crossing = d.repeat(2).batch(3)  # batches cross the pass boundary
    assert crossing.get_dataset_size() == 7 and values(crossing)[3] == [9, 0, 1]
    assert d.batch(4).get_batch_size() == 4 and d.get_batch_size() == 1
    forever = d.batch(4).repeat()
    with pytest.raises(DatasetError, match="repeats forever"):
        forever.get_dataset_size()
    assert forever.get_repeat_count() == -1
    assert len(list(itertools.islice(forever.iter_epoch(0), 25))) == 25
    assert ds.NumpySlicesDataset(np.arange(3)).batch(4, True).repeat(-1).get_repeat_count() == -1
    with pytest.raises(DatasetError, match="produced no data"):
        next(iter(ds.NumpySlicesDataset(np.arange(3)).batch(4, True).repeat(-1)))


def test_shuffle_is_deterministic_per_epoch_and_seed():
    build = lambda: numbers(50).shuffle(8)  # noqa: E731
    a, b = build(), build()
    assert values(a, 0) == values(b, 0)
    assert sorted(values(a, 0)) == list(range(50))
    assert values(a, 0) != values(a, 1)
    assert values(a, 0) != list(range(50))
    config.set_seed(123)  # read when iteration starts: applies to pipelines built before
    assert values(a, 0) != values(b, 1)
    seeded = values(a, 0)
    config.set_seed(0)
    assert seeded != values(a, 0)
    shuffled_source = ds.NumpySlicesDataset({"x": np.arange(50)})  # shuffle=None means True
    assert sorted(values(shuffled_source)) == list(range(50)) and values(shuffled_source) != list(range(50))
    assert values(numbers(20).shuffle(1), 0) == list(range(20))  # buffer of 1 keeps the order
    batches = values(numbers(20).batch(2).shuffle(4), 0)  # shuffle after batch moves whole batches
    assert sorted(batches) == [[i, i + 1] for i in range(0, 20, 2)] and batches != sorted(batches)


def test_random_transforms_deterministic_under_seed_and_differ_across_epochs():
    d = image_pipeline()
    e0, e0_again, e1 = list(d.iter_epoch(0)), list(d.iter_epoch(0)), list(d.iter_epoch(1))
    assert_same(e0, e0_again)
    assert_same(e0, list(image_pipeline().iter_epoch(0)))
    assert not torch.equal(e0[0][0], e1[0][0])
    config.set_seed(9)
    assert not torch.equal(e0[0][0], next(iter(image_pipeline().iter_epoch(0)))[0])


def test_iterators_advance_the_epoch_counter():
    d = image_pipeline()
    first, second = list(d), list(d)  # plain iteration: one epoch each
    assert_same(first, list(d.iter_epoch(0)))
    assert_same(second, list(d.iter_epoch(1)))
    it = d.create_tuple_iterator(num_epochs=2, output_numpy=True)
    assert_same(list(it), list(d.iter_epoch(2, output_numpy=True)))
    assert_same(list(it), list(d.iter_epoch(3, output_numpy=True)))
    assert list(it) == []
    only = next(d.create_tuple_iterator(columns=["label"], output_numpy=True))
    assert len(only) == 1 and only[0].dtype == np.int32
    dct = next(d.create_dict_iterator())
    assert list(dct) == ["image", "label"] and dct["image"].shape == (8, 10, 10, 3)


@pytest.mark.parametrize("batch,k", [(8, 0), (8, 3), (8, 8), (8, 9), (None, 5), (None, 300), (None, 600)])
def test_iter_epoch_start_step_equals_tail_of_full_epoch(batch, k):
    d = image_pipeline(n=600 if batch is None else 70, batch=batch)
    full = list(d.iter_epoch(2, output_numpy=True))
    tail = list(d.iter_epoch(2, start_step=k, output_numpy=True))
    assert_same(full[k:], tail)


def test_start_step_skips_transform_work():
    calls = []

    def spy(x):
        calls.append(int(x))
        return x

    d = numbers(40).map(spy, "x").batch(4)
    list(d.iter_epoch(0, start_step=7))
    assert sorted(calls) == list(range(28, 40))


def test_prefetch_depth_does_not_change_results():
    config.set_prefetch_size(0)
    sync = list(image_pipeline().iter_epoch(1))
    config.set_prefetch_size(5)
    assert_same(sync, list(image_pipeline().iter_epoch(1)))


def test_map_user_callables_columns_and_project():
    d = ds.NumpySlicesDataset({"a": np.arange(6), "b": np.arange(6) * 10}, shuffle=False)
    both = d.map(lambda a, b: (a + b, a * b), input_columns=["a", "b"], output_columns=["s", "p"])
    assert both.get_col_names() == ["s", "p"]
    assert values(both.project("p").batch(6)) == [[0, 10, 40, 90, 160, 250]]
    renamed = d.map(lambda a: a * 2, "b", output_columns="c")
    assert renamed.get_col_names() == ["a", "c"]
    after_batch = d.batch(3).map(lambda b: b.sum(keepdims=True), "b")  # gets the whole batch
    assert [int(b[0]) for _, b in after_batch.iter_epoch(0, output_numpy=True)] == [30, 120]
    assert d.project(["b", "a"]).get_col_names() == ["b", "a"]
    assert d.output_shapes() == [[], []]
    assert d.batch(4).output_types() == [torch.int64, torch.int64]
    composed = d.map(transforms.Compose([lambda a: a + 1, transforms.TypeCast("float32")]), "a")
    assert composed.batch(6).output_types()[0] == torch.float32


def test_pipeline_errors_are_one_line_dataset_errors():
    d = numbers(10)
    with pytest.raises(DatasetError, match=r"map: unknown column\(s\) \['nope'\]"):
        d.map(lambda v: v, "nope")
    with pytest.raises(DatasetError, match="not callable"):
        d.map([1], "x")
    with pytest.raises(DatasetError, match="already batched"):
        d.batch(2).batch(2)
    with pytest.raises(DatasetError, match="repeat: count"):
        d.repeat(0)
    with pytest.raises(DatasetError, match="shuffle: buffer_size"):
        d.shuffle(0)
    with pytest.raises(DatasetError, match="iter_epoch: start_step"):
        d.iter_epoch(0, start_step=-1)
    with pytest.raises(DatasetError, match="num_epochs"):
        d.create_tuple_iterator(num_epochs=0)
    ragged = d.map(lambda v: np.zeros(int(v) % 2 + 1), "x").batch(2)
    with pytest.raises(DatasetError, match="batch: rows of column 'x' have different shapes"):
        list(ragged)
    assert len(list(d.map(lambda v: np.zeros(int(v) % 2 + 1), "x"))) == 10  # fine unbatched


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "autopar-dataset-prefetch" and t.is_alive()]


def wait_no_threads(timeout=5.0):
    deadline = time.monotonic() + timeout
    while prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    return prefetch_threads()


def test_producer_exception_reaches_consumer_and_thread_ends():
    def boom(v):
        if int(v) == 13:
            raise ValueError("bad row 13")
        return v

    with pytest.raises(DatasetError, match="map: operation boom failed .*ValueError: bad row 13"):
        for _ in numbers(40).map(boom, "x").batch(4):
            pass
    assert wait_no_threads() == []


def test_prefetch_thread_stops_when_consumer_stops_early():
    d = image_pipeline(n=400)
    gen = d.iter_epoch(0)
    next(gen)
    assert prefetch_threads()
    del gen
    gc.collect()
    assert wait_no_threads() == []
    it = d.create_tuple_iterator()
    next(it)
    it.stop()
    assert wait_no_threads() == []
    for _ in d:  # break out of a plain loop, drop the iterator
        break
    gc.collect()
    assert wait_no_threads() == []


def test_interpreter_exit_does_not_hang_with_a_live_iterator():
    script = textwrap.dedent("""
        import numpy as np, autopar.dataset as ds
        d = ds.NumpySlicesDataset(np.zeros((5000, 8, 8, 3), np.uint8)).batch(2)
        it = iter(d)
        next(it)
        keep = it  # still referenced at exit, producer blocked on a full queue
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
