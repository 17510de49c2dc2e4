"""Choosing one strategy per node for the whole graph.

- ``dynamic_programming``: the exact optimum, as one integer linear program solved by HiGHS (Alpa's
  intra-operator formulation): a one-hot choice per node, a linearised choice per edge so that resharding costs
  are linear, the memory of the chosen strategies bounded by the per-device limit.
- ``recursive_programming``: a fast heuristic: each node in turn takes its best strategy given its neighbours'
  current choices, until nothing changes; then the cheapest memory savings until the plan fits.
- ``sharding_propagation``: the strategies the user gave spread to their neighbours along the edges (each picks
  what reshards least from the already decided ones); nodes out of reach stay data-parallel.

In all modes a strategy the user gave is kept. Without user strategies the result is then compared with pure
data parallelism, which runs on DDP and overlaps its gradient all-reduce with the backward pass (the other plans
pay their communication in full): the cheaper of the two is the plan.
"""
from __future__ import annotations

import os
import sys
import time

from torch.distributed.tensor import Partial, Replicate

from autopar.errors import StrategyError
from autopar.planner.costs import NodeCosts, nbytes, reshard_cost, shared_reduction, through_view
from autopar.planner.graph import Graph
from autopar.planner.machine import MachineModel

SEARCH_MODES = ("dynamic_programming", "recursive_programming", "sharding_propagation")


class Problem:
    """The costs a search needs, precomputed: node costs (intrinsic + boundary), edge cost tables, memory."""

    def __init__(self, graph: Graph, costs: list[NodeCosts], machine: MachineModel, const_memory: float,
                 memory_limit: float | None):
        self.graph, self.costs, self.machine = graph, costs, machine
        self.const_memory, self.memory_limit = const_memory, memory_limit
        self.node_cost = [[c.compute + nc.comm(c, machine) for c in nc.choices] for nc in costs]
        self.memory = [[c.memory for c in nc.choices] for nc in costs]
        self.pairs: list[tuple[int, int, list[list[float]]]] = []  # (u, v, cost[s][t])
        for u, v, k in graph.edges:
            shape, item = graph.nodes[v].shapes[k], graph.nodes[v].itemsize
            dims = graph.edge_dims.get((u, v, k))
            # (in the producer's dimensions: a consumer that views the output differently is costed on its view)
            src_shape = graph.nodes[u].out_shape if dims is not None else shape
            resolved = (u, v, k) in graph.edge_resolved
            table = []
            for cu in costs[u].choices:
                src, first = cu.out_placements, 0.0
                if resolved and any(isinstance(p, Partial) for p in src):  # summed before the function between
                    whole = tuple(Replicate() if isinstance(p, Partial) else p for p in src)
                    first = reshard_cost(machine, src, whole, nbytes(shape, item), costs[u].mesh, src_shape, item)
                    src = whole
                table.append([first + reshard_cost(machine, src, through_view(cv.in_placements[k], dims),
                                                   nbytes(shape, item), costs[u].mesh, src_shape, item,
                                                   through_view(cv.grad_placements[k], dims) if cv.grad_placements
                                                   else None)
                              for cv in costs[v].choices])
            self.pairs.append((u, v, table))
        for a, b in graph.joins:  # b's output resharded to a's layout
            shape, item = graph.nodes[b].out_shape, graph.nodes[b].itemsize
            table = [[reshard_cost(machine, cb.out_placements, ca.out_placements, nbytes(shape, item),
                                   costs[a].mesh, shape, item) for cb in costs[b].choices] for ca in costs[a].choices]
            self.pairs.append((a, b, table))
        for b, nb in enumerate(costs):  # an input shared with an earlier node: its gradient reduced once
            for j, (a, i) in graph.nodes[b].same_input.items():
                if a == b:  # (one node fed the tensor twice: its own costs price it)
                    continue
                table = [[-shared_reduction(costs[a], ca, i, nb, cb, j, machine) for cb in nb.choices]
                         for ca in costs[a].choices]
                if any(any(row) for row in table):
                    self.pairs.append((a, b, table))

    def total(self, choice: list[int]) -> float:
        cost = sum(self.node_cost[n][s] for n, s in enumerate(choice))
        return cost + sum(table[choice[u]][choice[v]] for u, v, table in self.pairs)

    def used_memory(self, choice: list[int]) -> float:
        return self.const_memory + sum(self.memory[n][s] for n, s in enumerate(choice))

    def fits(self, choice: list[int]) -> bool:
        return self.memory_limit is None or self.used_memory(choice) <= self.memory_limit

    def dp_choice(self) -> list[int] | None:
        out = []
        for nc in self.costs:
            idx = next((i for i, c in enumerate(nc.choices) if c.is_dp), None)
            if idx is None:
                return None
            out.append(idx)
        return out


# ---------------------------------------------------------------------------------------------------- exact
def solve_ilp(p: Problem, minimize_memory: bool = False,
              exclude: list = ()) -> list[int] | None:
    """``exclude``: assignments ({node: strategy}) the answer must differ from in at least one of their nodes, or
    ``(assignment, k)``: in at least k -- the next-best plans for the measured round
    (:mod:`autopar.planner.alternatives`)."""
    h = _quiet_highs()
    h.setOptionValue("time_limit", 60.0)
    x = []
    for n, nc in enumerate(p.costs):
        obj = p.memory[n] if minimize_memory else p.node_cost[n]
        x.append([h.addBinary(obj=float(obj[s])) for s in range(len(nc.choices))])
        h.addConstr(sum(x[n]) == 1)
    if not minimize_memory:
        for u, v, table in p.pairs:
            y = [[h.addVariable(lb=0.0, ub=1.0, obj=float(table[s][t])) for t in range(len(table[0]))]
                 for s in range(len(table))]
            for s in range(len(table)):
                h.addConstr(sum(y[s]) == x[u][s])
            for t in range(len(table[0])):
                h.addConstr(sum(y[s][t] for s in range(len(table))) == x[v][t])
        if p.memory_limit is not None:
            h.addConstr(sum(p.memory[n][s] * x[n][s] for n in range(len(x)) for s in range(len(x[n])))
                        <= p.memory_limit - p.const_memory)
    for entry in exclude:
        assignment, apart = entry if isinstance(entry, tuple) else (entry, 1)
        h.addConstr(sum(x[n][s] for n, s in assignment.items()) <= len(assignment) - min(apart, len(assignment)))
    h.setMinimize()
    h.run()
    if h.modelStatusToString(h.getModelStatus()) != "Optimal":
        return None
    return [max(range(len(xn)), key=lambda s: h.variableValue(xn[s])) for xn in x]


def _quiet_highs():
    """A HiGHS solver that prints nothing: since 1.16 its constructor writes a copyright banner to the C-level
    standard output, which landed in the middle of a job's log on every search."""
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    h.setOptionValue("output_flag", False)
    return h


# ------------------------------------------------------------------------------------------------ heuristic
def _neighbours(p: Problem):
    out: dict[int, list[tuple[int, list[list[float]], bool]]] = {n: [] for n in range(len(p.costs))}
    for u, v, table in p.pairs:
        out[u].append((v, table, True))
        out[v].append((u, table, False))
    return out


def _local(p: Problem, n: int, s: int, choice: list[int], nbrs) -> float:
    cost = p.node_cost[n][s]
    for m, table, forward in nbrs[n]:
        if choice[m] is not None:
            cost += table[s][choice[m]] if forward else table[choice[m]][s]
    return cost


def solve_greedy(p: Problem) -> list[int] | None:
    nbrs = _neighbours(p)
    choice: list = [None] * len(p.costs)
    order = sorted(range(len(p.costs)), key=lambda n: -max(p.node_cost[n]))
    for _ in range(20):
        changed = False
        for n in order:
            best = min(range(len(p.costs[n].choices)), key=lambda s: _local(p, n, s, choice, nbrs))
            if best != choice[n]:
                choice[n], changed = best, True
        if not changed:
            break
    while not p.fits(choice):  # cheapest memory saving per second of extra cost, until it fits
        best_move, best_ratio = None, None
        for n in range(len(choice)):
            here = _local(p, n, choice[n], choice, nbrs)
            for s in range(len(p.costs[n].choices)):
                saved = p.memory[n][choice[n]] - p.memory[n][s]
                if saved <= 0:
                    continue
                ratio = (_local(p, n, s, choice, nbrs) - here) / saved
                if best_ratio is None or ratio < best_ratio:
                    best_move, best_ratio = (n, s), ratio
        if best_move is None:
            return None
        choice[best_move[0]] = best_move[1]
    return choice


def _redistributions(p: Problem, n: int, s: int, choice: list[int], nbrs) -> int:
    """How many edges to already decided neighbours strategy ``s`` of node ``n`` would have to redistribute."""
    count = 0
    for m, table, forward in nbrs[n]:
        if choice[m] is not None:
            count += (table[s][choice[m]] if forward else table[choice[m]][s]) > 0
    return count


def solve_propagation(p: Problem) -> list[int] | None:
    """MindSpore's sharding propagation: outward from the operators the user gave strategies, each neighbour takes
    the strategy that consumes (and produces) the decided layouts as they are -- the fewest redistributions, then the
    cheapest; operators no strategy reaches stay data-parallel."""
    nbrs = _neighbours(p)
    choice: list = [0 if nc.node.fixed is not None else None for nc in p.costs]
    frontier = [n for n, c in enumerate(choice) if c is not None]
    while frontier:
        nxt = []
        for n in frontier:
            for m, _, _ in nbrs[n]:
                if choice[m] is None:
                    choice[m] = min(range(len(p.costs[m].choices)),
                                    key=lambda s: (_redistributions(p, m, s, choice, nbrs), _local(p, m, s, choice, nbrs)))
                    nxt.append(m)
        frontier = nxt
    dp = p.dp_choice()
    return [c if c is not None else (dp[n] if dp else 0) for n, c in enumerate(choice)]


def search(p: Problem, mode: str) -> tuple[list[int], float]:
    if mode not in SEARCH_MODES:
        raise StrategyError(f"unknown search_mode {mode!r}; expected one of {', '.join(SEARCH_MODES)}")
    start = time.perf_counter()
    solver = {"dynamic_programming": solve_ilp, "recursive_programming": solve_greedy,
              "sharding_propagation": solve_propagation}[mode]
    choice = solver(p)
    if choice is None or not p.fits(choice):
        smallest = solve_ilp(p, minimize_memory=True)
        need = p.used_memory(smallest) if smallest else float("nan")
        raise StrategyError(
            f"no plan fits the memory limit of {p.memory_limit / 2**20:.1f} MiB per device on "
            f"{p.costs[0].device_num} devices; the smallest plan found needs {need / 2**20:.1f} MiB"
        )
    return choice, time.perf_counter() - start
