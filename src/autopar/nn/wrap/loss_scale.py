"""``mindspore.nn.wrap.loss_scale``: ``TrainOneStepWithLossScaleCell`` and its loss-scale update cells, written so
that MindSpore's own subclasses (the gradient-accumulation sample's ``TrainAccuStepsWithLossScaleCell``) run as
written: the same attributes (``scale_sense``, ``hyper_map``, ``base``, ``less_equal``, ``allreduce``, ``grad``,
``grad_reducer``) and methods (``start_overflow_check``, ``get_overflow_status``, ``process_loss_scale``).

MindSpore reads the device's overflow flags; here the overflow test is the one torch's ``GradScaler`` makes -- a
gradient that is not finite -- summed over the ranks. The loss scale multiplies the loss's sensitivity and
``_grad_scale`` divides the gradients by it again, so with a power-of-two scale the update equals unscaled training.
"""
from __future__ import annotations

from typing import Any

import torch

from autopar.errors import TrainingError
from autopar.nn.cell import Cell
from autopar.nn.wrappers import TrainOneStepCell
from autopar.ops.comm import AllReduce
from autopar.ops.composite import HyperMap, MultitypeFuncGraph

_grad_scale = MultitypeFuncGraph("grad_scale")


@_grad_scale.register("Tensor", "Tensor")
def _tensor_grad_scale(scale: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    # a Python number: a DTensor gradient cannot be multiplied by a plain tensor
    return grad * (1.0 / float(scale.reshape(-1)[0]))


@_grad_scale.register("Number", "Tensor")
def _number_grad_scale(scale: float, grad: torch.Tensor) -> torch.Tensor:
    return grad * (1.0 / float(scale))


class FixedLossScaleUpdateCell(Cell):
    """``FixedLossScaleUpdateCell(loss_scale_value)``: the scale never changes."""

    def __init__(self, loss_scale_value: float):
        super().__init__()
        self.loss_scale_value = float(loss_scale_value)

    def get_loss_scale(self) -> float:
        return self.loss_scale_value

    def construct(self, loss_scale: torch.Tensor, overflow: Any) -> Any:
        return overflow


class DynamicLossScaleUpdateCell(Cell):
    """``DynamicLossScaleUpdateCell(loss_scale_value, scale_factor, scale_window)``: an overflow divides the scale by
    ``scale_factor`` (not below 1); ``scale_window`` steps in a row without one multiply it (MindSpore's rule)."""

    def __init__(self, loss_scale_value: float, scale_factor: float, scale_window: int):
        super().__init__()
        self.loss_scale_value = float(loss_scale_value)
        self.scale_factor, self.scale_window = float(scale_factor), int(scale_window)
        self.good_steps = 0

    def get_loss_scale(self) -> float:
        return self.loss_scale_value

    def construct(self, loss_scale: torch.Tensor, overflow: Any) -> Any:
        if bool(overflow):
            self.loss_scale_value = max(self.loss_scale_value / self.scale_factor, 1.0)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.scale_window:
                self.loss_scale_value *= self.scale_factor
                self.good_steps = 0
        with torch.no_grad():
            loss_scale.fill_(self.loss_scale_value)
        return overflow


def _distributed() -> bool:
    from autopar.comm.management import get_group_size, is_initialized

    return is_initialized() and get_group_size() > 1


class TrainOneStepWithLossScaleCell(TrainOneStepCell):
    """``TrainOneStepWithLossScaleCell(network, optimizer, scale_sense)``: one step with the loss scaled by
    ``scale_sense`` (a number-like tensor, or an update cell), the gradients unscaled, the step skipped on overflow;
    returns ``(loss, overflow, scale)``."""

    def __init__(self, network: torch.nn.Module, optimizer: torch.optim.Optimizer, scale_sense: Any):
        super().__init__(network, optimizer, sens=1.0)
        from autopar.common.tensor import Parameter

        self.hyper_map = HyperMap()
        self.base = torch.tensor(1.0)
        self.less_equal = torch.le
        self.is_distributed = _distributed()
        # MindSpore's cell all-reduces the overflow flag (its subclasses too): one process has nothing to reduce
        self.allreduce = AllReduce() if self.is_distributed else (lambda flag: flag)
        self.loss_scaling_manager = None
        if isinstance(scale_sense, Cell):
            self.loss_scaling_manager = scale_sense
            value = torch.tensor(scale_sense.get_loss_scale(), dtype=torch.float32)
        elif isinstance(scale_sense, torch.Tensor) and scale_sense.numel() == 1 and scale_sense.dim() <= 1:
            value = scale_sense.detach().to(torch.float32)
        else:
            raise TrainingError(f"TrainOneStepWithLossScaleCell: scale_sense must be a one-element Tensor or a loss "
                                f"scale update cell, got {type(scale_sense).__name__}")
        self.scale_sense = Parameter(value, name="scale_sense", requires_grad=False)

    def set_sense_scale(self, sens: torch.Tensor) -> None:
        self.scale_sense.set_data(sens)

    def start_overflow_check(self, pre_cond: Any, compute_input: Any) -> tuple:
        return False, compute_input

    def get_overflow_status(self, status: Any, compute_output: Any) -> torch.Tensor:
        bad = sum(int(not torch.isfinite(g.to_local() if hasattr(g, "to_local") else g).all()) for g in compute_output)
        flag = self.allreduce(torch.tensor([float(bad)]))
        return self.less_equal(self.base, flag)

    def process_loss_scale(self, overflow: Any) -> Any:
        if self.loss_scaling_manager is not None:
            return self.loss_scaling_manager(self.scale_sense, overflow)
        return overflow

    def construct(self, *inputs: Any) -> tuple:
        loss = self.network(*inputs)
        status, scaling_sens = self.start_overflow_check(loss, self.scale_sense)
        sens = torch.ones_like(loss) * scaling_sens.to(loss.dtype).reshape(())
        grads = self.grad(self.network, self.weights)(*inputs, sens)
        grads = self.hyper_map(lambda g: _grad_scale(scaling_sens, g), grads)
        grads = self.grad_reducer(grads)
        cond = self.get_overflow_status(status, grads)
        overflow = self.process_loss_scale(cond)
        if not bool(overflow.reshape(-1)[0] if isinstance(overflow, torch.Tensor) else overflow):
            self.optimizer(grads)
        return loss.detach(), cond, scaling_sens
