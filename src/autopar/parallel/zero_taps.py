"""DATA_PARALLEL's gradient all-reduce without the kernel taps whose gradient is zero on every rank (a CPU default).

Why: on the tutorial's 32x32 images ResNet-50's last stage sees 2x2 and 1x1 maps, where most taps of a 3x3 kernel
only ever multiply padding. Their gradient is exactly zero (:mod:`autopar.parallel.small_conv` does not even compute
them), yet DDP all-reduces them: 22 MB of the 94 MB a step sends. On a CPU the all-reduce is CPU work (loopback
copies and sums) competing with the backward pass for the same cores, so bytes not sent are time saved.

Exact by construction, never by assumption: per bucket, each rank finds which taps of the candidate kernels hold a
non-zero gradient, and one small all-reduce (MAX) of those masks gives the taps live on *any* rank. Only those are
sent; a tap left out is zero on every rank, so its sum (and mean) is the zero already in the buffer. A user's own
term that touches every tap (say an L2 penalty in the loss) simply makes every tap live. Candidates are the weights
:mod:`small_conv` saw lowered with taps outside the input (the flag only saves the mask check elsewhere).

Everything else goes through unchanged: whole stretches of the bucket are all-reduced in place, divided by the world
size first for ``gradients_mean`` exactly as DDP's own hook does, so results are bit-identical to plain DDP.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

DEAD_TAPS_ATTR = "_autopar_dead_taps"


def mark_dead_taps(weight: torch.Tensor) -> None:
    """Called by small_conv when a forward left some of ``weight``'s taps outside the input."""
    if not getattr(weight, DEAD_TAPS_ATTR, False):
        try:
            setattr(weight, DEAD_TAPS_ATTR, True)
        except (AttributeError, RuntimeError):  # a tensor type that takes no attributes: never a candidate
            pass


def _offset(buffer: torch.Tensor, grad: torch.Tensor) -> int | None:
    """Where ``grad`` (a view into the bucket) starts in the flat buffer, or None if it is not a contiguous view."""
    if not grad.is_contiguous() or grad.dtype != buffer.dtype:
        return None
    start = grad.data_ptr() - buffer.data_ptr()
    if start < 0 or start % grad.element_size():
        return None
    start //= grad.element_size()
    return start if start + grad.numel() <= buffer.numel() else None


def make_hook(world_size: int, mean: bool):
    """A DDP communication hook: sum (``mean=False``, MindSpore's default) or mean of the gradients over ranks."""

    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        plan = _plan(buffer, bucket, group)
        tensors = [buffer[a:b] for a, b in plan.stretches] + [t for t, _, _ in plan.packed]
        futures = []
        for t in tensors:
            if mean:
                t.div_(world_size)
            futures.append(dist.all_reduce(t, group=group, async_op=True).get_future())

        def unpack(_):
            for packed, grad, taps in plan.packed:
                grad.view(grad.shape[0], grad.shape[1], -1)[:, :, taps] = packed
            return buffer

        return torch.futures.collect_all(futures).then(unpack)

    return hook


class _Plan:
    def __init__(self, stretches: list[tuple[int, int]], packed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        self.stretches = stretches  # [start, end) of the buffer all-reduced in place
        self.packed = packed  # (live taps copied out, the gradient view, their tap indices)


def _plan(buffer: torch.Tensor, bucket, group) -> _Plan:
    whole = _Plan([(0, buffer.numel())], [])
    candidates = []
    for param, grad in zip(bucket.parameters(), bucket.gradients()):
        if getattr(param, DEAD_TAPS_ATTR, False) and grad.dim() == 4 and grad.shape[2] * grad.shape[3] > 1:
            start = _offset(buffer, grad)
            if start is None:
                return whole
            candidates.append((start, grad))
    if not candidates:
        return whole
    candidates.sort(key=lambda c: c[0])
    # taps with a non-zero gradient on this rank, then on any rank (every rank has the same candidates: same bucket)
    local = torch.cat([grad.detach().abs().amax(dim=(0, 1)).ne(0).flatten().to(torch.int32)
                       for _, grad in candidates])
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    stretches, packed, cursor, at = [], [], 0, 0
    for start, grad in candidates:
        taps = grad.shape[2] * grad.shape[3]
        live = local[at:at + taps].nonzero().flatten()
        at += taps
        if live.numel() == taps:
            continue  # every tap live: it stays inside a stretch
        if start > cursor:
            stretches.append((cursor, start))
        cursor = start + grad.numel()
        if live.numel():
            packed.append((grad.view(grad.shape[0], grad.shape[1], -1)[:, :, live].contiguous(), grad, live))
    if cursor < buffer.numel():
        stretches.append((cursor, buffer.numel()))
    return _Plan(stretches, packed)
