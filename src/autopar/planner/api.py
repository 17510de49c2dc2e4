"""AUTO_PARALLEL inside a job: plan on rank 0 with the calibrated machine, broadcast, report -- and return the plan
(the runtime applies it: :func:`autopar.parallel.api.attach`)."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from autopar import context as _context
from autopar.planner.machine import load_or_calibrate
from autopar.planner.plan import Plan, plan_network, training_line


def _global_batch(sample: list) -> tuple:
    """The ranks' local batches side by side: the plan is made for the global batch (unless full_batch)."""
    if _context.auto_parallel_context().full_batch or not dist.is_initialized() or dist.get_world_size() == 1:
        return tuple(sample)
    from autopar.comm.functional import all_gather  # any dtype (uint32 labels go through a carrier)

    return tuple(all_gather(t.detach()) if isinstance(t, torch.Tensor) and t.dim() >= 1 else t for t in sample)


def make_plan(network: torch.nn.Module, loss_fn: torch.nn.Module | None, sample: list,
              sample_kwargs: dict | None = None, data_parallel_step=None) -> Plan:
    """``data_parallel_step``: how the runtime measures its own data-parallel step whole
    (:data:`autopar.parallel.data.step_timer.DATA_PARALLEL_STEP`; the planner does not import the runtime)."""
    ctx = _context.auto_parallel_context()
    if os.environ.get("AUTOPAR_DRYRUN"):  # fake tensors: nothing to measure (autopar launch --dry-run)
        from autopar.planner.cluster import dry_run_machine

        machine = dry_run_machine(dist.get_world_size() if dist.is_initialized() else 1)
    else:
        machine = load_or_calibrate()
    limit = ctx.max_device_memory or _context.run_context().max_device_memory or machine.memory_per_device
    n = dist.get_world_size() if dist.is_initialized() else 1
    batch = _global_batch(sample)
    names = sorted(sample_kwargs or {})
    kwargs = dict(zip(names, _global_batch([sample_kwargs[k] for k in names])))
    note = None if loss_fn is not None else ("the training loop runs its own backward; Model.train (or "
                                             "autopar.PipelineParallel) runs a pipeline's step")
    plan = plan_network(network, loss_fn, batch, n, machine, ctx.search_mode, limit, pipeline_note=note,
                        sample_kwargs=kwargs, data_parallel_step=data_parallel_step)
    if dist.is_initialized() and n > 1:  # every rank runs rank 0's plan (one source of truth)
        box = [plan.choice if dist.get_rank() == 0 else None, plan.pure_data_parallel, plan.zero_level, plan.pipeline,
               plan.context_parallel, plan.expert_parallel, plan.context_parallel_algo]
        dist.broadcast_object_list(box, src=0)
        (plan.choice, plan.pure_data_parallel, plan.zero_level, plan.pipeline, plan.context_parallel,
         plan.expert_parallel, plan.context_parallel_algo) = box
    return plan


last_plan: Plan | None = None  # the plan this process ran last (a dry run reports its predicted step)


def finish(plan: Plan, network: torch.nn.Module) -> None:
    """The decision made: rank 0 writes the table and says what was chosen; the strategy file is saved."""
    global last_plan
    last_plan = plan
    if not dist.is_initialized() or dist.get_rank() == 0:
        _report(plan)
    if not os.environ.get("AUTOPAR_DRYRUN"):
        _watch_training(plan, network)
    path = _context.auto_parallel_context().strategy_ckpt_save_file
    if path:
        _save_strategy(plan, network, path)


def _report(plan: Plan) -> None:
    text = plan.explain()
    path = Path(_context.log_dir()) / "auto_parallel_plan.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    timing = (f"capture {plan.graph.seconds:.2f} s, costs {plan.cost_seconds:.2f} s, "
              f"search {plan.search_seconds:.2f} s")
    if plan.cached:
        timing += ", the decision of an earlier run of this job re-used"
    elif plan.trials:
        timing += f", measured round {plan.trial_seconds:.1f} s over {len(plan.trials)} plans"
    print(f"[autopar] AUTO_PARALLEL: {plan.reason} ({timing}); table in {path}", flush=True)


TRAINING_STEPS = 5  # optimizer steps timed in training, after the first (its warm-up)


def _watch_training(plan: Plan, network: torch.nn.Module) -> None:
    """The prediction checked against the job itself: the first optimizer steps of training are timed (the time
    between the ends of consecutive steps: what the user's loop takes per step, data loading included) and rank 0
    adds predicted against measured to ``auto_parallel_plan.txt`` and to ``plan.explain()``."""
    import statistics
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    ends: list[float] = []

    def after_step(optimizer, args, kwargs) -> None:
        mine = {id(p) for p in network.parameters()}  # (as they are now: a plan may have replaced them)
        if not any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
            return  # another network's optimizer
        ends.append(time.perf_counter())
        if len(ends) <= TRAINING_STEPS:
            return
        handle.remove()
        gaps = [b - a for a, b in zip(ends, ends[1:])]
        plan.in_training = (statistics.median(gaps), len(gaps))
        if not dist.is_initialized() or dist.get_rank() == 0:
            line = training_line(plan)
            path = Path(_context.log_dir()) / "auto_parallel_plan.txt"
            try:
                with path.open("a") as f:
                    f.write(line + "\n")
            except OSError:
                pass
            print(f"[autopar] AUTO_PARALLEL {line}", flush=True)

    handle = register_optimizer_step_post_hook(after_step)


# -- a decision made once per (network, world, backend) ---------------------------------------------------------
def decision_path(plan: Plan) -> Path:
    """Where the measured decision for this graph on this world and backend is kept (``AUTOPAR_CACHE_DIR``)."""
    import hashlib
    import json

    from autopar.comm import management
    from autopar.planner.machine import cache_path

    backend = management.backend() if management.is_initialized() else "gloo"
    ctx = _context.auto_parallel_context()
    # (the variants a decision may be: "cp/ep/algo" since sequence and expert splits, and the sequence split's
    # algorithm, are weighed, so that a decision made before them is not read back as if they had lost; the
    # algorithm the user gave, or AUTO's to choose)
    algo = ctx.context_parallel_algo if _context.given_by_user("context_parallel_algo") else "auto"
    key = json.dumps([[node.name, node.kind, [list(s) for s in node.shapes], str(node.fixed)]
                      for node in plan.graph.nodes] + [plan.device_num, backend, plan.search_mode, plan.graph.batch,
                                                       "cp/ep/algo", algo, ctx.full_batch],
                     default=str)  # not the memory limit: the free memory it defaults to moves; fits() is checked
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return cache_path(backend, plan.device_num).parent / f"plan-{backend}-n{plan.device_num}-{digest}.json"


def load_decision(plan: Plan) -> dict | None:
    import json

    path = decision_path(plan)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def save_decision(plan: Plan, box: tuple) -> None:
    import json

    from autopar.planner.cache import write_atomic

    write_atomic(decision_path(plan), json.dumps({"choice": list(box), "trials": plan.trials}))


def _save_strategy(plan: Plan, network: torch.nn.Module, path: str) -> None:
    from autopar.layout.layout import Layout
    from autopar.layout.strategy_file import save_strategy_file

    layouts = {name: Layout.replicated(tuple(p.shape), plan.device_num) for name, p in network.named_parameters()}
    operators = {}
    if not plan.pure_data_parallel:
        layouts.update(plan.layouts())
        names = {id(target): node.name for node in plan.graph.nodes for target in (node.target,)}
        operators = {names[id(target)]: tuple(tuple(s) for s in strategy) for target, strategy in plan.strategies()}
    save_strategy_file(os.fspath(path), layouts, list(network.named_parameters()), operators)
