"""Per-layer convolution timings by feature-map size: which CPU convolution engine wins where (prints JSON).

Why: autopar lowers convolutions with at most 4 output positions to a matrix multiply (``parallel/small_conv.py``,
``MAX_POSITIONS``), measured on ResNet-50 at 32x32 where the maps end at 2x2 and 1x1. This times every distinct
convolution of ResNet-50's stages at the map sizes the tutorial's 32x32 images give them (8x8, 4x4, 2x2, 1x1) and
two of 224x224's (14x14, 7x7), forward + backward (input and weight gradients), batch 32 on one thread, with:

- ``onednn``: torch's default CPU convolution (oneDNN);
- ``lowered``: autopar's unfold + GEMM form, forced at every size;
- ``native``: torch's own im2col convolution (``torch.backends.mkldnn`` off);
- ``onednn_channels_last``: oneDNN on channels-last tensors.

Variants alternate within each round; medians over rounds. ``best`` names the fastest per layer; the totals per map
size say whether a threshold other than 4 positions (or another engine) would pay.

    python bench/conv_maps.py [--rounds 3] [--batch 32] [--sizes 8 4 2 1 14 7]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

# ResNet-50's convolutions per stage: (in, out, kernel, stride) at the stage's output map; the first block's
# strided 3x3 and downsample take the map twice as large
STAGES = {  # stage -> (channels in the bottleneck, expansion output, input channels of the stage)
    "layer1": (64, 256, 64), "layer2": (128, 512, 256), "layer3": (256, 1024, 512), "layer4": (512, 2048, 1024)}
STAGE_OF_MAP_32 = {8: "layer1", 4: "layer2", 2: "layer3", 1: "layer4"}
STAGE_OF_MAP_224 = {56: "layer1", 28: "layer2", 14: "layer3", 7: "layer4"}


def layers(size: int) -> list[tuple[str, int, int, int, int, int]]:
    """(name, in, out, kernel, stride, input map) of the repeated block's convolutions at output map ``size``."""
    stage = STAGE_OF_MAP_32.get(size) or STAGE_OF_MAP_224[size]
    mid, out, _ = STAGES[stage]
    return [(f"{stage}.conv1x1_reduce", out, mid, 1, 1, size), (f"{stage}.conv3x3", mid, mid, 3, 1, size),
            (f"{stage}.conv1x1_expand", mid, out, 1, 1, size)]


def _lowered(x, w, stride, pad):
    from autopar.perf import small_conv

    limit, small_conv.MAX_POSITIONS = small_conv.MAX_POSITIONS, 1 << 30
    try:
        return small_conv.lowered_conv2d(x, w, None, (stride, stride), (pad, pad, pad, pad))
    finally:
        small_conv.MAX_POSITIONS = limit


def _time(variant: str, x: torch.Tensor, w: torch.Tensor, stride: int, pad: int, reps: int) -> float:
    if variant == "onednn_channels_last":
        x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()

    def once():
        if variant == "lowered":
            y = _lowered(x, w, stride, pad)
        elif variant == "native":
            with torch.backends.mkldnn.flags(enabled=False):
                y = F.conv2d(x, w, None, stride, pad)
        else:
            y = F.conv2d(x, w, None, stride, pad)
        with torch.backends.mkldnn.flags(enabled=variant != "native"):
            y.backward(torch.ones_like(y))

    once()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        once()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--sizes", type=int, nargs="*", default=[8, 4, 2, 1, 14, 7])
    args = p.parse_args()
    torch.set_num_threads(1)
    variants = ["onednn", "lowered", "native", "onednn_channels_last"]
    cases = [(size, *layer) for size in args.sizes for layer in layers(size)]
    runs: dict[tuple, dict[str, list[float]]] = {c: {v: [] for v in variants} for c in cases}
    for rnd in range(args.rounds):
        for case in cases:
            size, name, cin, cout, k, stride, _ = case
            g = torch.Generator().manual_seed(0)
            x = torch.randn(args.batch, cin, size, size, generator=g)
            w = torch.randn(cout, cin, k, k, generator=g) * 0.05
            for variant in variants:
                runs[case][variant].append(_time(variant, x, w, stride, k // 2, args.reps))
        print(f"[conv_maps] round {rnd + 1} done", file=sys.stderr, flush=True)
    report: dict = {"batch": args.batch, "threads": 1, "rounds": args.rounds, "layers": {}, "per_map_ms": {}}
    for case, by_variant in runs.items():
        size, name = case[0], case[1]
        ms = {v: round(1e3 * statistics.median(t), 2) for v, t in by_variant.items()}
        report["layers"][f"{name}@{size}x{size}"] = ms | {"best": min(ms, key=ms.get)}
        total = report["per_map_ms"].setdefault(f"{size}x{size}", dict.fromkeys(variants, 0.0))
        for v in variants:
            total[v] = round(total[v] + ms[v], 2)
    for total in report["per_map_ms"].values():
        total["best"] = min(variants, key=total.get)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
