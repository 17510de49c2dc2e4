"""The work between the operators (normalisations, activations, residual adds, the loss): measured whole in a job
-- the data-parallel step less its timed operators -- and charged to the operators as split as their outputs."""
import math

import pytest
import torch

from autopar.models import TransformerBlock, mlp
from autopar.planner.machine import MachineModel
from autopar.planner.op_timer import OpTimer
from autopar.planner.plan import plan_network


def _timed_plan(net, sample, tmp_path, n=2):
    machine = MachineModel(device_num=n)
    machine.op_timer = OpTimer(torch.device("cpu"), tmp_path / "ops.json")
    return plan_network(net, torch.nn.MSELoss(), sample, n, machine)


def test_the_step_between_the_operators_is_measured_and_charged_by_output_split(tmp_path):
    torch.manual_seed(0)
    sample = (torch.randn(4, 16, 64), torch.randn(4, 16, 64))
    plan = _timed_plan(TransformerBlock(64, 4, 128), sample, tmp_path)
    roofline = plan_network(TransformerBlock(64, 4, 128), torch.nn.MSELoss(), sample, 2, MachineModel(device_num=2))
    between = plan.problem.between
    assert plan.problem.between_measured and between >= roofline.problem.between > 0
    # data parallel pays all of it, once: 1/n of the batch on each rank
    dp = plan.problem.dp_choice()
    shares = sum(plan.costs[k].choices[s].compute - plan.costs[k].choices[s].optimizer for k, s in enumerate(dp))
    assert shares == pytest.approx(sum(nc.dp_compute for nc in plan.costs))
    # an operator whose output is whole on every rank (no split of the batch) pays n times its data-parallel share
    for nc in plan.costs:
        dp_choice = next(c for c in nc.choices if c.is_dp)
        whole = next((c for c in nc.choices if c.label == "replicated"), None)
        if whole is not None:
            assert whole.out_bytes == pytest.approx(2 * dp_choice.out_bytes)
    assert "between the operators" in plan.explain() and "measured" in plan.explain()


def test_measuring_the_step_leaves_the_network_as_it_was(tmp_path):
    """A deep copy runs: no gradients, BatchNorm statistics or random draws of the caller's change."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32), torch.nn.Dropout(0.5),
                              torch.nn.Linear(32, 32))
    from autopar.planner.graph import with_loss
    from autopar.planner.op_timer import whole_step_seconds

    before = {k: v.clone() for k, v in net.state_dict().items()}
    sample = (torch.randn(8, 32), torch.randn(8, 32))
    state = torch.get_rng_state()
    timer = OpTimer(torch.device("cpu"), None)
    seconds = whole_step_seconds(timer, "step x", with_loss(net, torch.nn.MSELoss()), sample, {}, 2)
    assert seconds > 0 and timer.table["step x"] == (seconds, seconds)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all(p.grad is None for p in net.parameters())
    assert torch.equal(torch.get_rng_state(), state)


def test_a_network_that_cannot_step_on_a_slice_keeps_the_roofline(tmp_path):
    class WholeBatchOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = mlp(16, 2)

        def forward(self, x):
            assert x.shape[0] == 8, "needs the whole batch"
            return self.fc(x)

    plan = _timed_plan(WholeBatchOnly(), (torch.randn(8, 16), torch.randn(8, 16)), tmp_path)
    roofline = plan.problem.machine.compute("other", 3.0 * plan.graph.other_flops / 2)
    assert plan.problem.between == pytest.approx(roofline) and not plan.problem.between_measured


def test_attention_is_charged_as_split_as_its_query_and_a_shared_input_is_reduced_once():
    """SDPA is no node: its time goes to the node its query comes from (through the heads' reshape, RoPE's halves
    and the transpose back), as split as that node leaves the heads -- a row-split ``q`` computes every head, a
    column-split one 1/n of them. And where q, k and v (gate and up) take the norm's output alike, the partial
    gradients are summed before the one reduction the runtime runs (Megatron's block: 2 a step, not 5)."""
    from autopar.models import LlamaBlock
    from autopar.planner.costs import charge_attention, graph_costs, shared_reduction
    from autopar.planner.graph import capture
    from autopar.planner.search import Problem

    torch.manual_seed(0)
    n = 4
    net = LlamaBlock(64, 4, 4, 128, 64, causal=True)
    graph = capture(net, torch.nn.MSELoss(), (torch.randn(1, 64, 64), torch.randn(1, 64, 64)))
    names = [node.name for node in graph.nodes]
    q, o = names.index("q"), names.index("o")
    assert graph.attention_sources == (q,)
    assert graph.edge_dims.get((q, o, 0)) is None  # o's input dimensions are q's output's, not permuted
    machine = MachineModel(device_num=n)
    costs = graph_costs(graph, machine, n)
    before = [[c.compute for c in nc.choices] for nc in costs]
    charged = charge_attention(graph, costs, machine, n)
    (qs, ks, _, _, _, _), = graph.attention
    assert charged == pytest.approx(machine.compute("attention", 3.5 * 2.0 * qs[0] * qs[1] * qs[2] * qs[3] * ks[2]))
    by_label = {c.label: c.compute - b for c, b in zip(costs[q].choices, before[q])}
    assert by_label["data parallel"] == pytest.approx(charged)  # (a batch of 1: data parallel computes it all)
    assert by_label["out 4"] == pytest.approx(charged / 4) and by_label["contract 4"] == pytest.approx(charged)
    assert all(c.compute == b for k, nc in enumerate(costs) if k != q for c, b in zip(nc.choices, before[k]))
    # k and v take q's input: the gradient of the norm's output is reduced once where they split alike
    k = names.index("k")
    assert graph.nodes[k].same_input == {0: (q, 0)}
    col = {nc.node.name: next(c for c in nc.choices if c.label == "out 4") for nc in costs}
    row = next(c for c in costs[k].choices if c.label == "contract 4")
    saved = shared_reduction(costs[q], col["q"], 0, costs[k], col["k"], 0, machine)
    assert saved > 0 and shared_reduction(costs[q], col["q"], 0, costs[k], row, 0, machine) == 0
    problem = Problem(graph, costs, machine, 0.0, None)
    shared = {(graph.nodes[a].name, graph.nodes[b].name) for a, b, table in problem.pairs
              if a != b and min(min(r) for r in table) < 0}
    assert shared == {("q", "k"), ("q", "v"), ("gate", "up")}


def test_a_meta_built_network_is_planned_as_it_is_and_a_forward_meta_cannot_trace_is_named():
    """Planned on the meta device: nothing made (its parameters stay meta, a buffer made already is put back the
    same object); a mixture of experts too, its experts traced with a uniform routing drawn for them (a meta router
    has no values: it used to be built whole to be planned); a forward whose sizes are set by other values (a mask
    of the activations) is a MetaTraceError naming why -- the runtime then builds it whole with one warning -- while
    the planner's own errors stay themselves."""
    from autopar.errors import StrategyError
    from autopar.models import LlamaBlock, MoEBlock
    from autopar.planner.plan import MetaTraceError

    with torch.device("meta"):
        block = LlamaBlock(32, 4, 2, 64, 16, causal=True)
    block.cos, block.sin = torch.ones(16, 4), torch.zeros(16, 4)  # made already (as _prepare_deferred makes buffers)
    cos = block.cos
    sample = (torch.randn(2, 16, 32), torch.randn(2, 16, 32))
    plan = plan_network(block, torch.nn.MSELoss(), sample, 2, MachineModel(device_num=2))
    assert [n.name for n in plan.graph.nodes][:3] == ["q", "k", "v"] and plan.graph.attention
    assert all(p.is_meta for p in block.parameters()) and block.cos is cos and not cos.is_meta
    with torch.device("meta"):
        moe = MoEBlock(16, 4, 32, 2)
    plan = plan_network(moe, torch.nn.MSELoss(), (torch.randn(2, 8, 16), torch.randn(2, 8, 16)), 2,
                        MachineModel(device_num=2))
    (experts, _, hidden, _, count, chosen), = plan.graph.experts
    assert experts is moe.experts and hidden == (16, 16) and (count, chosen) == (4, 2)
    assert "expert parallel 2" in " ".join(plan.variants) and all(p.is_meta for p in moe.parameters())

    class Masked(torch.nn.Module):  # rows kept by their values
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.lin(x[x.sum(-1) > 0]).sum() + 0 * x.sum()

    with torch.device("meta"):
        masked = Masked()
    with pytest.raises(MetaTraceError, match="nonzero"):
        plan_network(masked, None, (torch.randn(2, 8, 16),), 2, MachineModel(device_num=2))
    with pytest.raises(StrategyError):  # (not taken for a trace failure: no plan fits 1 byte)
        plan_network(block, torch.nn.MSELoss(), sample, 2, MachineModel(device_num=2), memory_limit=1.0)


def test_a_parameter_tied_to_a_module_kept_whole_is_never_split():
    """nanoGPT ties its output head to the token embedding, which runs as a data-parallel leaf (kept replicated). A
    plan that split the head's weight could not run ("one parameter must have one strategy": every layout plan of a
    meta-built GPT failed so, and the meta plan has no measured round to catch it): the head's choices keep its
    weight whole, the untied projections' do not."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=96, n_layer=1, n_head=2, n_embd=32))
    idx = torch.randint(0, 96, (4, 16))
    plan = plan_network(model, None, (idx, idx), 2, MachineModel(device_num=2), search_mode="exhaustive")
    nodes = {n.name: (n, nc) for n, nc in zip(plan.graph.nodes, plan.costs)}
    head, head_costs = nodes["lm_head"]
    assert head.replicated_params == frozenset({1})
    assert all(math.prod(c.strategy[1]) == 1 for c in head_costs.choices)
    fc, fc_costs = nodes["transformer.h.0.mlp.c_fc"]
    assert fc.replicated_params == frozenset() and any(math.prod(c.strategy[1]) > 1 for c in fc_costs.choices)
