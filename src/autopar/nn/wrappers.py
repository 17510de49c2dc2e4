"""MindSpore's training wrappers: ``WithLossCell`` (a backbone and its loss), ``PipelineCell`` and
``GradAccumulationCell`` (micro-batches whose losses are summed), ``TrainOneStepCell`` (one training step per call,
MindSpore r1.x's custom loop), ``DistributedGradReducer`` and ``PipelineGradReducer``.

In a parallel mode the network inside ``TrainOneStepCell`` is the one that parallelizes itself on its first call
(the wrapper is marked as a step wrapper, so autopar looks through it), and gradients are complete when the
backward returns: ``DistributedGradReducer`` has nothing left to do and returns its input.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from autopar.errors import TrainingError
from autopar.labels import call_loss
from autopar.nn.cell import Cell


class WithLossCell(Cell):
    def __init__(self, backbone, loss_fn: Callable):
        super().__init__()
        self._backbone = backbone
        self._loss_fn = loss_fn

    def construct(self, data, label):
        return call_loss(self._loss_fn, self._backbone(data), label)

    @property
    def backbone_network(self):
        return self._backbone


def _micro_batches(inputs: tuple, micro_size: int) -> list[tuple]:
    chunks = [t.tensor_split(micro_size) if isinstance(t, torch.Tensor) else [t] * micro_size for t in inputs]
    return list(zip(*chunks))


class PipelineCell(Cell):
    """``nn.PipelineCell(network_with_loss, micro_size, stage_config=None)``: the loss of a batch computed over
    ``micro_size`` micro-batches and *summed*, as MindSpore's ``PipelineCell.construct`` adds them: the loss and every
    gradient are ``micro_size`` x the batch mean's (the PyTorch door, ``autopar.PipelineParallel``, keeps torch's
    mean).

    With ``set_auto_parallel_context(pipeline_stages=S)``, S > 1, it runs on torch's pipeline engine
    (:mod:`autopar.parallel.pipeline`), split before the first cell of each stage (``cell.pipeline_stage = k``, or
    ``stage_config={"cell name": k}`` here): through ``Model.train``, or called inside ``value_and_grad`` (MindSpore
    2.3's functional pipeline) -- a call then runs the forward and the backward of every micro-batch and returns the
    loss; ``value_and_grad`` takes the gradients the backward left. Without stages it computes on this process."""

    def __init__(self, network: torch.nn.Module, micro_size: int, stage_config: dict | None = None):
        super().__init__()
        if not isinstance(micro_size, int) or isinstance(micro_size, bool) or micro_size < 1:
            raise TrainingError(f"PipelineCell: micro_size must be a positive integer, got {micro_size!r}")
        self.network = network
        self.micro_size = micro_size
        cells = dict(network.named_modules())
        for name, stage in (stage_config or {}).items():
            if name not in cells:
                raise TrainingError(f"PipelineCell stage_config: the network has no cell '{name}'")
            cells[name].pipeline_stage = int(stage)

    def construct(self, *inputs: Any) -> torch.Tensor:
        from autopar import context as _context

        if _context.auto_parallel_context().pipeline_stages > 1:
            ref = self.__dict__.get("_autopar_state")  # the parallel runtime's state of this cell (no import)
            runner = getattr(getattr(ref, "state", None), "pipeline", None)
            if runner is None:
                raise TrainingError("a PipelineCell with pipeline_stages > 1 needs a parallel mode "
                                    "(semi_auto_parallel) and autopar.communication.init() before its first call")
            return runner.step(*inputs)
        return torch.stack([self.network(*micro) for micro in _micro_batches(inputs, self.micro_size)]).sum()


class GradAccumulationCell(Cell):
    """``nn.GradAccumulationCell(network_with_loss, micro_size)`` (also ``autopar.parallel.nn.GradAccumulation``):
    the batch computed as ``micro_size`` micro-batches whose losses are summed, as MindSpore's. Through
    ``Model.train`` each micro-batch's backward runs on its own (its activations freed before the next one) and only
    the last one communicates -- gradient accumulation; in any other loop the summed loss has the same gradients."""

    def __init__(self, network: torch.nn.Module, micro_size: int):
        super().__init__()
        if not isinstance(micro_size, int) or isinstance(micro_size, bool) or micro_size < 1:
            raise TrainingError(f"GradAccumulationCell: micro_size must be a positive integer, got {micro_size!r}")
        self.network = network
        self.micro_size = micro_size

    def micro_batches(self, *inputs: Any) -> list[tuple]:
        return _micro_batches(inputs, self.micro_size)

    def construct(self, *inputs: Any) -> torch.Tensor:
        return torch.stack([self.network(*micro) for micro in self.micro_batches(*inputs)]).sum()


class PipelineGradReducer(Cell):
    """``nn.PipelineGradReducer(parameters, scale_sense=1.0)``: MindSpore's functional pipeline accumulates and
    reduces the micro-batches' gradients here. autopar's pipeline step already did (the gradients
    ``value_and_grad`` returns are complete), so this only applies ``scale_sense``."""

    def __init__(self, parameters: Any = None, scale_sense: float = 1.0, opt_shard: bool | None = None):
        super().__init__()
        self.scale_sense = float(scale_sense)

    def construct(self, grads: Any) -> Any:
        if self.scale_sense == 1.0:
            return grads
        return tuple(g * self.scale_sense for g in grads)


class TrainOneStepCell(Cell):
    """``TrainOneStepCell(net_with_loss, optimizer, sens=1.0)(*inputs)``: forward, backward (the loss's gradient
    scaled by ``sens``; a non-scalar loss -- ``SoftmaxCrossEntropyWithLogits()``'s one per sample -- is
    back-propagated with ``sens`` in every element, as MindSpore does), optimizer step; returns the loss. Works with
    any torch optimizer."""

    _autopar_step_wrapper = True

    def __init__(self, network: torch.nn.Module, optimizer: torch.optim.Optimizer, sens: float = 1.0,
                 return_grad: bool = False):
        super().__init__()
        if return_grad:
            raise TrainingError("TrainOneStepCell(return_grad=True) is not supported by autopar")
        self.network = network
        self.optimizer = optimizer
        self.sens = 1.0 if sens is None else float(sens)
        # what MindSpore's own cell holds, for subclasses that write their construct as MindSpore's does:
        # grads = self.grad(self.network, self.weights)(*inputs, sens); grads = self.grad_reducer(grads)
        from autopar.ops.composite import GradOperation

        self.grad = GradOperation(get_by_list=True, sens_param=True)
        self.grad_reducer = DistributedGradReducer()

    @property
    def weights(self) -> tuple:
        """MindSpore's ``ParameterTuple`` of the optimizer's parameters (``weights.clone(prefix="accu_grads",
        init="zeros")`` makes the gradient-accumulation buffers)."""
        from autopar.common.tensor import ParameterTuple

        return ParameterTuple(p for group in self.optimizer.param_groups for p in group["params"])

    def construct(self, *inputs: Any) -> torch.Tensor:
        with torch.enable_grad():
            loss = self.network(*inputs)
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                raise TrainingError(f"TrainOneStepCell: the network must return a loss tensor that depends on the "
                                    f"parameters, got {getattr(loss, 'shape', type(loss).__name__)}")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward(torch.full_like(loss, self.sens))  # a loss per sample: MindSpore's sensitivity of ones
        self.optimizer.step()
        return loss.detach()


class DistributedGradReducer(Cell):
    """MindSpore's explicit gradient all-reduce for data-parallel custom loops. autopar's parameter hooks already
    reduced the gradients inside the backward, so this returns them unchanged (reducing again would count every
    rank's contribution twice)."""

    def __init__(self, parameters: Any = None, mean: bool | None = None, degree: int | None = None,
                 fusion_type: int = 1, group: Any = None):
        super().__init__()

    def construct(self, grads: Any) -> Any:
        return grads
