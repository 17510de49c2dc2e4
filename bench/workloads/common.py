"""Timing and reporting shared by the benchmark workloads: one JSON line per rank on stdout."""
from __future__ import annotations

import json
import os
import resource
import statistics
import time


class StepClock:
    """Wall time at the end of every step; steady step time = median interval after the warm-up steps."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.start = time.perf_counter()  # when the workload was ready to train (first step = start .. ends[0])
        self.ends: list[float] = []
        self.first_step_wall: float | None = None

    def tick(self) -> None:
        self.ends.append(time.perf_counter())
        if self.first_step_wall is None:
            self.first_step_wall = time.time()

    def steady(self) -> float:
        gaps = [b - a for a, b in zip(self.ends[self.warmup:], self.ends[self.warmup + 1:])]
        return statistics.median(gaps) if gaps else float("nan")

    def report(self, name: str, rank: int, world: int, batch: int, **extra) -> None:
        step = self.steady()
        t0 = float(os.environ.get("BENCH_T0", "nan"))
        out = {
            "bench": name, "rank": rank, "world": world, "batch_per_rank": batch, "steps": len(self.ends),
            "steady_step_s": step, "images_per_s": world * batch / step,
            "launch_to_first_step_s": self.first_step_wall - t0, "peak_rss_mb": peak_rss_mb(),
            "threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0), **extra,
        }
        emit(out)


def emit(row: dict) -> None:
    """One ``BENCH {json}`` line in a single write: ranks share the launcher's stdout, and print() writes the
    newline separately, which lets two ranks' lines interleave."""
    os.write(1, ("BENCH " + json.dumps(row) + "\n").encode())


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
