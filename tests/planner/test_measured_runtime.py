"""What the cost model takes from the runtime as it will run: the CPU time of each operator (times the ranks that
share a core), DTensor's own redistributions between operators, a partial sum summed before an activation, the
optimizer step on the network's own parameters, and ``gradients_mean``'s pass over a layout's gradients."""
import json
import os

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.models import mlp
from autopar.planner.costs import reshard_cost
from autopar.planner.graph import capture
from autopar.planner.machine import MachineModel
from autopar.planner.op_timer import cpu_share
from autopar.planner.plan import plan_network
from procutil import SCRIPTS, autopar_cmd


def test_cpu_time_times_the_ranks_per_core_on_a_cpu_with_one_thread_per_rank():
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        torch.set_num_threads(1)
        assert cpu_share(torch.device("cpu"), 1) == 1.0  # a core to itself: its CPU time is its time
        assert cpu_share(torch.device("cpu"), 4 * cores) == 4.0  # four ranks take turns on each core
        assert cpu_share(torch.device("cuda"), 4 * cores) == 0.0  # a GPU: the wall clock
        torch.set_num_threads(2)
        assert cpu_share(torch.device("cpu"), 1) == 0.0  # threads of its own: the wall clock
    finally:
        torch.set_num_threads(threads)


class TwoLinears(torch.nn.Module):
    """A Linear straight into another (no function between) and one through a ReLU."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, x):
        return self.c(torch.relu(self.b(self.a(x) * 0.5)))


def test_a_partial_sum_is_summed_before_an_activation_not_before_a_linear_function():
    graph = capture(TwoLinears(), torch.nn.MSELoss(), (torch.randn(8, 64), torch.randn(8, 64)))
    names = {node.name: node.index for node in graph.nodes}
    a, b, c = names["a"], names["b"], names["c"]
    assert (a, b, 0) in graph.edges and (b, c, 0) in graph.edges
    assert (a, b, 0) not in graph.edge_resolved  # a scaled partial sum is still a partial sum
    assert (b, c, 0) in graph.edge_resolved  # the ReLU needs the whole value
    # in the costs: a row-split b feeding a row-split c pays the all-reduce before the ReLU, then a free slice --
    # not the reduce-scatter a chain without the ReLU would need
    plan = plan_network(TwoLinears(), torch.nn.MSELoss(), (torch.randn(8, 64), torch.randn(8, 64)), 2,
                        MachineModel(device_num=2))
    machine, problem = plan.problem.machine, plan.problem
    row_b = next(i for i, ch in enumerate(plan.costs[b].choices) if ch.label == "contract 2")
    row_c = next(i for i, ch in enumerate(plan.costs[c].choices) if ch.label == "contract 2")
    table = next(t for u, v, t in problem.pairs if (u, v) == (b, c))
    nbytes = 8 * 64 * 4
    summed = (reshard_cost(machine, (Partial(),), (Replicate(),), nbytes, (2,))
              + reshard_cost(machine, (Replicate(),), (Shard(1),), nbytes, (2,)))
    assert table[row_b][row_c] == pytest.approx(summed)
    assert summed > reshard_cost(machine, (Partial(),), (Shard(1),), nbytes, (2,))
    row_a = next(i for i, ch in enumerate(plan.costs[a].choices) if ch.label == "contract 2")
    first = next(t for u, v, t in problem.pairs if (u, v) == (a, b))
    assert first[row_a][row_b] == pytest.approx(reshard_cost(machine, (Partial(),), (Shard(1),), nbytes, (2,)))


class NormedLinears(torch.nn.Module):
    """The batch into a Linear and, through a LayerNorm with its own weights, into another."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.norm = torch.nn.LayerNorm(64)

    def forward(self, x):
        return self.b(self.norm(x)) + self.a(x * 2.0)


def test_the_batch_is_redistributed_forward_only_what_a_gradient_flows_into_both_ways():
    """A redistribution's backward runs only where a gradient comes back: the batch (and what is made from it alone)
    gets none, a LayerNorm's output does (its weights), and so does an input the user made require one."""
    sample = (torch.randn(8, 64), torch.randn(8, 64))
    graph = capture(NormedLinears(), torch.nn.MSELoss(), sample)
    names = {node.name: node for node in graph.nodes}
    assert names["a"].no_grad_inputs == {0}  # x * 2.0: the batch alone
    assert names["b"].no_grad_inputs == frozenset()  # the norm's weights take a gradient
    wants = (torch.randn(8, 64, requires_grad=True), torch.randn(8, 64))
    assert {n.name: n.no_grad_inputs for n in capture(NormedLinears(), torch.nn.MSELoss(), wants).nodes}["a"] == set()
    frozen = NormedLinears()
    frozen.norm.requires_grad_(False)
    assert {n.name: n.no_grad_inputs for n in capture(frozen, torch.nn.MSELoss(), sample).nodes}["b"] == {0}
    # in the costs: a column-split "a" pays the batch's gather, not the reduce-scatter of a gradient never made
    plan = plan_network(NormedLinears(), torch.nn.MSELoss(), sample, 2, MachineModel(device_num=2))
    costs = plan.costs[names["a"].index]
    column = next(ch for ch in costs.choices if ch.label == "out 2")
    gather = reshard_cost(plan.problem.machine, (Shard(0),), (Replicate(),), 8 * 64 * 4, (2,), backward=False)
    both = reshard_cost(plan.problem.machine, (Shard(0),), (Replicate(),), 8 * 64 * 4, (2,), grad=(Partial(),))
    assert 0 < gather < both
    assert costs.boundary_cost(column, plan.problem.machine) == pytest.approx(gather)


def test_the_search_prints_nothing(capfd):
    """HiGHS 1.16 writes a banner from its constructor to the C-level standard output: not into a job's log."""
    sample = (torch.randn(8, 256), torch.randn(8, 256))
    plan_network(mlp(256, 3), torch.nn.MSELoss(), sample, 2, MachineModel(device_num=2))
    out, err = capfd.readouterr()
    assert "HiGHS" not in out + err


@pytest.mark.parametrize("mean", [True, False])
def test_gradients_mean_charges_a_layout_one_pass_over_its_gradients_and_data_parallel_none(mean):
    """A layout's gradients are multiplied by 1/n after the backward (LayoutGrads); data parallel scales them on
    their copy into a bucket, which its all-reduce already costs."""
    rates = {"fused": 8e9, "layout": 4e9, "scale": 2e10}
    sample = (torch.randn(8, 256), torch.randn(8, 256))
    autopar.set_auto_parallel_context(gradients_mean=mean)
    try:
        plan = plan_network(mlp(256, 2), torch.nn.MSELoss(), sample, 2,
                            MachineModel(device_num=2, optimizer_rates=rates))
    finally:
        autopar.reset_auto_parallel_context()
    for nc in plan.costs:
        for c in nc.choices:
            step = c.param_bytes / rates["layout"] + (c.param_bytes / rates["scale"] if mean else 0.0)
            assert c.optimizer == pytest.approx(step)
    dp = plan.problem.dp_choice()
    params = sum(plan.costs[k].choices[s].param_bytes for k, s in enumerate(dp))
    others = sum(plan.costs[k].choices[s].compute - plan.costs[k].choices[s].optimizer for k, s in enumerate(dp))
    assert plan.dp_totals.compute == pytest.approx(plan.other_compute + others + params / rates["fused"])


def test_a_redistribution_is_timed_by_the_rank_that_arrives_last_where_ranks_outnumber_the_cores(procs, tmp_path):
    out = tmp_path / "out"
    res = procs.run(autopar_cmd("launch", "-n", "4", "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "reshard_timing.py"), str(out)), procs.env(), timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    ranks = [json.loads(open(f"{out}.{r}").read()) for r in range(4)]
    cores = len(os.sched_getaffinity(0))
    # one thread a rank: 4 ranks share this host's cores where it has fewer than 4
    assert all(r["oversubscribed"] == (r["threads"] == 1 and 4 > cores) for r in ranks), ranks
    # the measured all-reduce of a parameter's gradient: one number, the same on every rank
    assert ranks[0]["seconds"] > 0 and len({r["seconds"] for r in ranks}) == 1, ranks
    # the least of every rank's times, element by element (rank r timed 1 + r and 10 - r)
    assert all(r["least_of_ranks"] == [1.0, 7.0] for r in ranks), ranks
