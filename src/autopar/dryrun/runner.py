"""One simulated rank: ``python -m autopar.dryrun.runner --rank R --world N --steps K --out FILE script [args]``.

The script runs unmodified, as ``__main__``, in a fake world (:mod:`.fake_world`) under the storage tracker
(:mod:`.tracker`), until its K-th optimizer step (the peak of a training step is reached in the second: the
optimizer state exists from the first) or its end. Its verdict goes to FILE as JSON: the memory report, the first
error as one line (a configuration error autopar raises, or whatever else stopped the script, with its place in the
script) and what the rank learnt of the job (pipeline stages, the AUTO plan's predicted step).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import runpy
import sys
import time
import traceback
import warnings

from autopar.errors import ConfigError


class _Enough(BaseException):
    """Raised from the optimizer's step hook once the simulated steps are done: unwinds the script (past its
    ``except Exception``) to the runner."""


def _where(exc: BaseException, script: str) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) == script]
    return f" (at {os.path.basename(script)}:{frames[-1].lineno})" if frames else ""


def _error_line(exc: BaseException, script: str) -> str:
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    from autopar.errors import explain

    text = explain(exc) or str(exc).strip()
    if isinstance(exc, DynamicOutputShapeException):
        text = (f"{exc.func} sizes its output by tensor values, which a dry run's tensors do not have (a "
                "mixture-of-experts layer's routing is given values where its experts are called as "
                "(tokens, top_k_index, top_k_weights)): measure this step in a real run on a few ranks")
    line = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
    return line + _where(exc, script)


def _job_facts() -> dict:
    """What autopar's context and planner say about the job, if the script used autopar."""
    facts: dict = {}
    context = sys.modules.get("autopar.context")
    if context is not None:
        try:
            facts["parallel_mode"] = str(context.get_auto_parallel_context("parallel_mode"))
            facts["pipeline_stages"] = int(context.get_auto_parallel_context("pipeline_stages") or 1)
        except Exception:  # noqa: BLE001 - facts are extras: a context we cannot read leaves them out
            pass
    planner = sys.modules.get("autopar.planner.api")
    plan = getattr(planner, "last_plan", None)
    if plan is not None:
        facts["predicted_step_s"] = float(plan.totals.step)
        facts["plan"] = plan.reason
    pipeline = sys.modules.get("autopar.parallel.pipeline.runner")
    stages = getattr(pipeline, "stages_built", None)
    if stages:
        facts["pipeline_stages"] = max(stages[-1], facts.get("pipeline_stages", 1))
    return facts


def _warnings(caught) -> list[str]:
    """What the script and autopar warned about (torch's own notices left out), once each."""
    said: list[str] = []
    for w in caught:
        if issubclass(w.category, ResourceWarning):  # a file the script had open when the dry run stopped it
            continue
        text = str(w.message)
        if text.startswith("Using `torch.compile(module)` when there are global hooks"):  # the dry run's own hooks
            continue
        if not text.startswith("autopar") and (f"{os.sep}torch{os.sep}" in w.filename or "FakeTensor" in text):
            continue
        line = str(w.message).strip().splitlines()[0] if str(w.message).strip() else w.category.__name__
        if line not in said:
            said.append(line)
    return said[:20]


def run(world: int | None, rank: int, steps: int, script: str, script_args: list[str], device: str = "cpu") -> dict:
    """Run the script as ``rank`` of a fake world of ``world`` ranks (``world`` None: for real, in the world the
    launcher formed -- the measurement a dry run is checked against); ``device`` "cuda": each simulated rank has a
    GPU of its own (:mod:`.fake_cuda`), whose memory is what is counted."""
    import torch
    from torch.optim import optimizer as optim_hooks

    from autopar.context import in_side_work
    from autopar.dryrun import fake_world
    from autopar.dryrun.tracker import StorageTracker

    tracker = StorageTracker("cuda" if device == "cuda" else None)
    gpu = None
    if world is not None:
        if device == "cuda":
            from autopar.dryrun import fake_cuda

            gpu = fake_cuda.install(fake_world.local_size(world), tracker, os.environ.get("AUTOPAR_DRYRUN_MACHINE"))
        fake_world.form(rank, world, device)

    def enough(opt, args, kwargs):
        if tracker.steps >= steps and not in_side_work():
            raise _Enough()

    script = os.path.abspath(script)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(script))
    verdict: dict = {"rank": rank, "error": None}
    started = time.monotonic()
    handle = None
    answers = fake_world.PlainAnswers(os.path.abspath(script))
    modes = (fake_world.fake_tensors(), answers) if world is not None else ()
    if world is not None:  # a pipeline stage's spread experts: their exchange followed on known routing
        from autopar.parallel.pipeline import opaque_experts

        opaque_experts.routing_values = functools.partial(fake_world.routed, answers)
    with contextlib.ExitStack() as stack, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mode in modes:
            stack.enter_context(mode)
        stack.enter_context(tracker)
        handle = optim_hooks.register_optimizer_step_post_hook(enough)  # after the tracker's: steps counted
        stack.callback(handle.remove)
        try:
            runpy.run_path(script, run_name="__main__")
        except _Enough:
            pass
        except SystemExit as exc:
            if exc.code not in (None, 0):
                verdict["error"] = f"the script exited with status {exc.code}"
        except BaseException as exc:  # noqa: BLE001 - whatever stops the script is the rank's one-line verdict
            if tracker.steps < steps:
                verdict["error"] = _error_line(exc, script)
                if os.environ.get("AUTOPAR_TRACEBACK"):
                    traceback.print_exc()
    if torch.distributed.is_initialized():
        verdict["rank"] = torch.distributed.get_rank()
    said = _warnings(caught)
    if answers.invented:
        lines = ", ".join(str(n) for n in sorted(set(answers.invented))[:5])
        count = len(answers.invented)
        said.append(f"{count} value{'s' if count > 1 else ''} the script read from fake tensors (line {lines}: "
                    f"loss.item() and the like) {'were' if count > 1 else 'was'} answered as 1 or True: where it sizes "
                    "or steers itself by them, it ran with those")
    verdict.update(tracker.report(), seconds=round(time.monotonic() - started, 3), warnings=said, **_job_facts())
    if gpu is not None:
        verdict["device"] = {"name": gpu.name, "memory_bytes": gpu.total_memory}
    return verdict


def _write(path: str, verdict: dict) -> None:
    """Whole or not at all: the driver reads the file only when it exists."""
    with open(f"{path}.tmp", "w") as fh:
        json.dump(verdict, fh)
    os.replace(f"{path}.tmp", path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autopar.dryrun.runner")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=None, help="the fake world's size (without: --measure)")
    p.add_argument("--measure", action="store_true",
                   help="run for real in the launcher's world, measuring the same way (OUT gets .RANK appended)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: each simulated rank has a GPU of its own (the fake world only)")
    p.add_argument("--out", required=True)
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.measure:
        verdict = run(None, a.rank, a.steps, a.script, a.script_args)
        _write(f"{a.out}.{verdict['rank']}", verdict)
        return 0 if not verdict["error"] else 1
    os.environ["AUTOPAR_DRYRUN"] = "1"
    os.environ["AUTOPAR_AUTO_TRIALS"] = "0"  # AUTO's measured round would time fake tensors: the prediction decides
    os.environ["AUTOPAR_MEASURE_OPS"] = "0"
    try:
        verdict = run(a.world, a.rank, a.steps, a.script, a.script_args, a.device)
    except ConfigError as exc:  # the simulated device could not be set up: the verdict says why, in one line
        verdict = {"rank": a.rank, "error": str(exc)}
    _write(a.out, verdict)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the script's threads and torch's fake world need no orderly teardown: the verdict is written


if __name__ == "__main__":
    sys.exit(main())
