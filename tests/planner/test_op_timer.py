"""Operator costs measured at the shapes a strategy gives each rank: each distinct shape timed once, kept on disk,
and used by the plan's costs in place of the roofline."""
import json

import torch

from autopar.models import mlp
from autopar.planner.machine import MachineModel
from autopar.planner.op_timer import OpTimer
from autopar.planner.plan import plan_network


def test_measured_costs_replace_the_roofline_and_are_kept_per_shape(tmp_path):
    path = tmp_path / "ops.json"
    machine = MachineModel(device_num=2)
    machine.op_timer = OpTimer(torch.device("cpu"), path)
    sample = (torch.randn(8, 256), torch.randn(8, 256))
    plan = plan_network(mlp(256, 3), torch.nn.MSELoss(), sample, 2, machine)
    measured = machine.op_timer.measured
    assert measured >= 4  # data parallel, column and row slices of the 256x256 layers at least; the whole step
    kept = json.loads(path.read_text())
    assert len(kept) == measured and all(0 < fwd <= total for fwd, total in kept.values())
    assert sum(key.startswith("step ") for key in kept) == 1
    # each choice's compute = its measured time + its share of the work between the operators + its optimizer step
    outputs = sum(nc.dp_out_bytes for nc in plan.costs)
    for n, node in enumerate(plan.graph.nodes):
        for c in plan.costs[n].choices:
            shapes = [tuple(c.plan.inputs[i].slice_shape) for i in range(len(node.shapes))]
            fwd, total = machine.op_timer.node(node, shapes)
            share = plan.problem.between * c.out_bytes / outputs
            assert abs(c.compute - c.optimizer - total - share) < 1e-12 and abs(c.backward - (total - fwd)) < 1e-12
    again = OpTimer(torch.device("cpu"), path)  # a restart reads the shapes instead of measuring them
    machine2 = MachineModel(device_num=2)
    machine2.op_timer = again
    plan_network(mlp(256, 3), torch.nn.MSELoss(), sample, 2, machine2)
    assert again.measured == 0


def test_convolutions_matmuls_and_softmax_are_timed_too(tmp_path):
    from autopar.planner.graph import capture

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            from autopar.ops.math import BatchMatMul, Softmax

            self.conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
            self.mm, self.softmax = BatchMatMul(transpose_b=True), Softmax(-1)

        def forward(self, x):
            y = self.conv(x).flatten(2)
            return self.softmax(self.mm(y, y))

    graph = capture(Net(), None, (torch.randn(2, 3, 8, 8),))
    timer = OpTimer(torch.device("cpu"), None)
    kinds = {}
    for node in graph.nodes:
        kinds[node.kind] = timer.node(node, list(node.shapes))
    assert set(kinds) == {"conv", "matmul", "softmax"} and all(v[0] > 0 for v in kinds.values()), kinds


def test_a_convolution_that_pads_itself_is_timed_as_the_module_runs_it():
    """The tutorial's ResNet-50 pads "same" inside its convolution's forward (its padding attribute is 0): the timer
    runs the module's own convolution, so a 3x3 kernel on a 2x2 map works as in the network."""
    from autopar.models import resnet50
    from autopar.nn import SoftmaxCrossEntropyExpand
    from autopar.planner.graph import capture

    graph = capture(resnet50(num_classes=10), SoftmaxCrossEntropyExpand(sparse=True),
                    (torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,), dtype=torch.int32)))
    timer = OpTimer(torch.device("cpu"), None)
    small = [n for n in graph.nodes if n.kind == "conv" and n.shapes[0][-1] <= 2 and n.shapes[1][-1] == 3]
    assert small, "the 2x2 maps of the last stages"
    for node in small[:2]:
        assert timer.node(node, list(node.shapes)) is not None, node.name


def test_attention_is_timed_as_the_network_calls_it_and_charged_to_its_query(tmp_path):
    """SDPA timed at this rank's shapes -- causal, grouped-query where the keys have fewer heads -- kept per shape;
    in a plan it is charged to the query's node, and the work between the operators is what is left of the step."""
    timer = OpTimer(torch.device("cpu"), tmp_path / "ops.json")
    gqa = timer.attention([(1, 4, 32, 8), (1, 2, 32, 8), (1, 2, 32, 8)], 4, True)
    assert gqa is not None and 0 < gqa[0] < gqa[1]
    assert any("sdpa" in k and "True" in k for k in timer.table)
    from autopar.models import LlamaBlock

    torch.manual_seed(0)
    machine = MachineModel(device_num=2)
    machine.op_timer = OpTimer(torch.device("cpu"), tmp_path / "ops2.json")
    sample = (torch.randn(4, 32, 64), torch.randn(4, 32, 64))  # a batch data parallel splits: 2 sequences a rank
    plan = plan_network(LlamaBlock(64, 4, 2, 128, 32, causal=True), torch.nn.MSELoss(), sample, 2, machine)
    timed = [v for k, v in machine.op_timer.table.items() if "sdpa" in k]
    assert len(timed) == 1 and "(2, 4, 32, 16)" in next(k for k in machine.op_timer.table if "sdpa" in k)
    q = next(nc for nc in plan.costs if nc.node.name == "q")
    assert q.dp_compute >= timed[0][1]  # the query's node carries the attention under data parallel


def test_stacked_experts_are_timed_as_data_parallel_and_expert_parallelism_run_them(tmp_path):
    """A module of stacked experts timed twice: every expert over this rank's tokens (data parallel), and the
    rank's E / n experts over the tokens the all-to-all brings it (expert parallelism); the module is left as it
    was -- its own weights, no gradients -- and a plan in a job prices the expert split from the two."""
    from autopar.models import MoEBlock
    from autopar.planner import dimensions
    from autopar.planner.plan import dispatch_of

    torch.manual_seed(0)
    block = MoEBlock(32, 4, 48, 2)
    experts = block.experts
    weights = dict(experts.named_parameters())
    timer = OpTimer(torch.device("cpu"), tmp_path / "ops.json")
    timed = timer.experts(experts, 64, 32, 2, 2, 2)
    assert timed is not None and timed[0] > 0 and timed[1] > 0
    assert all(p is weights[n] and p.grad is None for n, p in experts.named_parameters())
    assert experts.num_experts == 4 and any("experts" in k for k in timer.table)
    assert timer.experts(experts, 64, 32, 2, 2, 3) is None  # 3 ranks do not divide 4 experts
    with torch.device("meta"):
        assert timer.experts(MoEBlock(32, 4, 48, 2).experts, 64, 32, 2, 2, 2) is None  # no values to time

    machine = MachineModel(device_num=2)
    machine.op_timer = OpTimer(torch.device("cpu"), tmp_path / "ops2.json")
    sample = (torch.randn(8, 4, 32), torch.randn(8, 4, 32))
    plan = plan_network(block, torch.nn.MSELoss(), sample, 2, machine)
    dp, ep = dimensions.experts_timed(plan.graph, machine, 2)
    d, inside = plan.dp_totals, {id(p) for p in experts.parameters()}
    sizes = {id(p): float(p.numel() * p.element_size()) for p in block.parameters()}
    args = (plan.graph, machine, d, 2, [b for k, b in sizes.items() if k not in inside],
            [b for k, b in sizes.items() if k in inside], dispatch_of(plan.problem))
    timed_compute, untimed_compute = dimensions.expert_totals(*args, (dp, ep))[0], dimensions.expert_totals(*args)[0]
    assert plan.variants["data parallel + expert parallel 2"][2].compute == timed_compute
    # data parallel's step (as measured, where it was) with its experts' time replaced by their split time
    base = d.step if d.measured else d.compute
    assert abs(timed_compute - untimed_compute - (max(0.0, base - dp) + ep - d.compute)) < 1e-12
