"""AUTO_PARALLEL's measured round: the few best predicted plans run a few steps each, and the fastest is kept.

Why: the cost model orders plans well when they are far apart, but near-ties swap when measured, and on a CPU its
step predictions are off by 10-60 % (skinny matmuls, DTensor dispatch, allocator effects it does not see). A few
steps of each runner-up (:func:`autopar.planner.alternatives.alternatives`) cost seconds once per job -- and the
decision is kept per (network, world, backend) in ``AUTOPAR_CACHE_DIR``, so a restart neither searches for it nor
measures again.

How: each candidate is applied, exactly as the real run applies a plan (:func:`autopar.parallel.api.prepare`), to a
deep copy of the network, its loss and its optimizer (one ``deepcopy`` with a shared memo, so the copied optimizer
holds the copied parameters and the plan's operators map onto the copy's); one warm-up step and a few timed steps
(forward, backward, optimizer step) run on this rank's first batch; every rank times its own, and the slowest rank's
median step is the plan's time (a step ends when its last rank does). Plans within 10 % of the fastest are run a
second time, in reverse order and with twice the steps, and their two times averaged by their steps (close calls
are where a few steps mislead). The
original network, its optimizer and the
random number generators are left exactly as they were: training afterwards is the same as without the round.

Data parallel's step as the round timed it is kept with the operators' times
(:func:`autopar.planner.plan.record_data_parallel_step`): a later plan of the network predicts data parallel with it
rather than with the planner's measurement on a copy.

``AUTOPAR_AUTO_TRIALS=0`` turns the round off (the prediction alone decides); ``AUTOPAR_AUTO_TRIAL_STEPS`` sets the
timed steps (default 3); ``AUTOPAR_AUTO_TRIALS_WITHIN`` how far behind the best prediction a runner-up may be and
still be measured (default 3: :data:`autopar.planner.alternatives.WITHIN`).
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from autopar import context as _context
from autopar.context import env_flag
from autopar.planner.alternatives import alternatives, as_choice, describe, from_choice
from autopar.planner.plan import built_on_meta, record_data_parallel_step

CLOSE = 1.10  # plans measured within this of the fastest are measured a second time


def enabled(world: int) -> bool:
    return world > 1 and env_flag("AUTOPAR_AUTO_TRIALS", True)


def _within() -> float:
    from autopar.planner.alternatives import WITHIN

    try:
        return max(1.0, float(os.environ.get("AUTOPAR_AUTO_TRIALS_WITHIN", WITHIN)))
    except ValueError:
        return WITHIN


def _steps() -> int:
    try:
        return max(1, int(os.environ.get("AUTOPAR_AUTO_TRIAL_STEPS", "3")))
    except ValueError:
        return 3


def measured_round(network: torch.nn.Module, loss_fn: Any, optimizer: Any, sample: list, plan,
                   sample_kwargs: dict | None, prepare):
    """``plan`` or the runner-up that measured faster (every rank returns the same one). ``prepare``: how the job
    applies a plan (:func:`autopar.parallel.api.prepare`), given so that this module does not import its caller."""
    from autopar.planner.api import load_decision, save_decision

    world = plan.device_num
    if not enabled(world) or plan.search_mode == "sharding_propagation":
        return plan  # (propagation is MindSpore's rule from the user's strategies, not a bet on costs: kept as is)
    if built_on_meta(network):  # each candidate would be built whole on every rank to be timed: the prediction decides
        plan.reason += ("; the network was built on the meta device, so it was planned without running it (no "
                        "measured round: each plan would be built whole to time it)")
        return plan
    cached = load_decision(plan)
    if cached and not _still_fits(plan, cached):
        cached = None
    have = torch.tensor([1 if cached else 0])
    dist.all_reduce(have, op=dist.ReduceOp.MIN)  # every rank read one (a shared cache) or none re-uses it
    if have.item():
        box = [cached["choice"] if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        chosen = from_choice(plan, tuple(box[0]))
        chosen.trials = [tuple(t) for t in cached.get("trials", [])]
        from autopar.planner.api import decision_path

        chosen.cached = str(decision_path(plan))
        return chosen
    box = [[as_choice(c) for c in alternatives(plan, within=_within())] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    candidates = [from_choice(plan, b) for b in box[0]]
    if len(candidates) == 1:
        return plan
    start = time.perf_counter()
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    measured = []
    side = _context.side_work()  # the copies' optimizer steps are not the user's
    side.__enter__()
    try:
        for candidate in candidates:
            measured.append(_time(network, loss_fn, optimizer, sample, candidate, sample_kwargs or {}, prepare))
        # close calls are timed again, in reverse order, with twice the steps, and the two passes averaged by their
        # steps: a few steps on a loaded host swing 5-10 %, and the wide MLP kept a layout measured 9 % slower than
        # Megatron's over three rounds (and, with one pass of the same length again, 5-7 % slower on 4 ranks)
        fastest = min(measured)
        close = [i for i, m in enumerate(measured) if m < float("inf") and m <= CLOSE * fastest]
        if len(close) > 1:
            for i in reversed(close):
                again = _time(network, loss_fn, optimizer, sample, candidates[i], sample_kwargs or {}, prepare,
                              steps=2 * _steps())
                measured[i] = (measured[i] + 2 * again) / 3
    finally:
        side.__exit__(None, None, None)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    if _as_the_copy_steps(optimizer):  # data parallel as the job runs it: kept for later plans
        for candidate, seconds in zip(candidates, measured):
            if candidate.plain_data_parallel:
                record_data_parallel_step(candidate, seconds)
    best = min(range(len(candidates)), key=lambda i: (measured[i], i))
    chosen = candidates[best]
    chosen.trials = [(describe(c), c.totals.step, m) for c, m in zip(candidates, measured)]
    chosen.trials.insert(0, chosen.trials.pop(best))
    chosen.trial_seconds = time.perf_counter() - start
    if best != 0:
        chosen.reason = (f"{describe(chosen)}, measured fastest ({measured[best] * 1e3:.1f} ms per step; the "
                         f"prediction's first choice measured {measured[0] * 1e3:.1f} ms): {plan.reason}")
    else:
        chosen.reason = f"{plan.reason}; measured fastest of {len(candidates)} ({measured[0] * 1e3:.1f} ms per step)"
    if dist.get_rank() == 0 and all(m < float("inf") for m in measured):
        try:
            save_decision(chosen, as_choice(chosen))
        except OSError:  # a read-only cache: the next run measures again
            pass
    return chosen


def _as_the_copy_steps(optimizer) -> bool:
    """Whether the round's data parallel is the step the planner's copy measures: plain data parallel (no ZeRO
    asked by the context, which the round's "data parallel" would run with) under SGD (the copy's optimizer; a loop
    that makes its optimizer later is timed with it too). Adam's step on the same network is another step."""
    return (not _context.auto_parallel_context().enable_parallel_optimizer
            and (optimizer is None or isinstance(optimizer, torch.optim.SGD)))


def _still_fits(plan, cached: dict) -> bool:
    try:
        candidate = from_choice(plan, tuple(cached["choice"]))
    except (KeyError, TypeError, ValueError):
        return False
    # the limit as asked: where no layout fits it, the plan's problem is the unlimited one ZeRO's path searched
    limit = plan.memory_limit if plan.memory_limit is not None else plan.problem.memory_limit
    return len(candidate.choice) == len(plan.choice) and (limit is None or candidate.totals.memory <= limit)


def _time(network, loss_fn, optimizer, sample, candidate, kwargs: dict, prepare, steps: int | None = None) -> float:
    """The slowest rank's median step of ``candidate`` on a copy of the network over ``steps`` timed steps (the
    round's default where None), after one untimed; inf where it failed anywhere."""
    memo: dict = {}
    net, loss, opt = copy.deepcopy((network, loss_fn, optimizer), memo)
    strategies = [(memo.get(id(target)), strategy) for target, strategy in candidate.strategies()]
    seconds = float("inf")
    state = None
    try:
        if any(target is None for target, _ in strategies):
            raise LookupError("an operator of the plan is not part of the network's copy")
        if opt is None:  # a loop that makes its optimizer later: momentum SGD stands in for its step
            opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.0, momentum=0.9)
        prepared = prepare(net, loss, opt, list(sample), plan=_on_copy(candidate, strategies),
                           sample_kwargs=kwargs)
        forward = prepared.forward_loss if not kwargs else (lambda inputs, m=prepared.network: m(*inputs, **kwargs))
        state = prepared.state
        times = []
        for step in range((steps or _steps()) + 1):  # (under enable_grad: the first call may have been an evaluation)
            _sync(prepared.device)
            t0 = time.perf_counter()
            with torch.enable_grad():
                out = forward(list(sample))
                if not prepared.runs_backward:
                    _scalar(out).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(prepared.device)
            if step:  # the first step warms the allocator and the engines up
                times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
    except Exception as exc:  # noqa: BLE001 - a plan that cannot run is not chosen; say why once
        if dist.get_rank() == 0:
            print(f"[autopar] AUTO_PARALLEL measured round: {describe(candidate)} could not run "
                  f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})", flush=True)
    finally:
        if state is not None:
            state.close()
        del net, loss, opt, memo
        gc.collect()
    worst = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


def _on_copy(candidate, strategies):
    """``candidate`` whose strategies name the copy's operators."""
    copied = dataclasses.replace(candidate)
    copied.strategies = lambda: strategies
    return copied


def _scalar(out: Any) -> torch.Tensor:
    """What to differentiate for timing: the loss, or (a loop's network without its loss) the mean of every
    floating output."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)  # a ModelOutput / dict's loss
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad:
        return loss
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()
              and t.requires_grad]
    if not leaves:
        raise ValueError("the network's outputs do not depend on its parameters")
    return sum(t.float().mean() for t in leaves)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
