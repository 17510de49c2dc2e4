"""The runners-up: the few plans closest to the chosen one, for AUTO_PARALLEL's measured round.

The cost model ranks plans; on a loaded CPU its step predictions are 10-60 % off and plans it sees as near-ties
swap places when measured (``bench/auto_vs_hand.py``: the "row-first twin" of Megatron predicted equal, measured
10-25 % slower). So the job does not bet on one prediction: :func:`alternatives` lists the chosen plan, data
parallel, the ZeRO levels that fit, and the next-best operator layouts (each differing from the ones before in the
layout of at least one parameter: the exact search again, with the earlier answers cut off), and
:mod:`autopar.parallel.trials` runs them for a few steps each and keeps the fastest.
"""
from __future__ import annotations

import dataclasses
import math

from autopar import context as _context
from autopar.planner.plan import Plan, Totals, other_compute_of, totals_of
from autopar.planner.search import solve_ilp

# how far behind the chosen plan's prediction a runner-up may be and still be measured: the model's worst errors
# here are ~3x (skinny weight-gradient products), so a plan predicted 3x slower can still win
WITHIN = 3.0
CHEAP = 0.005  # seconds a step under which a runner-up is measured whatever its prediction
# near-ties: runners-up predicted within this of the chosen plan are measured, up to NEAR_MOST of them, beyond the
# ``near`` always measured -- inside the model's own error a prediction does not order them
NEAR_BAND = 1.10
NEAR_MOST = 5


def describe(plan: Plan) -> str:
    """A short name for a plan: what a user would have written by hand."""
    if plan.pipeline is not None:
        return f"pipeline {plan.pipeline.stages} stages"
    variant = next((label for label, (cp, ep, _, algo) in plan.variants.items()
                    if (cp, ep) == (plan.context_parallel, plan.expert_parallel)
                    and (cp == 1 or algo == plan.context_parallel_algo)), None)
    if variant is not None and (plan.context_parallel > 1 or plan.expert_parallel):
        return variant
    if plan.pure_data_parallel:
        return f"data parallel + ZeRO {plan.zero_level}" if plan.zero_level else "data parallel"
    labels = [f"{node.name} {plan.chosen(n).label}" for n, node in enumerate(plan.graph.nodes)
              if any(node.param_names) and plan.chosen(n).label != "data parallel"]
    text = ", ".join(labels) or "data parallel"
    return "layouts: " + (text if len(text) <= 70 else text[:67] + "...")


def _param_assignment(plan: Plan, choice: list[int]) -> dict[int, int]:
    return {n: choice[n] for n, node in enumerate(plan.graph.nodes) if any(node.param_names) and node.fixed is None}


def apart(assignment: dict) -> int:
    """How many operators a runner-up must change from a measured plan: a third of them, at least one."""
    return max(1, math.ceil(len(assignment) / 3))


def alternatives(plan: Plan, layouts: int = 5, near: int = 2, within: float = WITHIN) -> list[Plan]:
    """The chosen plan first, then the runners-up by predicted step: the ``near`` best that differ from the plans
    before them at all -- and more of those, up to :data:`NEAR_MOST`, while they are predicted within
    :data:`NEAR_BAND` of the chosen plan -- then ``layouts - near`` plans that change a third of the layers of every
    plan before them. A chosen pipeline is measured against data parallel (or the ZeRO levels that fit): its
    per-micro-batch costs are the least certain part of the model.

    Why both: the model's errors follow kinds of layout -- a weight split over both axes of a 2 x 2 mesh measured
    18 % slower than predicted, Megatron's column/row pairs 7 % -- so the best plan is often the chosen one with a
    layer changed (Megatron's pairs, one layer away from a near-tie that splits a weight two ways: only a third apart
    was never measured), and sometimes a plan of another kind altogether (the chosen plan's near-twins all measured
    20 % slower than Megatron's pairs on the wide MLP). Why more near-ties: on 4 ranks the wide MLP's best five
    layouts were predicted within 4 % of each other (189-197 ms), a spread inside the model's error; Megatron's pairs,
    predicted fifth, were not measured, and the plan kept ran 5-7 % slower than them."""
    p, limit = plan.problem, plan.memory_limit
    # the runners-up divide the batch as data parallel does, unless a variant says otherwise (the last loop)
    chosen, plan = plan, dataclasses.replace(plan, context_parallel=1, expert_parallel=False)
    if plan.pipeline is not None:  # chosen as predicted faster: data parallel (or ZeRO) is measured beside it
        out = [plan]
        dp = p.dp_choice()
        if dp is not None and plan.dp_totals is not None and (limit is None or plan.dp_totals.memory <= limit):
            out.append(dataclasses.replace(plan, choice=dp, totals=plan.dp_totals, pure_data_parallel=True,
                                           zero_level=None, pipeline=None, reason="data parallel"))
        elif dp is not None:
            out += [dataclasses.replace(plan, choice=dp, totals=z, pure_data_parallel=True, zero_level=level,
                                        pipeline=None, reason=f"data parallel + ZeRO {level}")
                    for level, z in (plan.zero or {}).items() if limit is None or z.memory <= limit]
        # and the best layout of the operators (what the pipeline was preferred to)
        seen = [a for a in ([_param_assignment(plan, dp)] if dp is not None else []) if a]
        choice = solve_ilp(p, exclude=seen) if seen and p.memory_limit == limit else None
        if choice is not None:
            out.append(dataclasses.replace(plan, choice=choice, totals=totals_of(p, choice, other_compute_of(plan)),
                                           pure_data_parallel=False, zero_level=None, pipeline=None,
                                           reason="the searched plan"))
        return out
    out = [chosen]
    dp = p.dp_choice()
    fits = lambda totals: limit is None or totals.memory <= limit  # noqa: E731
    dp_fits = dp is not None and plan.dp_totals is not None and fits(plan.dp_totals)
    if dp_fits and not chosen.plain_data_parallel:
        out.append(dataclasses.replace(plan, choice=dp, totals=plan.dp_totals, pure_data_parallel=True,
                                       zero_level=None, reason="data parallel"))
    if dp is not None and not dp_fits:  # where data parallel fits, its bucketed all-reduce beat FSDP2 every time
        for level, z in (plan.zero or {}).items():
            if level != plan.zero_level and fits(z):
                out.append(dataclasses.replace(plan, choice=dp, totals=z, pure_data_parallel=True, zero_level=level,
                                               reason=f"data parallel + ZeRO {level}"))
    other = other_compute_of(plan)
    # the first ``near`` runners-up differ from the plans before them in one operator with parameters at least, the
    # rest in a third of them; data parallel is excluded as it is measured anyway
    dp_assignment = _param_assignment(plan, dp) if dp is not None else {}
    first = _param_assignment(plan, plan.choice)
    measured = [first] if first and not plan.pure_data_parallel else []
    close_found, apart_left = 0, layouts - (0 if plan.pure_data_parallel else near)
    close_most = 0 if plan.pure_data_parallel else max(near, NEAR_MOST)
    # layouts only where the search ran under the limit (where no layout fits, ZeRO's path kept an unlimited problem)
    while (close_found < close_most or apart_left > 0) and (measured or dp_assignment) and p.memory_limit == limit:
        close = close_found < close_most
        exclude = [(a, 1 if close else apart(a)) for a in measured] + ([(dp_assignment, 1)] if dp_assignment else [])
        choice = solve_ilp(p, exclude=exclude)
        if choice is None:
            break
        totals = totals_of(p, choice, other)
        if close and close_found >= near and totals.step > NEAR_BAND * plan.totals.step:
            close_found = close_most  # no near-tie left: on to plans of other kinds
            continue
        measured.append(_param_assignment(plan, choice))
        if close:
            close_found += 1
        else:
            apart_left -= 1
        out.append(dataclasses.replace(plan, choice=choice, totals=totals, pure_data_parallel=False,
                                       zero_level=None, reason="a runner-up of the searched plan" + (
                                           "" if close else ", a third of its layers apart")))
    mine = (chosen.context_parallel, chosen.expert_parallel, chosen.context_parallel_algo)
    for label, (cp, ep, totals, algo) in plan.variants.items():  # the batch divided otherwise: sequence, experts
        if fits(totals) and (cp, ep, algo) != mine:
            out.append(dataclasses.replace(plan, choice=dp, totals=totals, pure_data_parallel=True, zero_level=None,
                                           context_parallel=cp, expert_parallel=ep, context_parallel_algo=algo,
                                           reason=label))
    best = min(c.totals.step for c in out)
    first, rest = out[0], sorted(out[1:], key=lambda c: c.totals.step)
    # the baseline a plan must beat is always measured: data parallel, or -- where it does not fit -- the fastest
    # ZeRO level that does (it runs whatever the operators are: when every layout of a Llama's attention stopped at
    # a view, the round kept a plan that could not run). A plan a few milliseconds a step is cheap to measure
    # whatever its prediction (a 3-layer MLP's data parallel predicted 1.2 ms measured 2.7 ms).
    baseline = next((c for c in rest if c.pure_data_parallel and c.context_parallel == 1 and not c.expert_parallel),
                    None)
    return [first] + [c for c in rest if c.totals.step <= max(within * best, best + CHEAP) or c is baseline]


def as_choice(plan: Plan) -> tuple:
    """What every rank needs to rebuild ``plan`` from its own copy of the problem (broadcast from rank 0)."""
    return (list(plan.choice), plan.pure_data_parallel, plan.zero_level, plan.totals.compute, plan.totals.comm,
            plan.totals.memory, plan.reason, plan.pipeline is not None, plan.context_parallel, plan.expert_parallel,
            plan.context_parallel_algo)


def from_choice(plan: Plan, box: tuple) -> Plan:
    choice, pure, level, compute, comm, memory, reason = box[:7]
    piped = box[7] if len(box) > 7 else False  # (a decision kept by an earlier version has no pipeline flag)
    cp, ep = (int(box[8]), bool(box[9])) if len(box) > 9 else (1, False)  # (nor these)
    # (nor the algorithm: such a decision was weighed with the context's)
    algo = box[10] if len(box) > 10 else _context.auto_parallel_context().context_parallel_algo
    totals = Totals(compute, comm, memory)
    plain = pure and level is None and not piped and cp == 1 and not ep
    if plain and plan.dp_totals is not None:  # data parallel's step as now known (a
        totals = plan.dp_totals  # decision read back: its step as an earlier measured round timed it, where kept)
    return dataclasses.replace(plan, choice=choice, pure_data_parallel=pure, zero_level=level, totals=totals,
                               reason=reason, pipeline=plan.pipeline if piped else None, context_parallel=cp,
                               expert_parallel=ep, context_parallel_algo=algo)
