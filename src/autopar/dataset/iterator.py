"""``create_tuple_iterator`` / ``create_dict_iterator``: MindSpore's multi-epoch iterator over a dataset."""
from __future__ import annotations

import numpy as np

from autopar.errors import DatasetError


class DatasetIterator:
    """Multi-epoch iterator: raises StopIteration at the end of each epoch; iterating it again starts the
    next epoch (a new epoch number of the dataset), up to ``num_epochs`` (-1: unlimited)."""

    def __init__(self, dataset, columns, num_epochs, output_numpy, do_copy, as_dict):
        if isinstance(num_epochs, bool) or not isinstance(num_epochs, (int, np.integer)) or \
                (num_epochs < 1 and num_epochs != -1):
            raise DatasetError(f"create_iterator: num_epochs must be -1 or a positive integer, got {num_epochs!r}")
        self._ds = dataset
        self._columns = columns if columns is not None else dataset.get_col_names()
        self._num_epochs = int(num_epochs)
        self._output_numpy = output_numpy
        self._do_copy = do_copy
        self._as_dict = as_dict
        self._epochs_done = 0
        self._gen = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._gen is None:
            if self._num_epochs != -1 and self._epochs_done >= self._num_epochs:
                raise StopIteration
            epoch = self._ds._claim_epoch()
            self._gen = self._ds._epoch_items(epoch, 0, self._output_numpy, self._columns, self._do_copy)
        try:
            item = next(self._gen)
        except StopIteration:
            self._gen = None
            self._epochs_done += 1
            raise
        return dict(zip(self._columns, item)) if self._as_dict else item

    def stop(self) -> None:
        """Stop iterating (releases the prefetch thread)."""
        if self._gen is not None:
            self._gen.close()
            self._gen = None

    def __del__(self):
        try:
            self.stop()
        except Exception:  # noqa: BLE001
            pass
