"""The ``Dataset`` pipeline: immutable chaining of map / shuffle / batch / repeat / project, and iteration.

How an epoch is executed (and why):

1. The operations are split into *index* stages (shuffle, repeat, batch) and *data* stages (map, project).
   Maps placed before ``batch`` are row-wise, so the final order of the epoch's rows and the composition of
   every batch can be computed from indices alone (:mod:`autopar.dataset.streams`).
2. For each batch (or each chunk of ``ROW_CHUNK`` rows when there is no ``batch``) the raw rows are gathered
   with one fancy-indexing call and every row-level map runs once on the whole ``(N, H, W, C)`` array (our own
   transforms; arbitrary user callables fall back to one call per row). Maps after ``batch`` get the batch.
3. The random numbers of a batch come from a Generator keyed by (seed, epoch, shard, step): an epoch can be
   started at any step and produces the same values as a full pass (exact resume), whatever ran before.
4. Batches are computed ``config.get_prefetch_size()`` ahead in a background thread
   (:mod:`autopar.dataset.prefetch`).
"""
from __future__ import annotations

import itertools
import math
import threading
from typing import TYPE_CHECKING, Iterator

import numpy as np

from autopar.dataset import _random, config, streams
from autopar.dataset.operations import (
    _apply_map,
    _Batch,
    _check_known,
    _column_list,
    _Map,
    _numpy_to_torch_dtype,
    _positive_int,
    _Project,
    _Repeat,
    _Shuffle,
    _Take,
    _to_output,
    job_device,
)
from autopar.dataset.prefetch import Prefetcher
from autopar.dataset.sampler import ShardSampler
from autopar.dataset.sources import Source
from autopar.dataset.transforms.ops import Compose, Transform
from autopar.errors import DatasetError

if TYPE_CHECKING:
    from autopar.dataset.iterator import DatasetIterator

ROW_CHUNK = 256  # rows processed together when the pipeline has no batch op


class Dataset:
    """A pipeline over a source. Every operation returns a new ``Dataset``; the receiver is unchanged.

    Iterating (``for image, label in ds``) runs one epoch of :meth:`create_tuple_iterator`. Each new iterator,
    and each epoch of a multi-epoch iterator, takes the next epoch number of this object, so shuffles and random
    transforms differ between epochs and are identical on every process that builds the same pipeline.
    """

    # -- construction --------------------------------------------------------------------------------------
    def _init_pipeline(self, source: Source, sampler: ShardSampler) -> None:
        self._source = source
        self._sampler = sampler
        self._ops: tuple = ()
        self._columns = list(source.column_names)
        self._finish_init()

    def _finish_init(self) -> None:
        self._next_epoch = 0
        self._lock = threading.Lock()
        self._peek = None
        self._compile()

    def _derive(self, op, columns: list[str]) -> "Dataset":
        new = object.__new__(Dataset)
        new._source, new._sampler = self._source, self._sampler
        new._ops = self._ops + (op,)
        new._columns = columns
        new._finish_init()
        return new

    def __getstate__(self):
        state = dict(self.__dict__)
        for key in ("_lock", "_peek", "_factory"):
            state.pop(key, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._peek = None
        self._compile()

    def _compile(self) -> None:
        """Split the operations into index stages and row / batch data stages (see the module docstring)."""
        self._row_data: list = []
        self._batch_data: list = []
        self._batch: _Batch | None = None
        shard = self._sampler.shard_id
        factory = streams.source_stage(self._sampler)
        for pos, op in enumerate(self._ops):
            if isinstance(op, (_Map, _Project)):
                (self._row_data if self._batch is None else self._batch_data).append(op)
            elif isinstance(op, _Shuffle):
                factory = streams.shuffle_stage(factory, op.buffer_size, pos, shard, rows=self._batch is None)
            elif isinstance(op, _Repeat):
                factory = streams.repeat_stage(factory, op.count)
            elif isinstance(op, _Batch):
                self._batch = op
                factory = streams.batch_stage(factory, op.batch_size, op.drop_remainder)
            elif isinstance(op, _Take):
                factory = streams.take_stage(factory, op.count, rows=self._batch is None)
        self._factory = factory

    # -- pipeline operations ------------------------------------------------------------------------------
    def map(self, operations, input_columns=None, output_columns=None, column_order=None,
            num_parallel_workers=None, python_multiprocessing=False, cache=None, callbacks=None,
            max_rowsize=None, offload=None) -> "Dataset":
        """Apply ``operations`` (one callable or a list, applied in order) to ``input_columns``.

        autopar transforms run vectorised on whole batches; any other callable is called once per row with
        numpy arrays (once per batch when the map follows ``batch``). Outputs replace the input columns at the
        position of the first one, named ``output_columns`` (default: ``input_columns``).
        ``num_parallel_workers`` and the multiprocessing/cache options are accepted and ignored.
        """
        where = "map"
        ops = operations if isinstance(operations, (list, tuple)) else [operations]
        flat: list = []
        for fn in ops:
            if not callable(fn):
                raise DatasetError(f"{where}: operation {fn!r} is not callable")
            flat.extend(fn.flatten() if isinstance(fn, Compose) else [fn])
        if not flat:
            raise DatasetError(f"{where}: operations is empty")
        ins = [self._columns[0]] if input_columns is None else _column_list(input_columns, "input_columns", where)
        _check_known(ins, self._columns, where)
        outs = list(ins) if output_columns is None else _column_list(output_columns, "output_columns", where)
        if isinstance(flat[0], Transform) and len(ins) != 1:
            raise DatasetError(f"{where}: {type(flat[0]).__name__} takes one column, got input_columns {ins}")
        clash = [c for c in outs if c in self._columns and c not in ins]
        if clash:
            raise DatasetError(f"{where}: output column(s) {clash} already exist and are not input columns")
        columns: list[str] = []
        for c in self._columns:
            if c == ins[0]:
                columns.extend(outs)
            elif c not in ins:
                columns.append(c)
        ds = self._derive(_Map(tuple(flat), tuple(ins), tuple(outs)), columns)
        return ds.project(column_order) if column_order is not None else ds

    def shuffle(self, buffer_size: int) -> "Dataset":
        """Buffer shuffle (MindSpore semantics) of the rows -- or of the batches when after ``batch`` --
        reshuffled every epoch, deterministic under ``config.set_seed``."""
        size = _positive_int(buffer_size, "buffer_size", "shuffle")
        return self._derive(_Shuffle(size), list(self._columns))

    def batch(self, batch_size: int, drop_remainder: bool = False, num_parallel_workers=None,
              per_batch_map=None, input_columns=None, output_columns=None, **kwargs) -> "Dataset":
        """Stack ``batch_size`` consecutive rows; the last smaller batch is kept unless ``drop_remainder``."""
        if per_batch_map is not None or input_columns is not None or output_columns is not None:
            raise DatasetError("batch: per_batch_map / input_columns / output_columns are not supported; "
                               "use map() after batch() instead")
        if callable(batch_size):
            raise DatasetError("batch: a callable batch_size is not supported")
        size = _positive_int(batch_size, "batch_size", "batch")
        if self._batch is not None:
            raise DatasetError("batch: the pipeline is already batched (batch of batches is not supported)")
        return self._derive(_Batch(size, bool(drop_remainder)), list(self._columns))

    def repeat(self, count: int | None = None) -> "Dataset":
        """Repeat the pipeline ``count`` times per epoch (None or -1: forever; each pass reshuffles)."""
        if count is None or (not isinstance(count, bool) and count == -1):
            return self._derive(_Repeat(None), list(self._columns))
        return self._derive(_Repeat(_positive_int(count, "count (or -1/None)", "repeat")), list(self._columns))

    def take(self, count: int = -1) -> "Dataset":
        """The first ``count`` items of each epoch (rows, or batches after ``batch``; -1: all), as MindSpore's."""
        if not isinstance(count, bool) and count == -1:
            return self
        return self._derive(_Take(_positive_int(count, "count (or -1)", "take")), list(self._columns))

    def project(self, columns) -> "Dataset":
        """Keep only ``columns``, in that order."""
        cols = _column_list(columns, "columns", "project")
        _check_known(cols, self._columns, "project")
        return self._derive(_Project(tuple(cols)), cols)

    # -- introspection ------------------------------------------------------------------------------------
    def _size(self) -> float:
        n: float = len(self._sampler)
        for op in self._ops:
            if isinstance(op, _Repeat):
                n = math.inf if op.count is None else n * op.count
            elif isinstance(op, _Batch) and n != math.inf:
                n = n // op.batch_size if op.drop_remainder else -(-n // op.batch_size)
            elif isinstance(op, _Take):
                n = min(n, op.count)
        return n

    def get_dataset_size(self) -> int:
        """Rows per epoch (batches once batched), repeats included."""
        n = self._size()
        if n == math.inf:
            raise DatasetError("get_dataset_size: the pipeline repeats forever (repeat() with count None/-1), "
                               "so it has no size")
        return int(n)

    def get_batch_size(self) -> int:
        """The batch size, 1 when the pipeline is not batched (as MindSpore)."""
        return self._batch.batch_size if self._batch is not None else 1

    def get_repeat_count(self) -> int:
        """Product of the repeat counts, -1 when repeating forever."""
        n = 1
        for op in self._ops:
            if isinstance(op, _Repeat):
                if op.count is None:
                    return -1
                n *= op.count
        return n

    def get_col_names(self) -> list[str]:
        return list(self._columns)

    def _first_row(self):
        if self._peek is None:
            gen = self._epoch_items(0, 0, output_numpy=True, columns=None, do_copy=False, prefetch=0)
            try:
                item = next(gen)
            except StopIteration:
                raise DatasetError("output_shapes: the pipeline produces no data") from None
            finally:
                gen.close()
            self._peek = ([list(np.shape(v)) for v in item], [_numpy_to_torch_dtype(np.asarray(v).dtype) for v in item])
        return self._peek

    def output_shapes(self) -> list[list[int]]:
        """Shapes of the first item of an epoch (of the first batch once batched), one list per column."""
        return [list(s) for s in self._first_row()[0]]

    def output_types(self) -> list:
        """Types of the columns: torch dtypes (numpy dtypes where torch has none, e.g. strings)."""
        return list(self._first_row()[1])

    def __repr__(self) -> str:
        parts = [f"{self._source.name}(rows={self._source.num_rows}, shard={self._sampler.shard_id}/"
                 f"{self._sampler.num_shards}, shuffle={self._sampler.shuffle})"]
        for op in self._ops:
            parts.append(repr(op).lstrip("_"))
        return " -> ".join(parts)

    # -- iteration ----------------------------------------------------------------------------------------
    def _claim_epoch(self) -> int:
        with self._lock:
            epoch = self._next_epoch
            self._next_epoch += 1
            return epoch

    def _process(self, idx: np.ndarray, rng: np.random.Generator) -> dict:
        cols = self._source.gather(idx)
        for op in self._row_data:
            cols = _apply_map(op, cols, rng, True) if isinstance(op, _Map) else {c: cols[c] for c in op.columns}
        if self._batch is not None:
            for name, v in cols.items():
                if isinstance(v, list):
                    shapes = sorted({np.shape(r) for r in v})
                    raise DatasetError(f"batch: rows of column '{name}' have different shapes {shapes[:3]}; "
                                       "map a Resize/crop before batch()")
            for op in self._batch_data:
                cols = _apply_map(op, cols, rng, False) if isinstance(op, _Map) else {c: cols[c] for c in op.columns}
        return cols

    def _units(self, epoch: int, first_unit: int, seed: int) -> Iterator[dict]:
        """Processed batches (or row chunks) of ``epoch`` from unit ``first_unit`` on; runs in the prefetcher."""
        stream = self._factory((epoch,), seed)
        if self._batch is None:
            stream = streams.regroup(stream, ROW_CHUNK, False)
        shard = self._sampler.shard_id
        for step, idx in enumerate(itertools.islice(stream, first_unit, None), first_unit):
            yield self._process(idx, _random.generator(seed, _random.TAG_TRANSFORM, shard, step, 1, epoch))

    def _epoch_items(self, epoch, start_step, output_numpy, columns, do_copy, prefetch=None):
        names = list(self._columns) if columns is None else columns
        if self._batch is not None:
            first_unit, skip = start_step, 0
        else:
            first_unit, skip = divmod(start_step, ROW_CHUNK)
        producer = self._units(epoch, first_unit, config.get_seed())  # seed fixed for the whole epoch
        depth = config.get_prefetch_size() if prefetch is None else prefetch
        units = Prefetcher(producer, depth) if depth > 0 else producer
        device = job_device()
        try:
            for cols in units:
                vals = [cols[c] for c in names]
                if self._batch is not None:
                    yield [_to_output(v, output_numpy, False, device) for v in vals]
                    continue
                for i in range(skip, len(vals[0])):
                    yield [_to_output(v[i], output_numpy, do_copy, device) for v in vals]
                skip = 0
        finally:
            units.close()

    def iter_epoch(self, epoch: int, start_step: int = 0, output_numpy: bool = False, columns=None,
                   do_copy: bool = True) -> Iterator[list]:
        """Iterate epoch number ``epoch`` (0-based) from item ``start_step`` on (items are batches once batched).

        Skipped batches are never gathered nor transformed, yet the items produced equal those of a full
        iteration of the epoch (without ``batch``, rows are processed in chunks of ``ROW_CHUNK``: the chunk
        holding ``start_step`` is processed whole). Does not advance this dataset's epoch counter.
        """
        for name, v in (("epoch", epoch), ("start_step", start_step)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise DatasetError(f"iter_epoch: {name} must be a non-negative integer, got {v!r}")
        names = None
        if columns is not None:
            names = _column_list(columns, "columns", "iter_epoch")
            _check_known(names, self._columns, "iter_epoch")
        return self._epoch_items(int(epoch), int(start_step), output_numpy, names, do_copy)

    def create_tuple_iterator(self, columns=None, num_epochs: int = -1, output_numpy: bool = False,
                              do_copy: bool = True) -> "DatasetIterator":
        """Iterator of lists (one value per column, in column order): torch tensors, or numpy arrays when
        ``output_numpy``. Re-iterate it for the next epoch; ``num_epochs=-1`` allows any number."""
        names = None
        if columns is not None:
            names = _column_list(columns, "columns", "create_tuple_iterator")
            _check_known(names, self._columns, "create_tuple_iterator")
        from autopar.dataset.iterator import DatasetIterator

        return DatasetIterator(self, names, num_epochs, output_numpy, do_copy, as_dict=False)

    def create_dict_iterator(self, num_epochs: int = -1, output_numpy: bool = False,
                             do_copy: bool = True) -> "DatasetIterator":
        """Like :meth:`create_tuple_iterator` but yields ``{column: value}`` dicts."""
        from autopar.dataset.iterator import DatasetIterator

        return DatasetIterator(self, None, num_epochs, output_numpy, do_copy, as_dict=True)

    def __iter__(self):
        return self._epoch_items(self._claim_epoch(), 0, False, None, True)
