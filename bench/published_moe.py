"""The cluster planner against published mixture-of-experts training runs (``bench/published/moe_runs.json``).

The 68 runs were collected before the planner had any model of a mixture of experts, and split by source into a
``tune`` and a ``test`` set before any was planned (``bench/published/moe_runs.md``). Each row is planned as its
source states it; what a source leaves unstated is searched, as a user knowing only what was published would:

- the model: the planner's preset of the same architecture at the row's sequence (Qwen3-30B-A3B, Qwen3-235B-A22B,
  Mixtral 8x7B / 8x22B, DeepSeek-V3, Kimi K2, Moonlight-16B-A3B, GPT-OSS-120B / 20B). Architectures the planner
  has no model of -- Mamba or linear-attention hybrids (Nemotron 3, Qwen3-Next) -- are listed with the reason, not
  planned;
- ``tp``, ``pp``, ``vpp``, ``cp``, ``ep``, the micro-batch as given; ZeRO 3 where the row runs FSDP, else searched;
  ``--recompute full`` / ``none`` where stated, the rest (Megatron's per-module recomputation of norms and
  activations) searched;
- the dtype: fp8 for FP8 rows (the recipe -- current, delayed, blockwise scaling -- is not modelled apart), bf16
  otherwise and where unstated;
- the dispatcher: ``deepep`` where the row names DeepEP, HybridEP or Megatron's ``flex`` dispatcher, ``alltoall``
  where it names an all-to-all (the name before any parenthesised explanation), else what the row's notes read from the source's recipe, else ``alltoall`` (the all-to-all
  dispatcher Megatron's MoE guide recommends with expert parallelism); ``--ep-overlap`` where the row or its notes
  say the expert-parallel all-to-all overlap is on;
- the machine: ``h100-ib`` (DGX H100, 8 a node) at the row's GPU count;
- the global batch as given, or torchtitan's local batch times its data-parallel sharding degree;
- the unit: tokens/s a GPU where the source gives it, else step time. Rows with only TFLOP/s (each framework counts
  a mixture's FLOPs its own way: ``moe_runs.md``) or without a batch, a sequence or a GPU count are listed, not
  planned. Where the layers alone cannot fill a row's pipeline chunks but with the embedding and the loss they do
  (94 layers over 32 stages x 3), those take a layer's place, the only split Megatron-Core runs there. Rows measured
  with natural routing (not force-balanced; the planner assumes balance) are marked
  ``natural_routing`` and kept in the statistics.

    python bench/published_moe.py [--set tune|test|all] [--out bench/results/published_moe.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from pathlib import Path

from published_gpt import predicted  # bench/ is the script's own folder
from published_runs import planned_rows, stats, summaries

from autopar.errors import ConfigError
from autopar.planner.cluster import load_cluster, plan_gpt
from autopar.planner.gpt import PRESETS

RUNS = Path(__file__).parent / "published" / "moe_runs.json"
ARCHITECTURES = {"Qwen3-30B-A3B": "qwen3-30b-a3b", "Qwen3-235B-A22B": "qwen3-235b-a22b",
                 "Mixtral 8x7B": "mixtral-8x7b", "Mixtral 8x22B": "mixtral-8x22b",
                 "DeepSeek-V3 (671B total / 37B active)": "deepseek-v3", "Kimi K2 (1T total)": "kimi-k2",
                 "Moonlight-16B-A3B (DeepSeek-V3-style)": "moonlight-16b-a3b", "GPT-OSS-120B": "gpt-oss-120b",
                 "GPT-OSS-20B": "gpt-oss-20b"}


def not_modelled(model: dict) -> str:
    """Why the planner has no model of this architecture ('' where it has)."""
    if model["name"] in ARCHITECTURES:
        return ""
    if model.get("layers") is None:
        return "the source gives no architecture"
    attention = str(model.get("attention", ""))
    if "hybrid" in attention or "Mamba" in model["name"] or "hybrid" in model["name"]:
        return "a Mamba / linear-attention hybrid is not modelled"
    return "this architecture is not modelled"


def _says(row: dict, *words: str) -> bool:
    text = " ".join(str(row["config"].get(k) or "") for k in ("dispatcher", "other")) + " " + (row.get("notes") or "")
    return any(w.lower() in text.lower() for w in words)


def dispatcher(row: dict) -> str:
    # the name the row gives, before any explanation in parentheses ("standard EP all-to-all (inferred: 'Before' =
    # without the DeepEP backend ...)" names the all-to-all)
    named = str(row["config"].get("dispatcher") or "").split("(")[0]
    if any(w in named for w in ("DeepEP", "HybridEP", "flex")):
        return "deepep"
    if any(w in named.lower() for w in ("alltoall", "all-to-all")):
        return "alltoall"
    return "deepep" if _says(row, "HybridEP dispatcher", "DeepEP dispatcher", "flex+HybridEP") else "alltoall"


def ep_overlap(row: dict) -> bool:
    other = str(row["config"].get("other") or "").lower()
    if "overlap off" in other or "= false" in other:
        return False
    return _says(row, "overlap on", "overlap_moe_expert_parallel_comm) = True", "+1f1b overlap",
                 "moe_a2a_overlap True")


def pins(row: dict) -> dict:
    c = row["config"]
    out = {k: c[k] for k in ("tp", "pp", "cp", "ep") if c.get(k) is not None}
    if c.get("vpp") is not None:
        out["vpp"] = c["vpp"]
    if c.get("mbs") is not None:
        out["micro_batch"] = c["mbs"]
    if c.get("fsdp") not in (None, 0, "0"):
        out["zero"] = 3
    recompute = str(c.get("recompute") or "").lower()
    if recompute.startswith("full"):
        out["recompute"] = True
    elif recompute.startswith("none"):
        out["recompute"] = False
    out["cp"] = out.get("cp", 1)
    layers, chunks = row["model"].get("layers") or 0, (out.get("pp") or 1) * (out.get("vpp") or 1)
    if out.get("pp", 1) > 1 and layers < chunks <= layers + 2:
        # the layers alone cannot fill the stages' chunks (Qwen3-235B's 94 over 32 x 3): Megatron-Core runs such a
        # split only with the embedding and the loss each in a layer's place (--account-for-embedding-in-pipeline-
        # split / --account-for-loss-in-pipeline-split), so the run did
        out["split_embedding"] = True
    out["dispatcher"] = dispatcher(row)
    if ep_overlap(row):
        out["ep_overlap"] = True
    return out


def unit(row: dict) -> tuple[str, float] | None:
    m = row["measured"]
    if m.get("tokens_per_s_per_gpu"):
        return "tokens_per_s_per_gpu", float(m["tokens_per_s_per_gpu"])
    if m.get("step_time_s"):
        return "step_s", float(m["step_time_s"])
    return None


def global_batch(row: dict) -> int | None:
    """The row's global batch: as given, or torchtitan's local batch a data-parallel rank times its sharding degree
    ("local_batch_size=16", "dp_shard 64": torchtitan's ``local_batch_size`` is a data-parallel rank's batch)."""
    c = row["config"]
    if c.get("gbs"):
        return c["gbs"]
    local = re.search(r"local_batch_size=(\d+)", str(c.get("other") or ""))
    shard = re.search(r"dp_shard (\d+)", str(c.get("other") or ""))
    return int(local[1]) * int(shard[1]) if local and shard else None


def plan_one(row: dict) -> dict:
    c, gpus = dict(row["config"]), row["cluster"]["num_gpus"]
    c["gbs"] = global_batch(row)
    out = {"name": row["run"], "set": row["set"], "gpus": gpus, "natural_routing": c.get("forced_load_balance") is False,
           "group": None}
    why = not_modelled(row["model"])
    metric = unit(row)
    if not why and not str(row["cluster"]["gpu"]).startswith("H100"):
        why = f"no preset of the {row['cluster']['gpu']}"
    if not why and metric is None:
        why = ("the source gives only TFLOP/s, counted its own way" if row["measured"].get("model_tflops_per_gpu")
               or row["measured"].get("mfu") else "the source gives no step time or throughput")
    if not why and (not gpus or not c.get("gbs") or not c.get("seq_len")):
        why = "the source gives no " + ", ".join(w for w, v in (("GPU count", gpus), ("global batch", c.get("gbs")),
                                                                 ("sequence", c.get("seq_len"))) if not v)
    if why:
        out.update(planned=False, error=why)
        return out
    dtype = "fp8" if str(c.get("dtype") or "").upper().startswith("FP8") else "bf16"
    cfg = dataclasses.replace(PRESETS[ARCHITECTURES[row["model"]["name"]]], seq=c["seq_len"])
    fixed = pins(row)
    if dtype == "fp8":  # Transformer Engine's delayed scaling, its current (per-tensor) scaling where the row says CS
        fixed["fp8_recipe"] = "tensorwise" if str(c.get("dtype")).upper().endswith("CS") else "delayed"
    out.update(metric=metric[0], value=metric[1], pins=fixed, dtype=dtype, global_batch=c["gbs"],
               group=f"{row['model']['name']} x {gpus} gbs {c['gbs']} seq {c['seq_len']} {dtype}")
    start = time.perf_counter()
    try:
        plan = plan_gpt(cfg, load_cluster("h100-ib"), gpus, c["gbs"], dtype, fixed=fixed)
    except ConfigError as e:
        out.update(planned=False, error=str(e))
        return out
    guess = predicted(plan, metric[0])
    b = plan.best
    speed = (lambda v: v) if metric[0] != "step_s" else (lambda v: c["gbs"] * c["seq_len"] / v / gpus)  # noqa: E731
    out.update(planned=True, predicted=guess, error_pct=100 * (guess - metric[1]) / metric[1], step_s=b.step,
               plan=f"{b.mesh()}, micro {b.b}, ZeRO {b.zero}, recompute {b.recompute_name}",
               memory_gib=b.memory / 2**30, tight=plan.tight, parts={k: round(v, 4) for k, v in b.parts.items()},
               dispatch_ms=plan.planner.layer(b.t, b.b, b.cp, b.sp, b.ep).dispatch * 1e3,
               speed_published=speed(metric[1]), speed_predicted=speed(guess),
               fast_pct=100 * (speed(guess) / speed(metric[1]) - 1), plan_s=time.perf_counter() - start)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", default="tune", choices=("tune", "test", "all"))
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    runs = [r for r in json.loads(RUNS.read_text()) if args.set == "all" or r["set"] == args.set]
    rows = planned_rows(runs, plan_one)
    summary = summaries(rows, lambda name: name.split("-")[0], lambda part: {
        "balanced_routing": stats([r for r in part if not r["natural_routing"]])})
    text = json.dumps({"rows": rows, "summary": summary}, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
