"""The cluster planner against published runs collected in 2026-12 (``bench/published/runs.json``), in two sets.

``bench/published_gpt.py`` and ``bench/published_heldout.py`` hold the runs earlier sessions built and checked the
model on. The runs here were collected afterwards from sources neither of them uses, and split by source before any
was planned:

- ``tune``: the runs a modelling change may be checked against while it is made (dgxc-benchmarking, NeMo's and
  Megatron-Bridge's tables, the NeMo-Megatron launcher, llm-foundry (a stratified sample of its ~220 rows), the
  Ultra-Scale Playbook, Korthikanti et al., IBM's FSDP blog, GPT-NeoX);
- ``test``: runs planned only once the model was fixed, reported apart -- BLOOM (4 x 100 Gb/s a node), MegaScale,
  MT-NLG, OPT, GLM, BloombergGPT, torchtitan, KempnerForge (H200), NeMo 24.07, the Nemotron-4 15B report.

Each row is pinned as its source states it (tensor, pipeline, virtual stages, context, micro-batch, ZeRO level,
recomputation, sequence parallelism), its tensor-parallel collectives hidden as its stack hides them
(``tp_overlap``); what a source leaves unstated is searched, and sequence parallelism, where
unstated under a tensor group, is the faster of with and without (as ``published_gpt.plan_row``). The machine is the
preset of the GPU (``h100-ib``, ``h200-ib``, ``a100-ib``; A100 40 GB with its memory and bandwidth), with the node's
network where the source states one unlike the preset's. Every row carries its source, the quoted figures and what
was read into it (``assumptions``).

    python bench/published_runs.py [--set tune|test|all] [--out bench/results/published_runs.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from published_gpt import grand_teton, ordered_pairs, plan_row, predicted  # bench/ is the script's own folder

from autopar.errors import ConfigError
from autopar.planner.cluster import load_cluster, plan_gpt
from autopar.planner.gpt import GPTConfig

RUNS = Path(__file__).parent / "published" / "runs.json"
PRESET = {"h100": "h100-ib", "h200": "h200-ib", "a100-80": "a100-ib", "a100-40": "a100-ib"}
# A100-SXM4-40GB: 40 GB HBM2 at 1,555 GB/s (NVIDIA A100 datasheet), otherwise the A100-SXM4-80GB of the preset
A100_40GB = {"memory": 40 * 2.0**30, "memory_bandwidth": 1555e9}


def machine(row: dict):
    """The row's cluster: its GPU's preset, its memory where the source gives another, its node's network where the
    source states one unlike the preset's, as many nodes as the run used."""
    spec = load_cluster(PRESET[row["gpu"]])
    if row["gpu"] == "a100-40":
        spec = dataclasses.replace(spec, name="a100-40gb", device_name="A100-SXM4-40GB", **A100_40GB)
    if row["gpu"] == "h100" and row.get("power_limit_w") == 500:  # torchtitan's (published_gpt.grand_teton)
        spec = grand_teton(spec)
    if row.get("memory_gib"):
        spec = dataclasses.replace(spec, memory=row["memory_gib"] * 2.0**30)
    if row.get("gpus_per_node", 8) != spec.devices_per_node:
        spec = dataclasses.replace(spec, devices_per_node=row["gpus_per_node"])
    net = row.get("network")
    if net:
        spec = dataclasses.replace(spec, nics_per_node=net["nics_per_node"], inter=dataclasses.replace(
            spec.inter, bandwidth=net["nic_gbps"] / 8 * 1e9))
    return spec.for_devices(row["gpus"])


def config(row: dict) -> GPTConfig:
    m = row["model"]
    return GPTConfig(m["layers"], m["hidden"], m["heads"], seq=m["seq"], vocab=m["vocab"], ffn=m["ffn"],
                     kv_heads=m["kv_heads"], family=m["family"], attention=row["attention"])


# Stacks whose tensor-parallel linears all-reduce the input's gradient synchronously in the backward -- Megatron-LM's
# ``copy_to_tensor_model_parallel_region`` of before its asynchronous all-reduce (2021-09), which the Megatron-DeepSpeed
# forks (bigscience-workshop/Megatron-DeepSpeed ``megatron/mpu/layers.py``, ``ColumnParallelLinear.forward``) and
# GPT-NeoX (EleutherAI/gpt-neox ``megatron/mpu/layers.py``: ``copy_to_model_parallel_region``) kept
SYNCHRONOUS_TP = ("Megatron-DeepSpeed", "GPT-NeoX")


def tp_overlap(row: dict) -> str:
    """How the row's stack hides its tensor-parallel collectives (``--tp-overlap``): PyTorch's DTensor tensor
    parallelism (torchtitan, KempnerForge), each collective waited on where autograd issues it, ``none`` -- but
    where the run says it ran async TP (torchtitan's ``enable_async_tensor_parallel``), which the planner reads as
    Megatron-Core's overlap (``cluster/tensor.py``), as it does for the Megatron family."""
    if any(stack in row.get("framework", "") for stack in SYNCHRONOUS_TP):
        return "none"
    note = row.get("metric_note", "").lower()  # "Vanilla TP tokens/sec column.", "... AsyncTP on."
    name = row["name"].lower().replace("torchtitan-asynctp-", "")  # (the async-TP table's own name aside)
    if "DTensor" not in row.get("framework", "") or (
            "vanilla tp" not in note and ("async tp" in note or "asynctp on" in note or "asynctp" in name)):
        return "megatron"
    return "none"


def fp8_recipe(row: dict) -> str | None:
    """How the row's fp8 projections are scaled (``--fp8-recipe``): torchao's float8 where the stack is torchtitan's
    (``rowwise`` where the row says so, else its default ``tensorwise``), Transformer Engine's default ``delayed``
    for every other stack (Megatron-Core, NeMo, llm-foundry's ``amp_fp8``; the JAX stacks' fp8 also keeps an amax
    history); None for a row not in fp8."""
    if row["dtype"] != "fp8":
        return None
    if "torchtitan" not in row.get("framework", ""):
        return "delayed"
    return "rowwise" if "rowwise" in row["name"].lower() else "tensorwise"


def speed(metric: str, value: float, row: dict) -> float:
    """A per-device figure that is higher when faster (a step time becomes tokens/s a device), to order runs by."""
    if metric != "step_s":
        return value
    return row["global_batch"] * row["model"]["seq"] / value / row["gpus"]


def plan_one(row: dict) -> dict:
    out = {k: row[k] for k in ("name", "set", "gpus", "gpu", "global_batch", "pins", "dtype", "metric", "value")}
    start = time.perf_counter()
    try:
        pins = {**row["pins"], "tp_overlap": tp_overlap(row), "fp8_recipe": fp8_recipe(row)}
        plan = plan_row(config(row), machine(row), row["gpus"], row["global_batch"], pins, row["dtype"])
    except ConfigError as e:
        out.update(planned=False, error=str(e))
        return out
    guess = predicted(plan, row["metric"])
    c = plan.best
    out.update(planned=True, predicted=guess, error_pct=100 * (guess - row["value"]) / row["value"],
               step_s=c.step, plan=f"{c.mesh()}, micro {c.b}, ZeRO {c.zero}, recompute {c.recompute_name}",
               memory_gib=c.memory / 2**30, tight=plan.tight, parts={k: round(v, 4) for k, v in c.parts.items()},
               speed_published=speed(row["metric"], row["value"], row),
               speed_predicted=speed(row["metric"], guess, row), group=row.get("group"),
               fast_pct=100 * (speed(row["metric"], guess, row) / speed(row["metric"], row["value"], row) - 1),
               plan_s=time.perf_counter() - start)
    if row.get("memory_gib_per_gpu"):
        out["memory_error_pct"] = 100 * (c.memory / 2**30 - row["memory_gib_per_gpu"]) / row["memory_gib_per_gpu"]
    return out


def stats(rows: list[dict]) -> dict:
    planned = [r for r in rows if r.get("planned")]
    e = sorted(abs(r["error_pct"]) for r in planned)
    if not e:
        return {"runs": len(rows), "planned": 0}
    fast = sorted(r["fast_pct"] for r in planned)
    return {"runs": len(rows), "planned": len(planned), "median_abs_error_pct": round(e[len(e) // 2], 1),
            "max_abs_error_pct": round(e[-1], 1), "within_10_pct": sum(x <= 10 for x in e),
            "within_25_pct": sum(x <= 25 for x in e), "median_too_fast_pct": round(fast[len(fast) // 2], 1)}


def ordering(rows: list[dict]) -> dict:
    """Pairs of one job (the source's ``group``: model, cluster, batch) published more than 10 % apart: how many the
    predictions order as measured."""
    groups = defaultdict(list)
    for r in rows:
        if r.get("planned") and r.get("group"):
            groups[r["group"]].append(r)
    pairs = [(fast, slow, same) for runs in groups.values()
             for fast, slow, same in ordered_pairs(runs, "speed_published", "speed_predicted")]
    return {"pairs_more_than_10_pct_apart": len(pairs), "ordered_right": sum(same for *_, same in pairs),
            "misordered": [(fast["name"], slow["name"]) for fast, slow, same in pairs if not same]}


def free_search(rows: list[dict], runs: dict) -> dict:
    """For each job published in several configurations (one ``group``, the same GPUs, global batch, dtype and
    stack): the planner's own pick, searched freely on the job's cluster with its stack's properties kept (its
    attention kernel, how it hides tensor-parallel collectives, its fp8 recipe), against the published
    configurations as the planner predicts them (``runs``: name -> run)."""
    jobs = defaultdict(list)
    for r in rows:
        if r.get("planned") and r.get("group"):
            run = runs[r["name"]]
            stack = (("tp_overlap", tp_overlap(run)), ("fp8_recipe", fp8_recipe(run)))
            jobs[(r["group"], r["gpus"], r["global_batch"], r["dtype"], stack)].append(r)
    out = []
    for (group, gpus, batch, dtype, stack), planned in sorted(jobs.items(), key=lambda kv: str(kv[0])):
        if len(planned) < 2:
            continue
        row = runs[planned[0]["name"]]
        stack = dict(stack)
        start = time.perf_counter()
        try:
            plan = plan_gpt(config(row), machine(row), gpus, batch, dtype, fixed=stack)
        except ConfigError as e:
            out.append({"group": group, "gpus": gpus, "error": str(e)})
            continue
        best = max(planned, key=lambda r: r["speed_published"])
        fastest = min(planned, key=lambda r: r["step_s"])
        c = plan.best
        out.append({"group": group, "gpus": gpus, "global_batch": batch, "dtype": dtype, **stack, "runs": len(planned),
                    "best_published": best["name"], "best_published_plan": best["plan"],
                    "best_published_predicted_step_s": round(best["step_s"], 3),
                    "fastest_pinned_predicted_step_s": round(fastest["step_s"], 3),
                    "pick": f"{c.mesh()}, micro {c.b}, ZeRO {c.zero}, recompute {c.recompute_name}",
                    "pick_step_s": round(c.step, 3), "pick_at_least_as_fast": c.step <= fastest["step_s"] * 1.0001,
                    "pick_not_run_by_autopar": plan.not_run(c), "search_s": round(time.perf_counter() - start, 1)})
    return {"free_search": out, "free_search_at_least_as_fast": sum(
        f.get("pick_at_least_as_fast", False) for f in out), "free_search_jobs": len(out)}


def source_of(name: str) -> str:
    return name.split("-")[0].split(" ")[0].lower()


def planned_rows(runs: list[dict], plan, quiet: bool = False) -> list[dict]:
    """Each run planned by ``plan(run)``, a line each on stderr (unless ``quiet``)."""
    rows = []
    for row in runs:
        r = plan(row)
        rows.append(r)
        if not quiet:
            print(f"[bench] {r['name']}: " + (f"published {r['value']:.4g}, predicted {r['predicted']:.4g} "
                                             f"({r['error_pct']:+.1f}%) {r['plan']}" if r["planned"]
                                             else f"not planned: {r['error']}"), file=sys.stderr, flush=True)
    return rows


def summaries(rows: list[dict], source=source_of, extra=None) -> dict:
    """Per set: the statistics, the same-job ordering, the statistics by source (``source(name)``), and
    ``extra(rows)``'s entries."""
    out = {}
    for name in sorted({r["set"] for r in rows}):
        part = [r for r in rows if r["set"] == name]
        by_source = defaultdict(list)
        for r in part:
            by_source[source(r["name"])].append(r)
        out[name] = {**stats(part), "ordering": ordering(part), **(extra(part) if extra else {}),
                     "by_source": {s: stats(v) for s, v in sorted(by_source.items())}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", default="tune", choices=("tune", "test", "all"))
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--quiet", action="store_true", help="no line per run")
    args = p.parse_args()
    runs = [r for r in json.loads(RUNS.read_text()) if args.set == "all" or r["set"] == args.set]
    rows = planned_rows(runs, plan_one, args.quiet)
    by_name = {r["name"]: r for r in runs}
    summary = summaries(rows, extra=lambda part: free_search(part, by_name))
    out = {"rows": rows, "summary": summary}
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
