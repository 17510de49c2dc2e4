"""MindSpore's shard strategies read as a pipeline stage's tensor plan (:mod:`autopar.parallel.pipeline.stage_strategies`),
without a cluster: what the operators' strategies say of the weights they are called with, and each way a set of
strategies cannot run inside a stage -- a warning's reason, or one line where the strategy is wrong for the stage.
(The runs, exact against one process on 4 and 8 ranks: tests/parallel/test_pipeline_tensor.py.)"""
import pytest
import torch
from torch.distributed.tensor import Shard

import autopar
from autopar import nn, ops
from autopar.errors import ConfigError
from autopar.parallel.pipeline.stage_strategies import Uses, recording, sequence_entries, tensor_plan_of


class Block(nn.Cell):
    def __init__(self, first, second):
        super().__init__()
        self.w1 = autopar.Parameter(torch.randn(4, 6), name="w1")
        self.w2 = autopar.Parameter(torch.randn(6, 4), name="w2")
        self.matmul1, self.matmul2 = ops.MatMul().shard(first), ops.MatMul().shard(second)
        self.head = nn.Dense(4, 3)
        autopar.shard(self.head, ((1, 1), (2, 1)))

    def construct(self, x):
        return self.head(self.matmul2(torch.relu(self.matmul1(x, self.w1)), self.w2))


def _uses(first, second) -> Uses:
    net = Block(first, second)
    with recording(net) as uses:
        net(torch.randn(2, 4))
    return uses


def test_the_strategies_weight_splits_become_the_stage_tensor_plan():
    uses = _uses(((1, 1), (1, 2)), ((1, 2), (2, 1)))  # Megatron's column then row split, over 2 ranks
    assert uses.splits["w1"] == ("matmul1", (1, 2)) and uses.splits["w2"] == ("matmul2", (2, 1))
    assert uses.splits["head.weight"][1] == (2, 1) and uses.splits["head.bias"][1] == (2,)
    tp, plan, why = tensor_plan_of(uses, 4)
    assert (tp, why) == (2, None)
    assert plan == {"w1": Shard(1), "w2": Shard(0), "head.weight": Shard(0), "head.bias": Shard(0)}


def test_batch_only_strategies_are_the_stage_data_parallelism():
    uses = Uses({"w1": ("matmul1", (1, 1)), "w2": ("matmul2", (1, 1))})
    assert tensor_plan_of(uses, 4) == (1, {}, None)


def test_strategies_a_stage_cannot_run_give_the_reason():
    two_dims = Uses({"w1": ("matmul1", (2, 2))})
    assert "splits parameter 'w1' on 2 dimensions (2, 2)" in tensor_plan_of(two_dims, 4)[2]
    degrees = Uses({"w1": ("matmul1", (1, 2)), "w2": ("matmul2", (4, 1))})
    assert "over 2 ranks and 'matmul2' splits 'w2' over 4" in tensor_plan_of(degrees, 4)[2]
    conflict = _uses(((1, 1), (1, 2)), ((1, 2), (2, 1)))
    conflict.conflicts.append("parameter 'w1' is split (1, 2) by 'matmul1' and (2, 1) by 'other'")
    assert tensor_plan_of(conflict, 4)[:2] == (1, {}) and "one parameter, one strategy" in tensor_plan_of(conflict, 4)[2]


def test_a_split_wider_than_the_stage_is_one_line():
    with pytest.raises(ConfigError, match=r"splits parameter 'w1' over 4 ranks, which do not divide the 2 rank\(s\) "
                                          "of a pipeline stage"):
        tensor_plan_of(Uses({"w1": ("matmul1", (1, 4))}), 2)


def test_one_parameter_given_two_strategies_is_recorded():
    class Shared(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = autopar.Parameter(torch.randn(4, 4), name="w")
            self.a, self.b = ops.MatMul().shard(((1, 1), (1, 2))), ops.MatMul().shard(((1, 1), (2, 1)))

        def construct(self, x):
            return self.b(self.a(x, self.w), self.w)

    net = Shared()
    with recording(net) as uses:
        net(torch.randn(2, 4))
    assert uses.conflicts == ["parameter 'w' is split (1, 2) by 'a' and (2, 1) by 'b'"]


def test_cells_split_on_the_sequence_run_beside_the_tensor_split():
    net = torch.nn.Sequential(nn.LayerNorm((4,)), nn.Dropout(p=0.0), nn.LayerNorm((4,)))
    net[0].shard(((1, 2, 1),))  # MindFormers' spelling, written for the stage's ranks
    autopar.shard(net[1], "sequence")  # the PyTorch door's
    assert sequence_entries(net, 2) == ({"0": "sequence", "1": "sequence"}, None)
    assert "no strategy splits one" in sequence_entries(net, 1)[1]  # sequence parallelism without a tensor split
    net[2].shard(((1, 1, 2),))
    assert "cell '2' is split (1, 1, 2); inside a stage a cell splits the sequence" in sequence_entries(net, 2)[1]
    wider = torch.nn.Sequential(nn.LayerNorm((4,)))
    wider[0].shard(((1, 4, 1),))
    assert sequence_entries(wider, 2)[0] == {}
