"""The work between the operators (normalisations, activations, residual adds, the loss): measured whole in a job
-- the data-parallel step less its timed operators -- and charged to the operators as split as their outputs."""
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
