"""AUTO_PARALLEL inside a job: plan on rank 0 with the calibrated machine, broadcast, report -- and return the plan
(the runtime applies it: :func:`autopar.parallel.api.attach`)."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from autopar import context as _context
from autopar.planner.machine import load_or_calibrate
from autopar.planner.plan import Plan, plan_network


def _global_batch(sample: list) -> tuple:
    """The ranks' local batches side by side: the plan is made for the global batch (unless full_batch)."""
    if _context.auto_parallel_context().full_batch or not dist.is_initialized() or dist.get_world_size() == 1:
        return tuple(sample)
    from autopar.comm.functional import all_gather  # any dtype (uint32 labels go through a carrier)

    return tuple(all_gather(t.detach()) if isinstance(t, torch.Tensor) and t.dim() >= 1 else t for t in sample)


def make_plan(network: torch.nn.Module, loss_fn: torch.nn.Module | None, sample: list,
              sample_kwargs: dict | None = None) -> Plan:
    ctx = _context.auto_parallel_context()
    machine = load_or_calibrate()
    limit = ctx.max_device_memory or _context.run_context().max_device_memory or machine.memory_per_device
    n = dist.get_world_size() if dist.is_initialized() else 1
    batch = _global_batch(sample)
    names = sorted(sample_kwargs or {})
    kwargs = dict(zip(names, _global_batch([sample_kwargs[k] for k in names])))
    note = None if loss_fn is not None else ("the training loop runs its own backward; Model.train (or "
                                             "autopar.PipelineParallel) runs a pipeline's step")
    plan = plan_network(network, loss_fn, batch, n, machine, ctx.search_mode, limit, pipeline_note=note,
                        sample_kwargs=kwargs)
    if dist.is_initialized() and n > 1:  # every rank runs rank 0's plan (one source of truth)
        box = [plan.choice if dist.get_rank() == 0 else None, plan.pure_data_parallel, plan.zero_level, plan.pipeline]
        dist.broadcast_object_list(box, src=0)
        plan.choice, plan.pure_data_parallel, plan.zero_level, plan.pipeline = box
    if not dist.is_initialized() or dist.get_rank() == 0:
        _report(plan)
    if ctx.strategy_ckpt_save_file:
        _save_strategy(plan, network, ctx.strategy_ckpt_save_file)
    return plan


def _report(plan: Plan) -> None:
    text = plan.explain()
    path = Path(_context.log_dir()) / "auto_parallel_plan.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    print(f"[autopar] AUTO_PARALLEL: {plan.reason}; table in {path}", flush=True)


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
