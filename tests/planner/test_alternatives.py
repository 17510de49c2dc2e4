"""The measured round's runners-up: the plans the cost model ranks next, each a real alternative -- not the chosen
plan with one layer changed."""
import math

import torch

from autopar.models import TransformerBlock, mlp
from autopar.planner.alternatives import NEAR_BAND, NEAR_MOST, alternatives, describe
from autopar.planner.machine import MachineModel
from autopar.planner.plan import plan_network


def _assignment(plan):
    return {n: plan.choice[n] for n, node in enumerate(plan.graph.nodes) if any(node.param_names)}


def test_the_next_best_layouts_then_layouts_a_third_of_the_layers_apart():
    """The two best runners-up may be the chosen plan with one layer changed (Megatron's pairs were one layer from
    a near-tie of the model), and so may more, up to NEAR_MOST, while they are predicted within NEAR_BAND of it; the
    last three change a third of the layers of every plan before them."""
    sample = (torch.randn(8, 1024), torch.randn(8, 1024))
    plan = plan_network(mlp(1024, 4), torch.nn.MSELoss(), sample, 4, MachineModel(device_num=4))
    assert not plan.pure_data_parallel  # a wide MLP on a small batch: its weights are split
    round_ = alternatives(plan, within=1e9)
    layouts = [c for c in round_ if not c.pure_data_parallel]
    assert "data parallel" in [describe(c) for c in round_]
    assignments = [_assignment(c) for c in layouts]
    assert len({tuple(sorted(a.items())) for a in assignments}) == len(layouts)  # all different
    # after the chosen plan (the round lists them by prediction): the near ones, one layer changed may do, and
    # three a third of the layers apart from the chosen plan, the near ones and each other
    near = sorted((c for c in layouts[1:] if not c.reason.endswith("apart")), key=lambda c: c.totals.step)
    far = [_assignment(c) for c in layouts[1:] if c.reason.endswith("apart")]
    assert 2 <= len(near) <= NEAR_MOST and len(far) == 3, len(layouts)
    assert all(c.totals.step >= plan.totals.step - 1e-12 for c in near)
    assert all(c.totals.step <= NEAR_BAND * plan.totals.step for c in near[2:])  # the extra near-ties
    need = math.ceil(4 / 3)
    for b in far:
        for a in [assignments[0]] + [_assignment(c) for c in near] + [a for a in far if a is not b]:
            assert sum(a[n] != b[n] for n in a) >= need


def test_a_data_parallel_choice_is_followed_by_the_best_layouts_apart_from_each_other():
    sample = (torch.randn(16, 32, 64), torch.randn(16, 32, 64))
    plan = plan_network(TransformerBlock(64, 4, 256), torch.nn.MSELoss(), sample, 2, MachineModel(device_num=2))
    round_ = alternatives(plan, within=1e9)
    assert describe(round_[0]) == "data parallel"
    layouts = [_assignment(c) for c in round_[1:]]
    assert len(layouts) == 5
    need = math.ceil(len(layouts[0]) / 3)
    for k in range(1, len(layouts)):
        for j in range(k):
            assert sum(layouts[j][n] != layouts[k][n] for n in layouts[k]) >= need


def test_sharding_propagation_plans_a_loss_with_a_one_hot_inside():
    """MindSpore's SoftmaxCrossEntropyExpand one-hot encodes its labels (1-D indices, a strategy of the 2-D output):
    the operator runs data-parallel in the plan instead of failing it (the bench's hand-sharded ResNet-50 did)."""
    import autopar
    from autopar.nn import SoftmaxCrossEntropyExpand

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(8 * 16, 10))
    autopar.shard(net[0], ((1, 1, 1, 1), (2, 1, 1, 1)))
    sample = (torch.randn(4, 3, 4, 4), torch.randint(0, 10, (4,), dtype=torch.int32))
    with autopar.context.managed():
        plan = plan_network(net, SoftmaxCrossEntropyExpand(sparse=True), sample, 2, MachineModel(device_num=2),
                            "sharding_propagation")
    assert "onehot" not in [node.name.split(".")[-1] for node in plan.graph.nodes]
    assert plan.totals.step > 0
