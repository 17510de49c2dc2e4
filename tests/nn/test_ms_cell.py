"""Cell and Primitive behaviours MindSpore scripts rely on: recompute, set_comm_fusion, no_init_parameters, and the
names that cannot be honoured (one line at their first use)."""
import warnings

import pytest
import torch

import autopar
from autopar import nn, ops
from autopar.common.initializer import initializer
from autopar.errors import StrategyError, UnsupportedError
from autopar.nn.utils import materialize_pending, no_init_parameters


class Counted(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc = nn.Dense(4, 4)
        self.calls = 0

    def construct(self, x):
        self.calls += 1
        return torch.tanh(self.fc(x))


def _grads(net, x):
    net.zero_grad()
    net(x).pow(2).sum().backward()
    return [p.grad.clone() for p in net.parameters()]


def test_cell_recompute_runs_the_forward_again_with_equal_gradients():
    torch.manual_seed(0)
    net = Counted()
    x = torch.randn(3, 4)
    plain = _grads(net, x)
    assert net.calls == 1
    assert net.recompute() is net
    again = _grads(net, x)
    assert net.calls == 3  # forward, then once more inside the backward
    assert all(torch.equal(a, b) for a, b in zip(plain, again))
    with torch.no_grad():
        net(x)
    assert net.calls == 4  # no backward, nothing kept, nothing recomputed
    net.recompute(False)
    _grads(net, x)
    assert net.calls == 5


def test_primitive_recompute_and_a_recomputed_dense():
    relu = ops.ReLU().recompute()
    assert relu.recompute_mode
    calls = []
    original = relu.compute
    relu.compute = lambda x: calls.append(1) or original(x)
    x = torch.randn(5, requires_grad=True)
    relu(x).sum().backward()
    assert len(calls) == 2 and torch.equal(x.grad, (x > 0).float())
    dense = nn.Dense(3, 2).recompute()
    y = dense(torch.randn(4, 3))
    y.sum().backward()
    assert dense.weight.grad is not None and isinstance(dense, torch.nn.Linear)


def test_set_comm_fusion_is_stored_and_said_once():
    net = nn.SequentialCell(nn.Dense(2, 2), nn.Dense(2, 2))
    autopar.errors._warned.discard("Cell.set_comm_fusion")
    with pytest.warns(UserWarning, match="set_comm_fusion.*size buckets"):
        net[0].set_comm_fusion(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net[1].set_comm_fusion(2)
    assert net[0].weight.comm_fusion == 1 and net[1].bias.comm_fusion == 2


def test_names_that_cannot_be_honoured_fail_at_first_use_with_one_line():
    with pytest.raises(UnsupportedError, match=r"^Cell.shard is available in autopar for a cell without children"):
        nn.SequentialCell(nn.Dense(2, 2)).shard(((1, 1),))
    with pytest.raises(StrategyError, match=r"a sequence split is for norms and dropout .* not a Dense \(give it "):
        nn.Dense(2, 2).shard(((1, 1),))
    norm = nn.LayerNorm((4,))
    assert norm.shard(((1, 2, 1),)) is norm and norm._autopar_split == ("strategy", (1, 2, 1))
    with pytest.raises(UnsupportedError) as err:
        nn.MicroBatchInterleaved(None)
    assert "nn.MicroBatchInterleaved is not available in autopar" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(UnsupportedError):
        class Mine(nn.MicroBatchInterleaved):  # subclassing is a use too
            pass


def test_no_init_parameters_builds_on_meta_and_materialises_on_the_first_call():
    autopar.set_seed(3)
    eager = nn.SequentialCell(nn.Dense(4, 8, weight_init="normal"), nn.ReLU(), nn.Dense(8, 2))
    autopar.set_seed(3)
    with no_init_parameters():
        net = nn.SequentialCell(nn.Dense(4, 8, weight_init="normal"), nn.ReLU(), nn.Dense(8, 2))
        net.insert_param_to_cell("w", autopar.Parameter(initializer("ones", [2, 2]), name="w"))
        plain = torch.nn.Linear(2, 3)
        opt = nn.SGD(net.trainable_params(), 0.1)
    weight = net.w
    assert net[0].weight.device.type == "meta" and weight.device.type == "meta" and plain.weight.is_meta
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    out = net(x)  # the first call materialises every pending parameter, in place
    assert not net[0].weight.is_meta and not weight.is_meta and not plain.weight.is_meta
    assert torch.equal(weight, torch.ones(2, 2)) and weight.name == "w"
    assert plain.weight.abs().max() <= 1 / 2 ** 0.5  # torch's own reset_parameters
    assert torch.equal(out, eager(x))  # the same draws, in the same order, as building it eagerly
    before = net[0].weight.detach().clone()
    out.sum().backward()
    opt.step()  # the optimizer made inside the block holds the same (now real) parameters
    assert not torch.equal(net[0].weight, before)
    assert materialize_pending() == 0


def test_a_trainonestepcell_subclass_written_as_mindspores_trains():
    class Step(nn.TrainOneStepCell):
        def construct(self, *inputs):
            loss = self.network(*inputs)
            sens = ops.fill(loss.dtype, loss.shape, self.sens)
            grads = self.grad(self.network, self.weights)(*inputs, sens)
            grads = self.grad_reducer(grads)
            self.optimizer(grads)
            return loss

    torch.manual_seed(0)
    net, ref = nn.Dense(3, 2), nn.Dense(3, 2)
    ref.load_state_dict(net.state_dict())
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    Step(nn.WithLossCell(net, nn.MSELoss()), nn.SGD(net.trainable_params(), 0.1))(x, y)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    assert torch.allclose(net.weight, ref.weight - 0.1 * ref.weight.grad, atol=1e-6)


def test_mindspore_transformer_library_stops_at_first_use():
    from autopar.nn.transformer import TransformerOpParallelConfig

    with pytest.raises(UnsupportedError, match="nn.transformer.TransformerOpParallelConfig is not available"):
        TransformerOpParallelConfig(data_parallel=1, model_parallel=2)
    hint = nn.Dropout(keep_prob=0.9).dropout
    autopar.errors._warned.discard("nn.Dropout.dropout.shard")
    with pytest.warns(UserWarning, match="accepted and not applied"):
        assert hint.shard(((2, 1),)) is hint
