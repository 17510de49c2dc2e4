"""Run a producer iterator in a background thread, a bounded queue ahead of the consumer.

Why a thread (not processes): the heavy work (gathers, numpy arithmetic, torch interpolate) releases the GIL,
so one producer thread overlaps data preparation with the training step without pickling batches between
processes. Shutdown rules: the thread is a daemon, never blocks forever (puts use a timeout and re-check a stop
event), always ends the stream with a sentinel or the producer's exception (re-raised in the consumer), and
:meth:`Prefetcher.close` -- called when the consumer finishes, stops early or is garbage-collected, and for any
survivors at interpreter exit -- stops it.
"""
from __future__ import annotations

import atexit
import queue
import threading
import weakref
from typing import Iterator

_END = object()
_POLL_S = 0.05


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(producer: Iterator, q: queue.Queue, stop: threading.Event) -> None:
    # Module-level on purpose: the thread must not reference the Prefetcher, or the consumer could never be
    # garbage-collected while the thread runs.
    try:
        for item in producer:
            if not _put(q, item, stop):
                return
        _put(q, _END, stop)
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer
        _put(q, _Failure(exc), stop)
    finally:
        close = getattr(producer, "close", None)
        if close is not None:
            close()


_live: "weakref.WeakSet[Prefetcher]" = weakref.WeakSet()


class Prefetcher:
    """Iterator over ``producer``'s items computed ``depth`` items ahead in a daemon thread."""

    def __init__(self, producer: Iterator, depth: int):
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=_produce, args=(producer, self._q, self._stop),
                                        name="autopar-dataset-prefetch", daemon=True)
        self._thread.start()
        _live.add(self)

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        item = self._q.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        return item

    def close(self, timeout: float = 5.0) -> None:
        """Stop the producer thread and wait for it (bounded)."""
        self._done = True
        self._stop.set()
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __del__(self):
        try:
            self.close(timeout=1.0)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


@atexit.register
def _stop_all() -> None:
    for p in list(_live):
        p.close(timeout=1.0)
