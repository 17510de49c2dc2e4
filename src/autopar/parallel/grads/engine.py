"""The gradient seam: each trainable parameter of a parallelized network has exactly one engine that completes its
gradient, chosen once (:func:`autopar.parallel.api.attach`) from the parallel context.

Engines behind the seam:

- :class:`~autopar.parallel.grads.buckets.BucketReducer` -- replicated parameters (DATA_PARALLEL, HYBRID's ordinary
  ones): summed over the ranks a bucket at a time while the backward goes on, through shared memory when every rank
  is on this CPU host, else through the process group (gloo / NCCL);
- :class:`~autopar.parallel.grads.layouts.LayoutGrads` -- parameters laid out as DTensors and the replicated ones
  beside them (SEMI_AUTO / AUTO): each gradient redistributed to its parameter's placements inside the backward;
- :class:`~autopar.parallel.grads.layouts.LocalGrads` -- HYBRID's ``layerwise_parallel`` slices: the network's own
  collectives did the work, only ``gradients_mean`` is applied;
- :class:`~autopar.parallel.zero.fsdp.ShardedGrads` -- ZeRO: FSDP2's own reduce-scatter;
- a pipeline's replicas: :func:`~autopar.parallel.grads.buckets.reduce_now` over the stage's data-parallel group
  after the schedule ran.

Every engine is driven from the autograd graph (tensor hooks, post-accumulate hooks, a callback queued for the end
of the backward), never from "which loop is this": a plain torch loop, ``TrainOneStepCell``, ``value_and_grad`` and
``Model.train`` run the same engine and get the same numbers.
"""
from __future__ import annotations

import contextlib
from typing import Protocol, Sequence

import torch

from autopar.common.grad_owners import (  # noqa: F401  (the seam's registry, kept low in the house)
    accumulates,
    accumulator,
    backward_done,
    claim,
    complete,
    mark_backward_done,
    needs_backward,
    owner_of,
    release,
    returned_later,
    returns_deferred,
    unowned,
)


class GradientEngine(Protocol):
    """What every engine offers the training loops and the rest of autopar."""

    name: str

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backwards inside accumulate locally; the first backward outside completes the sum."""

    def complete_returned(self, params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor]
                          ) -> list[torch.Tensor]:
        """Gradients that ``torch.autograd.grad`` returned for ``params`` (not accumulated into ``.grad``) while
        :func:`returned_later` was on, completed now -- all together, as one collective where the engine can."""

    def close(self) -> None:
        """Remove every hook this engine put on parameters and modules."""
