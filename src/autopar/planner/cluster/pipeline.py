"""Pipeline schedules: 1F1B and interleaved 1F1B, their bubble, their messages and the micro-batches in flight.

1F1B over ``p`` stages and ``m`` micro-batches takes (m + p - 1) x the slowest stage's micro-batch time, so the bubble
is (p - 1) / (m + p - 1); interleaved with ``v`` virtual stages a device holds v chunks of layers, the warm-up and
drain shrink to (p - 1) chunks and every micro-batch crosses v times as many stage boundaries (Narayanan et al. 2021,
arXiv 2104.04473 sec. 2.2.2); the first stage keeps ``min(p, m)`` micro-batches in flight, interleaved Megatron-LM's
1 + (p - 1) / (p v) times p (``interleaved_schedule_memory_penalty``, megatron/training/theoretical_memory_usage.py).
"""
from __future__ import annotations

import math


def schedule_seconds(m: int, p: int, v: int, layers: int, micro: float, p2p: float) -> float:
    """A step's pipeline: ``m`` micro-batches of ``micro`` seconds a stage, the warm-up and drain of (p - 1) chunks
    -- of ceil(layers / (p v)) layers where the layers do not divide into p v chunks -- and the point-to-point
    messages, ``p2p`` seconds each, v times as many interleaved."""
    per_stage = math.ceil(layers / p)
    chunk = micro * math.ceil(layers / (p * v)) / per_stage if v > 1 else micro
    return m * micro + (p - 1) * chunk + (m * v + p - 1) * p2p


def in_flight(p: int, m: int, v: int) -> int:
    """Micro-batches whose activations the first stage keeps at once."""
    return min(p, m) if v == 1 else math.ceil((1 + (p - 1) / (p * v)) * p)


def virtual_stages(layers: int, p: int, m: int, pinned: int | None) -> list[int]:
    """The interleaving degrees a pipeline of ``p`` stages and ``m`` micro-batches can run: the interleaved schedule
    needs the micro-batches a multiple of p (Megatron-LM's) and at least one layer a chunk; chunks may be uneven
    (126 layers over 16 stages, as Llama 3 ran them: some a layer shorter, torchtitan's splits)."""
    if pinned is not None:
        return [pinned] if pinned == 1 or (p > 1 and layers >= p * pinned and m % p == 0) else []
    if p == 1 or m % p:
        return [1]
    # the usual degrees, and those that cut a stage's layers into equal chunks (80 layers on 4 stages: 5, 10, 20 --
    # the 5 NeMo's and dgxc's Llama 70B recipes run)
    per_stage = layers // p
    even = {v for v in range(2, min(per_stage, 24) + 1) if per_stage % v == 0}
    return sorted(v for v in {1, 2, 3, 4, 6, 8, 12, 16} | even if layers >= p * v)


def stage_sizes(layers: int, parts: int) -> str:
    """``12`` where the layers divide evenly, ``7-8`` where some parts are a layer shorter."""
    low, high = layers // parts, math.ceil(layers / parts)
    return str(high) if low == high else f"{low}-{high}"


