"""Callbacks with MindSpore's protocol (``Callback``, ``RunContext``, ``original_args()``), and the built-ins.

``LossMonitor`` prints exactly MindSpore's line (``epoch: 1 step: 156, loss is 2.0084016``); ``TimeMonitor`` adds
images/s; ``ProgressBar`` (rank 0, only on a terminal) and ``MetricsRecorder`` (a CSV of every step written as
training goes, so nothing is lost on a crash, and a loss-curve PNG at the end) are added by ``Model.train``.
"""
from __future__ import annotations

import csv
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autopar.errors import TrainingError


class CallbackParams(dict):
    """MindSpore's ``cb_params``: a dict whose keys are also attributes."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


class RunContext:
    def __init__(self, original_args: CallbackParams):
        self._original_args = original_args
        self._stop_requested = False

    def original_args(self) -> CallbackParams:
        return self._original_args

    def request_stop(self) -> None:
        self._stop_requested = True

    def get_stop_requested(self) -> bool:
        return self._stop_requested


class Callback:
    """Override the ``on_train_*`` hooks or MindSpore's older names (``begin``, ``step_end``, ...)."""

    def begin(self, run_context: RunContext) -> None: ...
    def epoch_begin(self, run_context: RunContext) -> None: ...
    def epoch_end(self, run_context: RunContext) -> None: ...
    def step_begin(self, run_context: RunContext) -> None: ...
    def step_end(self, run_context: RunContext) -> None: ...
    def end(self, run_context: RunContext) -> None: ...

    def on_train_begin(self, run_context: RunContext) -> None:
        self.begin(run_context)

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        self.epoch_begin(run_context)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        self.epoch_end(run_context)

    def on_train_step_begin(self, run_context: RunContext) -> None:
        self.step_begin(run_context)

    def on_train_step_end(self, run_context: RunContext) -> None:
        self.step_end(run_context)

    def on_train_end(self, run_context: RunContext) -> None:
        self.end(run_context)


def loss_value(net_outputs: Any) -> float:
    """The scalar loss inside whatever the train step returned (tensor, tuple, list, number)."""
    if isinstance(net_outputs, (tuple, list)) and net_outputs:
        net_outputs = net_outputs[0]
    if isinstance(net_outputs, torch.Tensor):
        return float(net_outputs.detach().float().mean().item())
    return float(net_outputs)


def step_in_epoch(cb: CallbackParams) -> int:
    return (cb.cur_step_num - 1) % cb.batch_num + 1


class LossMonitor(Callback):
    """Print ``epoch: E step: S, loss is L`` every ``per_print_times`` steps; stop on a NaN/inf loss."""

    def __init__(self, per_print_times: int = 1):
        if not isinstance(per_print_times, int) or per_print_times < 0:
            raise ValueError("per_print_times must be a non-negative int")
        self._per_print_times = per_print_times

    def on_train_step_end(self, run_context: RunContext) -> None:
        cb = run_context.original_args()
        loss = loss_value(cb.net_outputs)
        step = step_in_epoch(cb)
        if math.isnan(loss) or math.isinf(loss):
            raise TrainingError(f"epoch: {cb.cur_epoch_num} step: {step}. Invalid loss {loss}, terminating training.")
        if self._per_print_times and (cb.cur_step_num % self._per_print_times == 0 or cb.dataset_sink_mode):
            print(f"epoch: {cb.cur_epoch_num} step: {step}, loss is {str(np.float32(loss))}", flush=True)


class TimeMonitor(Callback):
    """Print epoch time, per-step time and the job's images/s at the end of every epoch."""

    def __init__(self, data_size: int | None = None):
        self.data_size = data_size
        self._epoch_start = 0.0
        self._steps = 0

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        self._epoch_start = time.perf_counter()
        self._steps = 0

    def on_train_step_end(self, run_context: RunContext) -> None:
        self._steps += run_context.original_args().get("steps_since_callback", 1)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        cb = run_context.original_args()
        elapsed = time.perf_counter() - self._epoch_start
        steps = self.data_size or self._steps or 1
        per_step = elapsed / steps
        images = cb.get("global_batch_size", 0) / per_step if per_step > 0 else 0.0
        print(f"epoch time: {elapsed * 1000:.3f} ms, per step time: {per_step * 1000:.3f} ms, "
              f"{images:.1f} imgs/sec", flush=True)


# Set for each rank by mpirun (Open MPI, MPICH/Hydra, PMIx): its ranks write to a pseudo-terminal of mpirun's, whose
# output goes wherever mpirun's does -- usually a log, where a bar's carriage returns glue onto the loss lines.
_MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def output_is_terminal() -> bool:
    """Whether a person watches this process's output: stdout a terminal of its own (not mpirun's forwarding)."""
    if any(var in os.environ for var in _MPI_VARS):
        return False
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed stdout
        return False


class ProgressBar(Callback):
    """A tqdm bar over the steps of each epoch with the current loss (rank 0 on a terminal)."""

    def __init__(self) -> None:
        self._bar = None

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        from tqdm import tqdm

        cb = run_context.original_args()
        self._bar = tqdm(total=cb.batch_num, desc=f"epoch {cb.cur_epoch_num}/{cb.epoch_num}", leave=False,
                         dynamic_ncols=True, file=sys.stderr)

    def on_train_step_end(self, run_context: RunContext) -> None:
        cb = run_context.original_args()
        if self._bar is not None:
            self._bar.update(cb.get("steps_since_callback", 1))
            self._bar.set_postfix(loss=f"{loss_value(cb.net_outputs):.4f}", refresh=False)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    on_train_end = on_train_epoch_end


_NAMED: set = set()  # the metrics files a training of this process has named already


class MetricsRecorder(Callback):
    """Append step, loss, step time and images/s to ``train_metrics.csv`` as training goes (flushed every step,
    so a crash loses nothing); draw ``loss_curve.png`` when training ends."""

    FIELDS = ("epoch", "step", "global_step", "loss", "step_time_s", "images_per_s")

    def __init__(self, log_dir: str | os.PathLike):
        self.dir = Path(log_dir)
        self.csv_path = self.dir / "train_metrics.csv"
        self.png_path = self.dir / "loss_curve.png"
        self._fh = None
        self._writer = None
        self._last = 0.0
        self._losses: list[tuple[int, float]] = []

    def on_train_begin(self, run_context: RunContext) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        new = not self.csv_path.exists() or run_context.original_args().get("cur_step_num", 0) == 0
        self._fh = open(self.csv_path, "w" if new else "a", newline="")
        self._writer = csv.writer(self._fh)
        if new:
            self._writer.writerow(self.FIELDS)
        self._last = time.perf_counter()

    def on_train_step_end(self, run_context: RunContext) -> None:
        cb = run_context.original_args()
        now = time.perf_counter()
        steps = cb.get("steps_since_callback", 1)
        dt = (now - self._last) / max(steps, 1)
        self._last = now
        loss = loss_value(cb.net_outputs)
        self._losses.append((cb.cur_step_num, loss))
        ips = cb.get("global_batch_size", 0) / dt if dt > 0 else 0.0
        self._writer.writerow([cb.cur_epoch_num, step_in_epoch(cb), cb.cur_step_num, f"{loss:.7g}", f"{dt:.6f}",
                               f"{ips:.2f}"])
        self._fh.flush()

    def on_train_end(self, run_context: RunContext) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._losses:
            plot_loss_curve(self._losses, self.png_path)
            if self.csv_path.resolve() not in _NAMED:  # once a process: a loop calling train() per epoch says it once
                _NAMED.add(self.csv_path.resolve())
                print(f"[autopar] rank 0's loss, step time and images/s at every step: {self.csv_path.resolve()}; "
                      f"its loss curve: {self.png_path.resolve()}", flush=True)


def plot_loss_curve(points: list[tuple[int, float]], path: Path, title: str = "training loss") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = zip(*points)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, lw=0.8, alpha=0.6, label="loss")
    window = max(1, len(losses) // 20)
    if window > 1:
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1:], smooth, lw=2, label=f"mean of {window} steps")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class CallbackList:
    def __init__(self, callbacks: list[Callback]):
        self.callbacks = callbacks

    def __getattr__(self, hook: str):
        def call(run_context: RunContext) -> None:
            for cb in self.callbacks:
                getattr(cb, hook)(run_context)

        return call
