"""The cluster planner against published GPT training runs: predicted vs measured, side by side.

For each published run the planner predicts the run's own configuration (tensor, pipeline degrees, micro-batch where
published, full activation recomputation where used) on the machine preset of that cluster, and then searches freely
for the same model, devices and batch. Sources and every figure are cited in the rows below; rows marked [S] come from
a secondary transcription only.

    python bench/published_gpt.py [--out bench/results/published_gpt.json]

Pinned as each source ran it: the interleaved 1F1B schedule where a source gives its virtual stages (``VPP``); no
ZeRO and no sequence parallelism for Megatron-LM of 2021-2022; sequence parallelism, where a source does not say,
the faster of with and without (``plan_row``). Attention is planned as each source ran it (``ATTENTION``): the scores materialized, or
one fused kernel. Table 1 counts recomputation's FLOPs (its Eq. 3), so those rows compare TFLOP/s on that basis.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from autopar.errors import ConfigError
from autopar.planner.cluster import load_cluster, plan_gpt
from autopar.planner.gpt import GPTConfig

MEGATRON_2021 = "Narayanan et al. 2021, arXiv 2104.04473, Table 1 (Selene, interleaved 1F1B, full recomputation)"
KORTHIKANTI = "Korthikanti et al. 2022, arXiv 2205.05198, Tables 3 and 5 [S] (full recomputation column)"
ZERO3 = "Narayanan et al. 2021, arXiv 2104.04473, Table 2: ZeRO-3 (DeepSpeed) without model parallelism"
DGXC = ("NVIDIA dgxc-benchmarking README_175b (github.com/NVIDIA/dgxc-benchmarking, 0b71cfd), NeMo GPT-3 175B "
        "BF16, TP4 PP8 VP12 MBS1")

# How each source's runs computed attention: Megatron-LM and DeepSpeed of 2021-2022 kept the scores (a fused
# softmax kernel, no FlashAttention); NeMo on H100 (2024) runs Transformer Engine's fused attention.
ATTENTION = {MEGATRON_2021: "materialized", KORTHIKANTI: "materialized", ZERO3: "materialized", DGXC: "fused"}
# Virtual stages per device (interleaved 1F1B) where the source gives them: NeMo's VP12; the others are planned with
# plain 1F1B, as before the planner had interleaving (their tables do not give v per run).
VPP = {MEGATRON_2021: 1, KORTHIKANTI: 1, ZERO3: 1, DGXC: 12}

# (name, source, layers, hidden, heads, gpus, batch, tp, pp, micro-batch or None, recompute, machine,
#  published: {"tflops_per_gpu": .. counting recomputation} or {"step_s": ..})
RUNS = [
    ("1.7B", MEGATRON_2021, 24, 2304, 24, 32, 512, 1, 1, None, True, "a100-ib", {"tflops_per_gpu": 137}),
    ("3.6B", MEGATRON_2021, 30, 3072, 32, 64, 512, 2, 1, None, True, "a100-ib", {"tflops_per_gpu": 138}),
    ("7.5B", MEGATRON_2021, 36, 4096, 32, 128, 512, 4, 1, None, True, "a100-ib", {"tflops_per_gpu": 142}),
    ("18.4B", MEGATRON_2021, 40, 6144, 48, 256, 1024, 8, 1, None, True, "a100-ib", {"tflops_per_gpu": 135}),
    ("39.1B", MEGATRON_2021, 48, 8192, 64, 512, 1536, 8, 2, None, True, "a100-ib", {"tflops_per_gpu": 138}),
    ("76.1B", MEGATRON_2021, 60, 10240, 80, 1024, 1792, 8, 4, None, True, "a100-ib", {"tflops_per_gpu": 140}),
    ("145.6B", MEGATRON_2021, 80, 12288, 96, 1536, 2304, 8, 8, None, True, "a100-ib", {"tflops_per_gpu": 148}),
    ("310.1B", MEGATRON_2021, 96, 16384, 128, 1920, 2160, 8, 16, None, True, "a100-ib", {"tflops_per_gpu": 155}),
    ("529.6B", MEGATRON_2021, 105, 20480, 128, 2520, 2520, 8, 35, None, True, "a100-ib", {"tflops_per_gpu": 163}),
    ("1008B", MEGATRON_2021, 128, 25600, 160, 3072, 3072, 8, 64, None, True, "a100-ib", {"tflops_per_gpu": 163}),
    ("22B", KORTHIKANTI, 48, 6144, 64, 8, 4, 8, 1, 4, True, "a100-ib", {"step_s": 1.42}),
    ("175B", KORTHIKANTI, 96, 12288, 96, 64, 64, 8, 8, 1, True, "a100-ib", {"step_s": 18.13}),
    ("530B", KORTHIKANTI, 105, 20480, 128, 280, 280, 8, 35, 1, True, "a100-ib", {"step_s": 49.05}),
    ("1T", KORTHIKANTI, 128, 25600, 160, 512, 512, 8, 64, 1, True, "a100-ib", {"step_s": 94.42}),
    ("175B ZeRO-3", ZERO3, 96, 12288, 96, 384, 1536, 1, 1, 4, True, "a100-ib", {"tflops_per_gpu": 144}),
    ("175B ZeRO-3", ZERO3, 96, 12288, 96, 768, 1536, 1, 1, 2, True, "a100-ib", {"tflops_per_gpu": 88}),
    ("175B ZeRO-3", ZERO3, 96, 12288, 96, 1536, 1536, 1, 1, 1, True, "a100-ib", {"tflops_per_gpu": 44}),
    ("175B", DGXC, 96, 12288, 96, 128, 256, 4, 8, 1, None, "h100-ib", {"step_s": 8.309}),
    ("175B", DGXC, 96, 12288, 96, 1024, 2048, 4, 8, 1, None, "h100-ib", {"step_s": 8.453}),
]


def grand_teton(spec):
    """Meta's Grand Teton H100, which torchtitan's H100 tables ran on, from the ``h100-ib`` preset: "96GB HBM2e with
    2.4 TB/sec peak memory bandwidth", "the default 500W power limit" (pytorch/torchtitan
    benchmarks/llama3_h100_202412_torchtitan.md, 'Hardware'), and, its footnote 2, "HBM2e-based SXM H100 with lower
    TDP, the actual peak TFLOPs number is between SXM and NVL, and we don't know its exact value". The peak is taken
    midway between the two datasheets' dense figures -- H100 SXM 989.4 TFLOPS bf16, H100 NVL 835.5 (1,671 with
    sparsity; NVIDIA H100 datasheet), fp8 twice each -- so 0.922 x the preset's in every dtype, +-8.4 % to either
    end; the kernels' fractions of peak are the preset's."""
    scale = (989.4 + 835.5) / 2 / 989.4
    return dataclasses.replace(spec, name="h100-grand-teton", device_name="H100-SXM-96GB-HBM2e at 500 W",
                               flops={k: v * scale for k, v in spec.flops.items()}, memory=96 * 2.0**30,
                               memory_bandwidth=2.4e12)


def plan_row(cfg, spec, gpus, batch, pins, dtype):
    """The pinned plan. Context parallelism, where the source leaves it unstated, is off: a source whose run split
    the sequence says so (the planner would search it for a long sequence). Sequence parallelism, where unstated and
    there is a tensor group, is the faster of with and without -- also beside a pinned context split, which the
    planner's own search leaves without it (autopar's runtime does not run the two together)."""
    pins = {"cp": 1, **pins}
    options = [{}] if "sp" in pins or pins.get("tp", 1) == 1 else [{"sp": False}, {"sp": True}]
    best = None
    for extra in options:
        try:
            plan = plan_gpt(cfg, spec, gpus, batch, dtype, fixed={**pins, **extra})
        except ConfigError:
            continue
        if best is None or plan.best.step < best.best.step:
            best = plan
    if best is None:  # the planner's own line says why
        plan_gpt(cfg, spec, gpus, batch, dtype, fixed={**pins, **options[-1]})
    return best


def predicted(plan, metric: str) -> float:
    """The plan's figure in a source's unit: a step time, tokens/s a GPU, model TFLOP/s a GPU or MFU."""
    d = plan.to_dict()
    return {"step_s": d["step_s"], "tokens_per_s_per_gpu": d["tokens_per_s_per_device"],
            "tflops_per_gpu": d["model_tflops_per_device"], "model_tflops_per_gpu": d["model_tflops_per_device"],
            "mfu": d["mfu"]}[metric]


def ordered_pairs(runs: list[dict], published: str, predicted: str):
    """Each pair of ``runs`` whose ``published`` speeds differ by more than 10 %, as (faster published, slower
    published, whether the ``predicted`` speeds order them the same way) -- the one ordering rule every bench uses."""
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            pa, pb = a[published], b[published]
            if abs(pa - pb) / min(pa, pb) <= 0.10:
                continue
            fast, slow = (a, b) if pa > pb else (b, a)
            yield fast, slow, fast[predicted] > slow[predicted]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    rows = []
    for name, source, layers, hidden, heads, gpus, batch, tp, pp, micro, recompute, machine, published in RUNS:
        start = time.perf_counter()
        cfg = GPTConfig(layers, hidden, heads, attention=ATTENTION[source])
        spec = load_cluster(machine)
        fixed = {"tp": tp, "pp": pp, "micro_batch": micro, "recompute": recompute, "vpp": VPP[source]}
        if source == ZERO3:
            fixed["zero"] = 3
        elif source in (MEGATRON_2021, KORTHIKANTI):  # Megatron-LM of 2021-2022: no ZeRO, no sequence parallelism
            fixed.update(zero=0, sp=False)
        pinned = plan_row(cfg, spec, gpus, batch, fixed, "bf16")
        free = plan_gpt(cfg, spec, gpus, batch)
        c, f = pinned.best, free.best
        row = {"model": name, "source": source, "machine": machine, "gpus": gpus, "global_batch": batch,
               "published_config": {"tp": tp, "pp": pp, "dp": gpus // (tp * pp), "micro_batch": micro},
               "predicted_config": {"micro_batch": c.b, "zero": c.zero, "recompute": c.recompute,
                                    "attention": cfg.attention, "vpp": c.v, "sp": c.sp},
               "predicted_step_s": round(c.step, 3), "predicted_mfu": round(pinned.mfu(), 3),
               "predicted_tflops_per_gpu_with_recompute": round(pinned.tflops_per_device(with_recompute=True), 1),
               "free_search": {"mesh": f.mesh(), "micro_batch": f.b, "zero": f.zero, "recompute": f.recompute,
                               "step_s": round(f.step, 3), "mfu": round(free.mfu(), 3)},
               "plan_seconds": round(time.perf_counter() - start, 2)}
        if "tflops_per_gpu" in published:
            pub = published["tflops_per_gpu"]
            row["published_tflops_per_gpu"] = pub
            row["error_pct"] = round(100 * (row["predicted_tflops_per_gpu_with_recompute"] - pub) / pub, 1)
        else:
            pub = published["step_s"]
            row["published_step_s"] = pub
            row["error_pct"] = round(100 * (c.step - pub) / pub, 1)
        rows.append(row)
        print(f"[bench] {name} on {gpus} ({machine}): error {row['error_pct']:+.1f}%", file=sys.stderr, flush=True)
    errors = sorted(abs(r["error_pct"]) for r in rows)
    out = {"rows": rows, "summary": {"runs": len(rows), "median_abs_error_pct": errors[len(errors) // 2],
                                     "max_abs_error_pct": errors[-1]}}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(table(rows), file=sys.stderr)


def table(rows: list[dict]) -> str:
    """The markdown table of docs/performance.md."""
    lines = ["| model | GPUs | batch | published (t, p, d) | published | predicted | error | planner's own choice |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pc, f = r["published_config"], r["free_search"]
        if "published_tflops_per_gpu" in r:
            pub, pred = f"{r['published_tflops_per_gpu']} TFLOP/s", f"{r['predicted_tflops_per_gpu_with_recompute']} TFLOP/s"
        else:
            pub, pred = f"{r['published_step_s']} s/step", f"{r['predicted_step_s']} s/step"
        lines.append(f"| {r['model']} ({r['machine']}) | {r['gpus']} | {r['global_batch']} | "
                     f"({pc['tp']}, {pc['pp']}, {pc['dp']}) | {pub} | {pred} | {r['error_pct']:+.1f}% | "
                     f"{f['mesh']}, micro {f['micro_batch']}, ZeRO {f['zero']}, MFU {f['mfu']:.0%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
