"""MindSpore's gradient-accumulation building blocks on one process: the module paths the sample imports,
``weights.clone(prefix="accu_grads")``, ``add_flags_recursive(accumulation=...)`` acting, a tensor assigned to a
Parameter attribute, ``TrainOneStepWithLossScaleCell`` (subclassable; its scale divided out again; overflow skips the
step), and the sample's ``TrainAccuStepsCell`` equal to one step on the sum of the micro-batches' gradients."""
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar import nn, ops
from autopar.common.tensor import ParameterTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "ms_samples"))


def test_the_samples_module_paths_import():
    from autopar.nn.optim.momentum import Momentum
    from autopar.nn.wrap.cell_wrapper import GradAccumulationCell  # r2.2's accumulation sample
    from autopar.nn.wrap.loss_scale import TrainOneStepWithLossScaleCell, _grad_scale
    from autopar.ops.operations import TensorAdd
    from autopar.ops.operations.comm_ops import AllReduce, _VirtualDataset
    from autopar.train.model import ParallelMode  # r0.2's tutorial imports it from there

    assert ParallelMode.AUTO_PARALLEL == "auto_parallel"

    assert GradAccumulationCell is nn.GradAccumulationCell and Momentum is nn.Momentum and TrainOneStepWithLossScaleCell is nn.TrainOneStepWithLossScaleCell
    assert AllReduce is ops.AllReduce and TensorAdd is ops.Add
    x, y = torch.ones(2), torch.zeros(2)
    assert _VirtualDataset()(x, y) == (x, y)
    assert torch.equal(_grad_scale(torch.tensor([4.0]), torch.full((2,), 8.0)), torch.full((2,), 2.0))


def test_weights_clone_and_flags_and_parameter_assignment():
    step = nn.TrainOneStepCell(nn.WithLossCell(nn.Dense(3, 2), nn.MSELoss()), nn.Momentum(
        nn.Dense(3, 2).trainable_params(), 0.1, 0.9))
    accu = step.weights.clone(prefix="accu_grads", init="zeros")
    assert isinstance(step.weights, ParameterTuple) and len(accu) == 2
    assert all(torch.equal(a, torch.zeros_like(w)) for a, w in zip(accu, step.weights))
    step.add_flags_recursive(accumulation=True)
    assert step.accumulation and step.network.accumulation and step.get_flags() == {"accumulation": True}

    class Holder(nn.Cell):
        def __init__(self):
            super().__init__()
            self.flag = autopar.Parameter(torch.zeros(1, dtype=torch.int32))  # int: not trainable in torch

    holder = Holder()
    holder.flag = torch.tensor([1], dtype=torch.int32)  # MindSpore's Assign to the Parameter
    assert isinstance(holder.flag, torch.nn.Parameter) and int(holder.flag) == 1


def _data(n: int):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def _reference(net: torch.nn.Module, batches: list) -> dict:
    opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    for x, y in batches:
        torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    return {k: p.detach() for k, p in net.named_parameters()}


@pytest.mark.parametrize("cell", ["TrainAccuStepsCell", "TrainAccuStepsWithLossScaleCell"])
def test_the_samples_accumulation_cells_sum_the_micro_batches(cell):
    import cell_wrapper

    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(grad_accumulation_step=3)
    try:
        torch.manual_seed(0)
        net, ref = nn.Dense(3, 2), nn.Dense(3, 2)
        ref.load_state_dict(net.state_dict())
        start = {k: p.detach().clone() for k, p in net.named_parameters()}
        opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
        args = (nn.FixedLossScaleUpdateCell(4.0),) if "LossScale" in cell else ()
        wrap = getattr(cell_wrapper, cell)(cell_wrapper.VirtualDatasetCell(nn.WithLossCell(net, nn.MSELoss())),
                                           opt, *args)
        batches = _data(3)
        for i, (x, y) in enumerate(batches):
            wrap.add_flags_recursive(accumulation=i < 2)
            wrap(x, y)
            if i < 2:
                assert all(torch.equal(p, start[k]) for k, p in net.named_parameters())
        want = _reference(ref, batches)
        assert max(float((p.detach() - want[k]).abs().max()) for k, p in net.named_parameters()) < 1e-6
        assert all(not a.any() for a in wrap.accu_grads)  # zeroed after the update, as the sample does
    finally:
        autopar.reset_auto_parallel_context()


def test_loss_scale_cell_skips_an_overflowing_step_and_dynamic_scale_moves():
    net = nn.Dense(3, 2)
    before = net.weight.detach().clone()
    manager = nn.DynamicLossScaleUpdateCell(loss_scale_value=2.0 ** 10, scale_factor=2, scale_window=2)
    step = nn.TrainOneStepWithLossScaleCell(nn.WithLossCell(net, nn.MSELoss()),
                                            nn.SGD(net.trainable_params(), 0.1), manager)
    loss, overflow, scale = step(torch.full((4, 3), float("inf")), torch.zeros(4, 2))
    assert bool(overflow) and torch.equal(net.weight, before) and float(step.scale_sense) == 2.0 ** 9
    for _ in range(2):
        loss, overflow, scale = step(torch.ones(4, 3), torch.zeros(4, 2))
    assert not bool(overflow) and not torch.equal(net.weight, before) and float(step.scale_sense) == 2.0 ** 10

    class Mine(nn.TrainOneStepWithLossScaleCell):  # subclassing works (the sample's cells do)
        pass

    assert isinstance(Mine(nn.WithLossCell(net, nn.MSELoss()), nn.SGD(net.trainable_params(), 0.1),
                           torch.tensor(1.0)), nn.TrainOneStepCell)


def test_model_accu_imports_and_stops_at_first_use_naming_the_supported_way():
    """r1.3's model_accu.py subclasses Model and drives MindSpore's graph internals: its imports load, and making a
    Model_ACCU stops with one line naming Model(..., grad_accumulation_steps=k)."""
    from model_accu import Model_ACCU

    from autopar.common.dtype import pytype_to_dtype
    from autopar.errors import UnsupportedError
    from autopar.parallel._utils import _need_to_full

    net = nn.Dense(3, 2)
    with pytest.raises(UnsupportedError, match=r"^Model._build_train_network is not available in autopar: .*"
                       r"Model\(network, loss_fn, optimizer, grad_accumulation_steps=k\)$") as err:
        Model_ACCU(nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.SGD(net.trainable_params(), 0.1)))
    assert "\n" not in str(err.value)
    with pytest.raises(UnsupportedError, match="grad_accumulation_steps=k"):
        _need_to_full()
    assert pytype_to_dtype("float32") is torch.float32
