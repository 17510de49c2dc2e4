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
        self.cpu: list[tuple[float, float]] = []  # (user, system) seconds of the whole process at each step's end
        self.first_step_wall: float | None = None

    def tick(self) -> None:
        self.ends.append(time.perf_counter())
        use = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu.append((use.ru_utime, use.ru_stime))
        if self.first_step_wall is None:
            self.first_step_wall = time.time()

    def steady(self) -> float:
        gaps = [b - a for a, b in zip(self.ends[self.warmup:], self.ends[self.warmup + 1:])]
        return statistics.median(gaps) if gaps else float("nan")

    def steady_cpu(self) -> tuple[float, float]:
        """Median CPU seconds (user + system, all threads) per steady step, and its system part."""
        marks = self.cpu[self.warmup:]
        if len(marks) < 2:
            return float("nan"), float("nan")
        spans = [(u1 + s1 - u0 - s0, s1 - s0) for (u0, s0), (u1, s1) in zip(marks, marks[1:])]
        return statistics.median(c for c, _ in spans), statistics.median(s for _, s in spans)

    def report(self, name: str, rank: int, world: int, batch: int, **extra) -> None:
        step = self.steady()
        cpu, system = self.steady_cpu()
        t0 = float(os.environ.get("BENCH_T0", "nan"))
        out = {
            "bench": name, "rank": rank, "world": world, "batch_per_rank": batch, "steps": len(self.ends),
            "steady_step_s": step, "images_per_s": world * batch / step,
            "launch_to_first_step_s": self.first_step_wall - t0, "peak_rss_mb": peak_rss_mb(),
            "pss_mb": pss_mb(), "cpu_step_s": cpu, "system_step_s": system,
            "threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0),
            "step_gaps_s": [round(b - a, 4) for a, b in zip(self.ends, self.ends[1:])], **extra,
        }
        emit(out)


def emit(row: dict) -> None:
    """One ``BENCH {json}`` line in a single write: ranks share the launcher's stdout, and print() writes the
    newline separately, which lets two ranks' lines interleave."""
    os.write(1, ("BENCH " + json.dumps(row) + "\n").encode())


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def pss_mb() -> float | None:
    """Proportional set size now: pages shared between ranks (a shared-memory segment) counted once in all, split
    between the processes that map them -- the resident size counts them in full in every rank."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def hand_loop(model, opt, batches, clock: StepClock) -> None:
    """What a PyTorch user writes: cross-entropy, zero_grad, backward, step; the clock ticks after each step."""
    import torch.nn.functional as F

    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
        clock.tick()
