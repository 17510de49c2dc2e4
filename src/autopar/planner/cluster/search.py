"""The mesh search: data x context x tensor x pipeline x ZeRO x recomputation on a cluster of nodes, for a model you
have not built.

One decoder layer is planned per (tensor degree ``t``, micro-batch ``b``) by the operator-level ILP (``layers.py``)
and reused for every layer. Around it the search enumerates:

- ``t``: a divisor of the devices per node (where NVLink is), or two nodes' worth -- costed on the network, so
  tensor parallelism leaves a node only if the cost model finds that faster;
- ``p`` pipeline stages, plain or interleaved 1F1B with ``v`` virtual stages (``pipeline.py``);
- ``d`` = N / (t cp p) data-parallel replicas, ranks in Megatron's order: tensor groups inside a node, then context,
  data, stages farthest apart;
- ZeRO level 0-3 over the data- and context-parallel ranks (pipelines take level 0/1, as Megatron's distributed
  optimizer, unless pinned higher; with a searched context split inside stages, over the data-parallel replicas,
  as autopar's runtime shards them);
- activation recomputation: none, selective (the attention core run again in the backward, Korthikanti et al.
  2022: a materialized attention drops its scores and their softmax; a fused one, where pinned, its log-sum-exp --
  searched only where there are scores to drop), block (the fewest layers of a device recomputed whole that fit)
  or full;
- sequence parallelism with and without, for every tensor group dividing the sequence;
- ``cp``: context parallelism for sequences of 8K tokens and more (:func:`context_options`), its ring attention
  costed in ``attention.py``.

What of a plan autopar's runtime does not run yet (possible where parts are pinned to predict another system's
run), the plan names: :meth:`Candidate.not_run_by_autopar`. The fastest plan
that fits the memory (``memory.py``) wins; the explanation lists it, its per-layer strategies and the runners-up.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from autopar.errors import ConfigError
from autopar.planner.cluster.collectives import data_parallel_sync
from autopar.planner.cluster.experts import DISPATCHERS
from autopar.planner.cluster.kernels import FP8_RECIPES
from autopar.planner.cluster.layers import DTYPES, LayerPlanner
from autopar.planner.cluster.memory import MEMORY_HEADROOM, weight_state_bytes
from autopar.planner.cluster.pipeline import in_flight, schedule_seconds, stage_sizes, virtual_stages
from autopar.planner.cluster.spec import ClusterSpec
from autopar.planner.cluster.tensor import OVERLAPS
from autopar.planner.gpt import GPTConfig

ADAM_TRAFFIC = 28  # bytes read + written per parameter by a fused mixed-precision Adam step


@dataclass
class Candidate:
    t: int
    p: int
    d: int
    b: int
    m: int  # micro-batches per step
    zero: int
    recompute: bool | str  # False, "selective", True (full) or "block" (full, ``recompute_layers`` of a device's)
    v: int = 1  # virtual stages per device (interleaved 1F1B); 1: plain 1F1B
    cp: int = 1  # context-parallel degree: the sequence split over cp ranks (ring attention)
    sp: bool = False  # sequence parallelism in the tensor group (norms, dropout, residuals split on the sequence)
    recompute_layers: int = 0  # "block": the layers of a device recomputed whole (Megatron's --recompute-method block)
    shard: int = 0  # ZeRO's shard group (hybrid sharding: replicated across the groups); 0: every replica
    # the embedding and the loss each take a layer's place in the pipeline split (Megatron-LM's
    # --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split, DeepSpeed's
    # --pp-partition-method 'type:transformer|embedding'): the first and last stages hold a layer fewer
    split_embedding: bool = False
    ep: int = 1  # expert-parallel degree: a mixture's experts over ep consecutive ranks (experts.py)
    step: float = 0.0
    memory: float = 0.0
    parts: dict = field(default_factory=dict)  # seconds by cause
    memory_parts: dict = field(default_factory=dict)  # bytes by cause

    @property
    def bubble(self) -> float:
        return (self.p - 1) / (self.v * self.m + self.p - 1)

    def mesh(self) -> str:
        return (f"dp {self.d}" + (f" x cp {self.cp}" if self.cp > 1 else "") + f" x tp {self.t}"
                + (" (sp)" if self.sp else "") + f" x pp {self.p}" + (f" (vpp {self.v})" if self.v > 1 else "")
                + (f", ep {self.ep}" if self.ep > 1 else ""))

    @property
    def expert_replicas(self) -> int:
        """The ranks holding the same experts (expert-data parallel): a stage's tensor x context x data ranks over
        the expert-parallel degree."""
        return self.t * self.cp * self.d // self.ep

    @property
    def shard_group(self) -> int:
        """How many ranks ZeRO shards over: the shard group, or every replica (data x context)."""
        return self.shard or self.d * self.cp

    def not_run_by_autopar(self) -> list[str]:
        """What of this plan autopar's runtime does not run yet. It runs sequence parallelism with tensor
        parallelism, and context parallelism with data parallel, ZeRO and tensor parallelism, not yet with sequence
        parallelism. Inside pipeline stages it runs tensor and sequence parallelism and context parallelism
        (``PipelineParallel(tp=..., tensor_parallel=..., cp=...)``) and ZeRO (each stage's optimizer sharded over
        its data-parallel replicas, replicated across a context group), alone or together -- Megatron-LM's usual
        plan -- not yet ZeRO over other shard groups there: Megatron's distributed optimizer shards over the data x
        context ranks, which a plan predicting a Megatron run with a pinned ``--cp`` keeps."""
        out = []
        if self.cp > 1 and self.sp:
            out.append("sequence parallelism with context parallelism")
        if self.ep > 1:  # autopar runs expert parallelism beside data parallel, ZeRO and tensor parallelism, and
            # inside pipeline stages over a stage's data-parallel replicas or groups of them, beside ZeRO and a
            # tensor split (sequence-parallel or not) or a context split of the stage
            staged = self.p > 1 and self.d % self.ep != 0
            out += [what for what, where in (
                ("expert parallelism inside pipeline stages over other than a stage's data-parallel replicas or "
                 "groups of them", staged),
                ("expert parallelism with context parallelism", self.cp > 1 and self.p == 1),
                ("sequence parallelism beside expert parallelism outside pipeline stages", self.sp and self.p == 1))
                if where]
        if self.p > 1 and self.zero >= 1 and self.cp > 1 and self.shard_group == self.d * self.cp:
            out.append(f"ZeRO-{self.zero} over the context group inside pipeline stages (autopar shards over the "
                       f"{self.d} data-parallel replicas)")
        elif self.p > 1 and self.zero >= 1 and self.shard_group not in (self.d, self.d * self.cp):
            out.append(f"ZeRO-{self.zero} over shard groups of {self.shard_group} inside pipeline stages")
        return out

    @property
    def recompute_name(self) -> str:
        return f"block {self.recompute_layers}" if self.recompute == "block" else recompute_name(self.recompute)

    def recomputed_fraction(self, layers: int) -> float:
        """The share of the layers whose forward runs twice (full: all; block: the layers recomputed of a device's)."""
        if self.recompute == "block":
            return min(1.0, self.recompute_layers / math.ceil(self.slots(layers) / self.p))
        return 1.0 if self.recompute is True else 0.0

    def slots(self, layers: int) -> int:
        """What the pipeline split divides: the layers, and with ``split_embedding`` the embedding and the loss."""
        return layers + (2 if self.split_embedding and self.p > 1 else 0)

    def stage_layers(self, layers: int) -> tuple[int, int, int]:
        """(first, middle, last) stage's decoder layers; middle 0 where no middle stage holds more than the first.
        Layers that do not divide into the stages leave the first and the last stage a layer lighter, the rest in
        the middle (Llama 3, arXiv 2407.21783 sec. 3.3.2: "we reduce one Transformer layer each from the first and
        the last stages"; Megatron-LM's --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers);
        with ``split_embedding`` the first and last stages give a layer's place to the embedding and the loss."""
        slots = self.slots(layers)
        per_stage, last_stage = math.ceil(slots / self.p), slots // self.p
        balanced = self.p > 2 and slots % self.p != 0 and slots - 2 * last_stage <= (self.p - 2) * per_stage
        first_stage = last_stage if balanced else per_stage
        if self.split_embedding and self.p > 1:
            return first_stage - 1, per_stage if self.p > 2 else 0, last_stage - 1
        return first_stage, per_stage if balanced else 0, last_stage


def _placement(c: Candidate, where: str) -> str:
    """Where each group of ``c``'s mesh lies, in Megatron's rank order (tensor innermost, then context, data,
    stages): only the groups of more than one rank."""
    def apart(n: int) -> str:
        return "on adjacent ranks" if n == 1 else f"{n} ranks apart"
    parts = [f"tensor groups {where}"] if c.t > 1 else []
    if c.cp > 1:
        parts.append(f"context-parallel groups {apart(c.t)}")
    if c.d > 1:
        parts.append(f"data-parallel groups {apart(c.t * c.cp)}")
    if c.p > 1:
        parts.append(f"stages {apart(c.t * c.cp * c.d)}")
    return ", ".join(parts) or "one device"


def recompute_name(recompute: bool | str) -> str:
    return {"selective": "selective", "block": "block"}.get(recompute) if isinstance(recompute, str) else \
        "full" if recompute else "off"


@dataclass
class MeshPlan:
    config: GPTConfig
    spec: ClusterSpec
    devices: int
    global_batch: int
    dtype: str
    best: Candidate
    ranked: list[Candidate]
    planner: "LayerPlanner"  # holds the module plans of every (tensor degree, micro-batch) it costed
    considered: int
    too_big: int
    seconds: float
    memory_limit: float
    # nothing fitted the search's headroom (memory.MEMORY_HEADROOM of the device), so the plans are those that fit the
    # device's whole memory: a published run may well have run there; the plan says it is tight
    tight: bool = False

    def not_run(self, c: Candidate) -> list[str]:
        """What of ``c`` autopar's runtime does not run (:meth:`Candidate.not_run_by_autopar`); Megatron-Core's
        overlap of the tensor group's backward collectives (autopar's layouts wait on each where autograd issues
        it, as PyTorch's DTensor tensor parallelism does); fp8 projections; and of the mixture's dispatch:
        autopar's all-to-all is torch's (NCCL's), run in turn with the compute."""
        out = c.not_run_by_autopar()
        if c.t > 1 and self.planner.tp_overlap == "megatron":  # autopar's layouts are PyTorch's tensor parallelism
            out.append(TP_OVERLAP_NOT_RUN)
        if self.dtype == "fp8":
            out.append(FP8_NOT_RUN)
        if c.ep > 1 and self.planner.dispatcher != "alltoall":
            out.append(f"the {self.planner.dispatcher} dispatcher (autopar's all-to-all is NCCL's)")
        if c.ep > 1 and self.planner.ep_overlap:
            out.append("all-to-alls overlapped with another micro-batch's compute")
        return out

    @property
    def model_flops(self) -> float:
        return self.config.model_flops(self.global_batch)

    def mfu(self, c: Candidate | None = None) -> float:
        c = c or self.best
        return self.model_flops / (c.step * self.devices * self.spec.peak(self.dtype))

    def tflops_per_device(self, c: Candidate | None = None, with_recompute: bool = False) -> float:
        c = c or self.best
        flops = self.config.model_flops(self.global_batch)
        if with_recompute and c.recompute == "selective":  # the attention core's forward once more
            flops = self.config.model_flops(self.global_batch, recompute="selective")
        elif with_recompute:  # a forward more for the layers recomputed whole
            flops += c.recomputed_fraction(self.config.layers) * (self.config.model_flops(
                self.global_batch, recompute=True) - flops)
        return flops / c.step / self.devices / 1e12

    def to_dict(self, c: Candidate | None = None) -> dict:
        """The plan as one JSON object (``autopar plan --json``): the figures a published run is compared in, the
        configuration, and the step's and memory's breakdowns."""
        c = c or self.best
        gib = 2**30
        return {
            "step_s": c.step,
            "tokens_per_s_per_device": self.global_batch * self.config.seq / c.step / self.devices,
            "mfu": self.mfu(c),
            "model_tflops_per_device": self.tflops_per_device(c),
            "hardware_tflops_per_device": self.tflops_per_device(c, with_recompute=True),
            "memory_gib": c.memory / gib,
            "configuration": {"model": self.config.describe(), "devices": self.devices, "machine": self.spec.name,
                              "global_batch": self.global_batch, "dtype": self.dtype, "dp": c.d, "tp": c.t,
                              "pp": c.p, "vpp": c.v, "micro_batch": c.b, "micro_batches": c.m, "zero": c.zero,
                              "recompute": {"off": "none"}.get(c.recompute_name, c.recompute_name),
                              "recompute_layers": c.recompute_layers,
                              "attention": self.config.attention, "cp": c.cp, "sp": c.sp,
                              "zero_shard": c.shard_group if c.zero else None,
                              "split_embedding": c.split_embedding, "ep": c.ep,
                              "tp_overlap": self.planner.tp_overlap,
                              **({"fp8_recipe": self.planner.fp8_recipe} if self.dtype == "fp8" else {}),
                              **({"moe_dispatcher": self.planner.dispatcher, "ep_overlap": self.planner.ep_overlap}
                                 if self.config.moe else {})},
            "not_run_by_autopar": self.not_run(c),
            "memory_tight": self.tight,
            "loss": "fused" if self.planner.fused_loss else "fp32",
            "vocab_padded": self.planner.padded_vocab(c.t),
            "breakdown_s": dict(c.parts),
            "memory_breakdown_gib": {k: v / gib for k, v in c.memory_parts.items()},
        }

    def explain(self) -> str:
        c, cfg = self.best, self.config
        gib = 2**30
        where = "inside a node" if c.t <= self.spec.devices_per_node else "across nodes"
        lines = [
            f"{cfg.describe()}; global batch {self.global_batch} sequences, {self.dtype}",
            f"on {self.devices} x {self.spec.device_name} ({self.spec.name}: {self.spec.devices_per_node} per node, "
            f"{math.ceil(self.devices / self.spec.devices_per_node)} nodes); searched {self.considered} plans in "
            f"{self.seconds:.1f} s, {self.too_big} did not fit {self.memory_limit / gib:.1f} GiB per device",
            "",
            f"mesh: {c.mesh()}  ({_placement(c, where)})",
            f"pipeline: {c.p} stage(s) of {stage_sizes(c.slots(cfg.layers), c.p)} layers"
            + (" (the embedding and the loss each in a layer's place: the first and last stages a layer fewer)"
               if c.split_embedding else "") + ", "
            + (f"interleaved 1F1B ({c.v} chunks of {stage_sizes(c.slots(cfg.layers), c.p * c.v)} layers a device)"
               if c.v > 1 else "1F1B") + f", {c.m} micro-batches of {c.b}; "
            + (f"bubble (p-1)/(v m+p-1) = {c.bubble:.1%}" if c.v > 1 else f"bubble (p-1)/(m+p-1) = {c.bubble:.1%}"),
            f"optimizer sharding: ZeRO level {c.zero}" + (" (off)" if c.zero == 0 else f" over {c.d * c.cp} replicas"
                                                          if c.shard_group == c.d * c.cp else
                                                          f" over groups of {c.shard_group} of the {c.d * c.cp} "
                                                          f"replicas, replicated across {c.d * c.cp // c.shard_group}")
            + "; activation recomputation: " + (f"block ({c.recompute_layers} of a device's {max(c.stage_layers(cfg.layers))} "
                                                f"layers recompute their forward whole)" if c.recompute == "block"
                                                else c.recompute_name),
            f"predicted step: {c.step:.3f} s = " + " + ".join(f"{k} {v:.3f}" for k, v in c.parts.items()),
            *([f"tensor-parallel collectives: {_TP_OVERLAP_TEXT[self.planner.tp_overlap]}"] if c.t > 1 else []),
            *([f"fp8: the projections' GEMMs, their operands cast by {_FP8_RECIPE_TEXT[self.planner.fp8_recipe]}; "
               "attention and the output projection in bf16"] if self.dtype == "fp8" else []),
            f"throughput: {self.global_batch * cfg.seq / c.step:,.0f} tokens/s; {self.tflops_per_device():.0f} "
            f"TFLOP/s per device of model FLOPs, MFU {self.mfu():.1%}"
            + (f" ({self.tflops_per_device(with_recompute=True):.0f} TFLOP/s counting recomputation)"
               if c.recompute else ""),
            f"memory per device: {c.memory / gib:.1f} GiB = " + " + ".join(
                f"{k} {v / gib:.1f}" for k, v in c.memory_parts.items()),
        ]
        layer = self.planner.layer(c.t, c.b, c.cp, c.sp, c.ep)
        if cfg.moe:
            grads = f"their gradients over {c.expert_replicas} replica{'s' if c.expert_replicas > 1 else ''}"
            lines.append(f"experts: all {cfg.experts} on every rank (no expert parallelism; {grads}), each token to "
                         f"{cfg.experts_chosen}" if c.ep == 1 else
                         f"experts: {cfg.experts // c.ep} of the {cfg.experts} a rank (expert parallelism over {c.ep} "
                         f"ranks, {grads}), each token to {cfg.experts_chosen}, dispatched by "
                         f"{self.planner.dispatcher}"
                         + (" overlapped with another micro-batch" if self.planner.ep_overlap else "")
                         + f"; all-to-alls exposed: {layer.dispatch * 1e3:.2f} ms a layer and micro-batch")
        if c.cp > 1:
            lines.append(f"context parallelism: ring attention over {c.cp} ranks, {cfg.seq // c.cp} tokens each (two "
                         f"mirrored chunks); key/value ring not hidden by the attention: "
                         f"{layer.context_ring * 1e3:.2f} ms a layer")
        if self.planner.padded_vocab(c.t) != cfg.vocab:
            lines.append(f"note: the vocabulary is padded to {self.planner.padded_vocab(c.t):,} for the tensor group "
                         f"of {c.t} to split it evenly (Megatron-LM's --make-vocab-size-divisible-by)")
        if self.planner.fused_loss:
            lines.append("note: it fits only with a fused cross entropy, which writes its gradient over the logits "
                         "(flash-attn's CrossEntropyLoss(inplace_backward=True), Liger's) instead of keeping fp32 "
                         "copies of them")
        if self.tight:
            lines.append(f"note: no plan fits the {self.memory_limit / gib:.1f} GiB the search keeps free of workspace and "
                         f"fragmentation; this one needs {c.memory / gib:.1f} of the device's "
                         f"{self.spec.memory / gib:.1f} GiB and may not run")
        if self.not_run(c):
            lines.append(f"note: autopar's runtime does not run {' or '.join(self.not_run(c))} yet: this "
                         "predicts another system's run")
        lines += [
            "",
            f"one decoder layer on a tensor group of {c.t}, micro-batch {c.b}"
            + (f" of {cfg.seq // c.cp} tokens a sequence" if c.cp > 1 else "") + _layer_kinds(cfg),
        ]
        lines += _table(layer.rows())
        lines.append("output head and loss on the last stage:")
        lines += _table(self.planner.head(c.t, c.b, c.cp, c.sp).rows())
        lines.append("")
        lines.append("runners-up:")
        lines.append(f"  {'mesh':<24} {'micro':>5} {'m':>5} {'ZeRO':>4} {'recomp':>9} {'bubble':>7} {'step s':>8} "
                     f"{'GiB':>6} {'MFU':>6}")
        for r in self.ranked[:6]:
            lines.append(f"  {r.mesh():<24} {r.b:>5} {r.m:>5} {r.zero:>4} {r.recompute_name[:9]:>9} "
                         f"{r.bubble:>7.1%} {r.step:>8.3f} {r.memory / gib:>6.1f} {self.mfu(r):>6.1%}")
        return "\n".join(lines)


def _layer_kinds(cfg: GPTConfig) -> str:
    """How the one layer shown stands for the model's: all alike, or their average where they differ."""
    differ = [what for what, n in (("dense", cfg.dense_layers if cfg.moe else 0),
                                   ("windowed", cfg.windowed_layers if cfg.windowed_layers < cfg.layers else 0)) if n]
    if not differ:
        return " (every layer the same):"
    counts = {"dense": cfg.dense_layers, "windowed": cfg.windowed_layers}
    return (" (the stages costed at the model's average layer: " + ", ".join(
        f"{counts[what]} of {cfg.layers} {what}" for what in differ) + "; the rows a "
        + ("mixture's" if cfg.moe else "full attention's") + "):")


TP_OVERLAP_NOT_RUN = ("the backward's tensor-parallel collectives hidden behind GEMMs (Megatron-Core's overlap: "
                      "autopar's layouts wait on each, as --tp-overlap none plans them)")
FP8_NOT_RUN = "fp8 projections (autopar trains in bf16, fp16 or fp32)"
_FP8_RECIPE_TEXT = {"delayed": "delayed scaling (Transformer Engine's default: one cast-transpose kernel each)",
                    "tensorwise": "per-tensor current scaling (torchao's tensorwise, Transformer Engine's current "
                                  "scaling: an amax pass, then a cast to both layouts)",
                    "rowwise": "rowwise scaling (torchao: a bf16 transpose, then a cast per layout; gathered in bf16)"}
_TP_OVERLAP_TEXT = {
    "megatron": "the forward's exposed, the backward's behind the GEMMs launched after them (Megatron-Core)",
    "none": "every one exposed, each waited on where autograd issues it (PyTorch's DTensor tensor parallelism)"}


def _table(rows: list[tuple]) -> list[str]:
    head = ("operator", "kind", "shapes", "strategy", "layout")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(5)]
    out = ["  " + "  ".join(f"{h:<{w}}" for h, w in zip(head, widths)) + f"  {'compute ms':>10}  {'comm ms':>8}"]
    for r in rows:
        out.append("  " + "  ".join(f"{str(v):<{w}}" for v, w in zip(r[:5], widths)) + f"  {r[5]:>10.2f}  {r[6]:>8.2f}")
    return out



def evaluate(planner: LayerPlanner, k: Candidate) -> None:
    """``k``'s step time and memory, each by cause, on its largest stage: the layers' compute and tensor-group
    communication (``layers.py``), the pipeline's schedule (``pipeline.py``), the data-parallel sync and ZeRO's
    collectives (``collectives.py``), the optimizer's memory traffic, and the memory the stage keeps (``memory.py``).
    Ranks are in Megatron's order: tensor innermost, then context, data, pipeline."""
    cfg, spec, itemsize = planner.config, planner.spec, planner.itemsize
    layer, head = planner.layer(k.t, k.b, k.cp, k.sp, k.ep), planner.head(k.t, k.b, k.cp, k.sp)
    first_stage, middle_stage, last_stage = k.stage_layers(cfg.layers)
    per_stage = max(first_stage, middle_stage, last_stage)
    boundary = k.b * (cfg.seq // k.cp) * cfg.hidden * itemsize
    replicas = k.d * k.cp  # the weights are the same on the data- and context-parallel ranks
    shard = k.shard_group  # ZeRO's shards: over every replica, or over groups of them (hybrid sharding)
    # the token embedding is vocabulary-parallel over the tensor group (an all-reduce of its output), a lookup
    embed_params = cfg.vocab * cfg.hidden / k.t + (0 if cfg.llama else cfg.seq * cfg.hidden)
    embed_time = 3 * boundary / spec.memory_bandwidth + 2 * spec.collective("all_reduce", boundary, k.t)[0]
    block = k.recompute_layers if k.recompute == "block" else 0  # layers of a device recomputed whole
    layer_time = layer.time + (layer.core_forward if k.recompute == "selective" else layer.forward
                               if k.recompute is True else 0.0)
    kept = layer.activation_bytes - (layer.core_activation_bytes if k.recompute == "selective" else 0.0)
    first = first_stage * layer_time + min(block, first_stage) * layer.forward + embed_time + (
        head.time if k.p == 1 else 0.0)
    last = last_stage * layer_time + min(block, last_stage) * layer.forward + head.time if k.p > 1 else first
    middle = middle_stage * layer_time + min(block, middle_stage) * layer.forward
    micro = max(first, last, middle)
    p2p = 0.0
    if k.p > 1:  # activation forward, its gradient back; split over the tensor group (scatter-gather)
        p2p = 2 * spec.collective("all_gather", 2 * boundary / k.t, 2, k.t * replicas)[0]
    pipeline = schedule_seconds(k.m, k.p, k.v, k.slots(cfg.layers), micro, p2p)
    # parameters of the largest stage on one device
    stage_params = max(first_stage * layer.param_count + embed_params + (head.param_count if k.p == 1 else 0),
                       middle_stage * layer.param_count,
                       last_stage * layer.param_count + head.param_count)
    # ZeRO over the data-parallel replicas of a context group (autopar's runtime inside stages): those ranks lie
    # t x cp apart, the context group's copies t apart; otherwise the shard groups are consecutive, t apart
    by_replica = bool(k.zero) and k.cp > 1 and shard == k.d < replicas
    def dense_sync(hiding: float, slowdown: float | None = None) -> float:  # the rest's, behind a micro-batch of
        # ``hiding`` seconds
        return data_parallel_sync(spec, k.zero, k.m, stage_params * itemsize, layer.param_count * itemsize,
                                  per_stage, hiding, shard if k.zero else replicas, k.t * k.cp if by_replica else k.t,
                                  staged=k.p > 1, itemsize=itemsize, forward_share=layer.forward / layer_time,
                                  groups=replicas // shard if k.zero else 1, groups_stride=k.t if by_replica else None,
                                  slowdown=slowdown)

    dp = dense_sync(micro)
    # a mixture's experts: synchronised and ZeRO-sharded over the expert-data-parallel ranks (``ep`` apart, the
    # expert-parallel groups being consecutive), in the same backward as the rest -- with what the rest's
    # collectives left of the time that hides them (a micro-batch's, every micro-batch's under ZeRO-2/3)
    experts = per_stage * layer.expert_param_count
    if experts and k.expert_replicas > 1:
        # what the rest's collectives take of the window: their time less what sticks out of it
        hidden = max(0.0, dense_sync(0.0) - dense_sync(micro, slowdown=0.0)) / (k.m if k.zero >= 2 else 1)
        dp += data_parallel_sync(spec, k.zero, k.m, experts * itemsize, layer.expert_param_count * itemsize,
                                 per_stage, max(0.0, micro - hidden), k.expert_replicas, k.ep, staged=k.p > 1,
                                 itemsize=itemsize, forward_share=layer.forward / layer_time)
    tied = spec.collective("all_reduce", cfg.vocab * cfg.hidden / k.t * itemsize, 2,
                           k.t * replicas * (k.p - 1))[0] if k.p > 1 and not cfg.llama else 0.0  # Llama: untied
    optimizer = (stage_params / (shard if k.zero >= 1 else 1) + experts / (k.expert_replicas if k.zero >= 1 else 1)
                 ) * ADAM_TRAFFIC / spec.memory_bandwidth
    k.parts = {"pipeline": pipeline, "data-parallel sync": dp, "optimizer": optimizer}
    if tied:
        k.parts["tied embedding"] = tied
    k.step = sum(k.parts.values())
    # memory of the largest stage; ZeRO shards over the data- and context-parallel ranks (Megatron's distributed
    # optimizer)
    state = weight_state_bytes(k.zero, stage_params, shard, itemsize, layer.param_count, staged=k.p > 1)
    if experts:
        state += weight_state_bytes(k.zero, experts, k.expert_replicas, itemsize, layer.expert_param_count,
                                    staged=k.p > 1)
    flight = in_flight(k.p, k.m, k.v)

    def stage_acts(layers: int, flight: int) -> float:
        if k.recompute is True:
            return flight * layers * layer.input_bytes + layer.activation_bytes
        own = min(block, layers)  # block: those layers keep their input, and one of them is rebuilt whole at a time
        return flight * ((layers - own) * kept + own * layer.input_bytes) + (layer.activation_bytes if own else 0.0)

    acts = stage_acts(first_stage, flight) + (head.activation_bytes if k.p == 1 else 0.0)
    if middle_stage:  # the second stage: more layers, fewer in flight -- min(p - 1, m), interleaved p + (p - 3) / v
        second = min(k.p - 1, k.m) if k.v == 1 else math.ceil(k.p + (k.p - 3) / k.v)
        acts = max(acts, stage_acts(middle_stage, second))
    own = min(block, last_stage)
    last_acts = head.activation_bytes + (layer.activation_bytes if k.recompute is True else (last_stage - own) * kept
                                         + own * layer.input_bytes + (layer.activation_bytes if own else 0.0))
    k.memory_parts = {"weights+grads+optimizer": state, "activations": max(acts, last_acts) if k.p > 1 else acts}
    k.memory = sum(k.memory_parts.values())


_FLAGS = {"tp": "--tp", "pp": "--pp", "micro_batch": "--micro-batch", "zero": "--zero", "recompute": "--recompute",
          "vpp": "--vpp", "zero_shard": "--zero-shard", "split_embedding": "--split-embedding-and-loss",
          "tp_overlap": "--tp-overlap", "fp8_recipe": "--fp8-recipe"}


def _pin_text(key: str, value, fixed: dict) -> str:
    """A pin as the user gave it: ``--recompute-layers 3`` where the block came from it."""
    if key == "recompute" and value == "block" and fixed.get("recompute_layers"):
        return f"{recompute_name(value)} (--recompute-layers {fixed['recompute_layers']})"
    return recompute_name(value) if key == "recompute" else str(value)


def _what_would_fit(config, spec, devices, global_batch, dtype, memory_limit, max_micro_batch, fixed) -> str:
    """What would make a configuration that fits nowhere fit: the ZeRO level, recomputation or micro-batch pin given
    up alone, fused attention for a model that stores its scores, sequence parallelism for a pinned tensor group, a
    context split where ``--cp 1`` kept the sequence whole -- the changes that fit, each with the plan it then gets;
    '' where none does."""
    # the pins whose relaxation keeps the tensor degrees searched (tp and pp would search every tensor degree
    # again: tens of seconds for an error line); each remedy plans once, looking no further
    tries = [(f"without {_FLAGS[k]} {_pin_text(k, v, fixed)}", config,
              {**fixed, k: None, **({"recompute_layers": None} if k == "recompute" else {})})
             for k, v in fixed.items() if v is not None and k in ("zero", "recompute", "micro_batch")]
    if config.attention == "materialized":
        tries.append(("with --attention fused", dataclasses.replace(config, attention="fused"), fixed))
    if fixed.get("sp") is False and (fixed.get("tp") or 1) > 1:  # the tensor group's activations split by it
        tries.append(("with --sp", config, {**fixed, "sp": True}))
    if fixed.get("cp") == 1 and len(context_options(config, devices, fixed.get("sp"))) > 1:  # the sequence split
        tries.append(("without --cp 1", config, {**fixed, "cp": None}))
    fits = []
    for what, cfg, pins in tries:
        try:
            plan = plan_gpt(cfg, spec, devices, global_batch, dtype, memory_limit, max_micro_batch, fixed=pins,
                            _remedy=False)
        except ConfigError:
            continue
        b = plan.best
        fits.append(f"{what} it fits ({b.mesh()}, micro-batch {b.b}, ZeRO {b.zero}, recompute "
                    f"{b.recompute_name}: {b.memory / 2**30:.1f} GiB" + (", tight" if plan.tight else "") + ")")
    return "; ".join(fits)


def _fewest_recomputed(planner: "LayerPlanner", k: Candidate, limit: float, pinned: int | None) -> Candidate:
    """Block recomputation (Megatron-LM's ``--recompute-method block --recompute-num-layers n``): the ``n`` first
    layers of a device recompute their forward whole, the others keep their activations. Pinned, ``n`` as given;
    searched, the fewest that fit -- between none and full, where a stage is a few layers too big for its memory."""
    per_stage = max(k.stage_layers(planner.config.layers))
    if pinned is not None:
        k.recompute_layers = min(pinned, per_stage)
        evaluate(planner, k)
        return k
    low, high = 1, max(1, per_stage - 1)  # memory falls as n grows: the fewest that fit, by bisection
    while low < high:
        mid = (low + high) // 2
        probe = dataclasses.replace(k, recompute_layers=mid)
        evaluate(planner, probe)
        low, high = (low, mid) if probe.memory <= limit else (mid + 1, high)
    k = dataclasses.replace(k, recompute_layers=low)
    evaluate(planner, k)
    return k


# Context parallelism is weighed for sequences of 8,192 tokens and more: Megatron Core's parallelism guide gives it
# for "Long sequences (8K+ tokens)" (docs.nvidia.com/megatron-core/developer-guide, Parallelism Strategies Guide).
CP_SEARCH_MIN_SEQUENCE = 8192
# ... each rank keeping at least 2,048 tokens (its two mirrored chunks of 1,024): the range searched, not a measured
# bound -- below it a chunk's attention is short beside the ring's key/value hop, and the search would only grow
CP_SEARCH_MIN_TOKENS = 2048


def context_options(config: GPTConfig, devices: int, sp: bool | None) -> list[int]:
    """The context-parallel degrees the search weighs where ``--cp`` is not pinned: 1, and for a long sequence
    (``CP_SEARCH_MIN_SEQUENCE``) under fused attention every power of two dividing the devices and, with causal load
    balancing, half the sequence, down to ``CP_SEARCH_MIN_TOKENS`` a rank -- except beside pinned sequence
    parallelism, which autopar's runtime does not run with a context split."""
    if sp or config.attention == "materialized" or config.seq < CP_SEARCH_MIN_SEQUENCE:
        return [1]
    out, cp = [1], 2
    while config.seq // cp >= CP_SEARCH_MIN_TOKENS and devices % cp == 0 and config.seq % (2 * cp) == 0:
        out.append(cp)
        cp *= 2
    return out


def _experts(config: GPTConfig, fixed: dict) -> tuple[str, bool]:
    """The mixture of experts' pins, checked (one line each): ``ep``, ``dispatcher``, ``ep_overlap``; returns the
    dispatcher (NCCL's all-to-all, autopar's, unless pinned) and whether the all-to-alls overlap."""
    ep, dispatcher, overlap = fixed.get("ep"), fixed.get("dispatcher"), fixed.get("ep_overlap")
    given = [flag for flag, value in (("--ep", ep), ("--moe-dispatcher", dispatcher), ("--ep-overlap", overlap))
             if value not in (None, False)]
    if given and not config.moe:
        raise ConfigError(f"{', '.join(given)} describe{'s' if len(given) == 1 else ''} how a mixture of experts "
                          f"runs, and {config.describe().split(':')[0]} has none: give --experts (and --top-k, "
                          "--expert-ffn) or a mixture preset (--size qwen3-30b-a3b, mixtral-8x7b, ...)")
    if ep is not None:
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ConfigError(f"--ep must be a positive expert-parallel degree, got {ep!r}")
        if config.experts % ep:
            raise ConfigError(f"--ep {ep} does not divide the {config.experts} experts: each rank of an "
                              f"expert-parallel group holds experts / ep whole experts (try a divisor of "
                              f"{config.experts})")
    if dispatcher is not None and dispatcher not in DISPATCHERS:
        raise ConfigError(f"--moe-dispatcher must be {' or '.join(DISPATCHERS)}, got {dispatcher!r}")
    return dispatcher or "alltoall", bool(overlap)


def _context_and_sequence(config: GPTConfig, fixed: dict) -> tuple[int | None, bool | None]:
    """The pinned context-parallel degree and sequence parallelism, checked (one line each); either unpinned is
    None. Unpinned, the search weighs sequence parallelism for every tensor group (autopar's runtime runs it with
    tensor parallelism, in the layout modes and inside pipeline stages) except beside a context split, which the
    runtime does not run with it, and the context-parallel degrees of :func:`context_options`."""
    cp = fixed.get("cp")
    sp = None if fixed.get("sp") is None else bool(fixed["sp"])
    if cp is not None:
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
            raise ConfigError(f"--cp must be a positive context-parallel degree, got {cp!r}")
        if cp > 1 and config.attention == "materialized":
            raise ConfigError(f"--cp {cp} needs a fused attention (--attention fused or flash2): ring attention "
                              "passes key/value blocks between fused attention kernels, it never materializes the "
                              "scores")
        if cp > 1 and config.seq % (2 * cp):
            raise ConfigError(f"--cp {cp} needs the sequence ({config.seq}) divisible by 2 x cp = {2 * cp}: with "
                              "causal load balancing each rank holds two mirrored chunks")
    if sp and fixed.get("tp") == 1:
        raise ConfigError("--sp (sequence parallelism) splits the tensor-parallel group's norms and residuals on the "
                          "sequence: it needs --tp 2 or more")
    split = cp or 1  # the context split the pins fix (a searched one is checked in the search)
    if sp and fixed.get("tp") and config.seq % (fixed["tp"] * split):
        raise ConfigError("--sp needs the sequence" + (" per context-parallel rank" if split > 1 else "")
                          + f" ({config.seq // split}) divisible by --tp {fixed['tp']}")
    return cp, sp


def _enumerate(planner: LayerPlanner, devices: int, global_batch: int, fixed: dict, cps: list[int],
               sp: bool | None, limit: float, memory_limit: float | None, max_micro_batch: int,
               progress) -> tuple[list, list, Candidate | None, int]:
    """Every (context, tensor, pipeline, data, micro-batch, ZeRO, recomputation, virtual stages) candidate the pins
    leave, over the context-parallel degrees ``cps``: those that fit ``limit``, those that fit only the device's
    whole memory, the smallest, and how many."""
    fitting, on_device, smallest, considered = [], [], None, 0
    for cp in cps:
        found = _enumerate_context(planner, devices, global_batch, fixed, cp, sp, limit, memory_limit,
                                   max_micro_batch, progress)
        fitting += found[0]
        on_device += found[1]
        if found[2] is not None and (smallest is None or found[2].memory < smallest.memory):
            smallest = found[2]
        considered += found[3]
    return fitting, on_device, smallest, considered


def _enumerate_context(planner: LayerPlanner, devices: int, global_batch: int, fixed: dict, cp: int,
                       sp: bool | None, limit: float, memory_limit: float | None, max_micro_batch: int,
                       progress) -> tuple[list, list, Candidate | None, int]:
    """:func:`_enumerate` at one context-parallel degree."""
    config, spec = planner.config, planner.spec
    keep = lambda key, value: fixed.get(key) is None or fixed[key] == value  # noqa: E731
    fitting, on_device, smallest, considered = [], [], None, 0
    # selective recomputation where there are stored scores to drop (fused attention stores none)
    options = (False, "selective", "block", True) if config.attention == "materialized" else (False, "block", True)
    recomputes = [r for r in options if keep("recompute", r)] or [fixed["recompute"]]
    # every divisor of a node, and one step across nodes (two nodes' worth), for the cost model to reject
    tp_options = [t for t in list(range(1, spec.devices_per_node + 1)) + [2 * spec.devices_per_node]
                  if (t > spec.devices_per_node or spec.devices_per_node % t == 0) and (devices // cp) % t == 0
                  and config.kv_groups % t == 0 and (config.moe or config.ffn_size % t == 0) and keep("tp", t)
                  and (not sp or (t > 1 and config.seq % (t * cp) == 0))]

    def sp_options(t: int) -> list[bool]:  # unpinned: with and without, for a tensor group dividing the sequence
        if sp is not None:
            return [sp]
        if config.moe and t > 1 and fixed.get("cp") == cp and config.seq % (t * cp) == 0:
            # a pinned context degree (a published run's) beside a mixture's tensor group: the sequence split
            # Megatron-Core requires there ("sequence parallelism must be used" with expert and tensor parallelism)
            return [True]
        return [False, True] if t > 1 and cp == 1 and config.seq % t == 0 else [False]

    split = bool(fixed.get("split_embedding"))
    for t, seq_split in [(tp, s) for tp in tp_options for s in sp_options(tp)]:
        for p in range(1, min(config.layers + (2 if split else 0), devices // (t * cp)) + 1):
            if (devices // (t * cp)) % p or not keep("pp", p):
                continue
            d = devices // (t * cp * p)
            if global_batch % d:
                continue
            sizes = [fixed["micro_batch"]] if fixed.get("micro_batch") else _powers_of_two(
                min(max_micro_batch, global_batch // d))
            for b in sizes:
                if (global_batch // d) % b:
                    continue
                if progress:
                    progress(f"tp {t} x pp {p} x dp {d}, micro-batch {b}")
                # pipelines take ZeRO 0/1 (Megatron's distributed optimizer) unless pinned higher (FSDP inside
                # stages, as torchtitan runs it)
                # (with one replica every level shards over one rank: a pinned level is kept, and costs level 0's)
                levels = ((fixed["zero"] if fixed.get("zero") is not None else 0,) if d * cp == 1
                          else (0, 1) if p > 1 and fixed.get("zero") is None else (0, 1, 2, 3))
                for zero, ep in [(z, e) for z in levels if keep("zero", z) and (z or fixed.get("zero_shard") is None)
                                 for e in expert_options(config, fixed, t, cp, d, p, seq_split)]:
                    for shard in _shard_groups(spec, fixed, zero, t, d, cp, p):
                        for recompute in recomputes:
                            slots = config.layers + (2 if split and p > 1 else 0)
                            for v in virtual_stages(slots, p, global_batch // (d * b), fixed.get("vpp")):
                                k = Candidate(t, p, d, b, global_batch // (d * b), zero, recompute, v, cp, seq_split,
                                              shard=shard, split_embedding=split and p > 1, ep=ep)
                                if recompute == "block":
                                    k = _fewest_recomputed(planner, k, limit, fixed.get("recompute_layers"))
                                else:
                                    evaluate(planner, k)
                                considered += 1
                                if smallest is None or k.memory < smallest.memory:
                                    smallest = k
                                if k.memory <= limit:
                                    fitting.append(k)
                                elif memory_limit is None and k.memory <= spec.memory:
                                    on_device.append(k)
    return fitting, on_device, smallest, considered


def expert_options(config: GPTConfig, fixed: dict, t: int, cp: int, d: int, p: int, sp: bool) -> list[int]:
    """The expert-parallel degrees to weigh for a mixture of experts on a stage's ``t x cp x d`` ranks (1 for a
    dense model): the pinned one where it divides them and the experts; searched, every divisor of both -- where
    autopar's runtime runs expert parallelism: beside data parallel and ZeRO with the sequence whole and no tensor
    group, and inside pipeline stages over a stage's data-parallel replicas or each group of ``ep`` of them, beside
    ZeRO over them and a tensor split (sequence-parallel or not) or a context split of the stage or neither
    (``PipelineParallel(ep=..., zero=..., tp=..., cp=...)``) -- elsewhere the experts whole
    (``Candidate.not_run_by_autopar``)."""
    if not config.moe:
        return [1]
    ranks, pinned = t * cp * d, fixed.get("ep")
    if pinned is not None:
        return [pinned] if ranks % pinned == 0 and config.experts % pinned == 0 else []
    if p > 1:  # inside pipeline stages: over a stage's replicas or groups of them, beside a tensor split (with
        # sequence parallelism or without) or a context split of the stage or neither (PipelineParallel(ep=...,
        # tp=..., tensor_parallel={...: "sequence"}, cp=...))
        return [e for e in range(1, d + 1) if d % e == 0 and config.experts % e == 0]
    if sp or cp > 1 or t > 1:
        return [1]
    return [e for e in range(1, min(ranks, config.experts) + 1) if ranks % e == 0 and config.experts % e == 0]


def _shard_groups(spec, fixed: dict, zero: int, t: int, d: int, cp: int, p: int) -> list[int]:
    """ZeRO's shard groups to weigh (``Candidate.shard``; 0: every replica, the ``d x cp`` data- and
    context-parallel ranks): the pinned one where it divides the replicas; beside a searched context split what
    autopar's runtime shards -- inside pipeline stages the ``d`` data-parallel replicas (a stage's optimizer,
    replicated across the context group), outside them every replica; otherwise every replica and, for ZeRO-3
    outside pipelines, one node's data-parallel ranks -- hybrid sharding, whose gathers stay on the node's NVLink
    (FSDP2's HSDP, as torchtitan's ``data_parallel_replicate``)."""
    pinned, replicas = fixed.get("zero_shard"), d * cp
    if pinned is not None:
        return [0 if pinned == replicas else pinned] if zero and replicas % pinned == 0 else []
    if zero and cp > 1 and fixed.get("cp") is None:
        # what autopar's runtime shards beside a searched context split: inside stages the data-parallel replicas
        # (one replica: nothing to shard, the level is level 0's), outside them every replica
        return ([d] if d > 1 else []) if p > 1 else [0]
    node = spec.devices_per_node // t if t <= spec.devices_per_node else 0
    if zero == 3 and p == 1 and 1 < node < replicas and replicas % node == 0:
        return [0, node]
    return [0]


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def plan_gpt(config: GPTConfig, spec: ClusterSpec, devices: int, global_batch: int, dtype: str = "bf16",
             memory_limit: float | None = None, max_micro_batch: int = 8, progress=None,
             fixed: dict | None = None, _remedy: bool = True) -> MeshPlan:
    """The fastest (data, tensor, pipeline, ZeRO, recompute) plan of ``config`` on ``devices`` of ``spec``.

    ``fixed`` pins any of ``tp``, ``pp``, ``micro_batch``, ``zero``, ``recompute`` (False, True, "selective",
    "block"), ``recompute_layers``, ``vpp``, ``cp``, ``sp``, ``zero_shard`` (e.g. to predict a published
    configuration); the rest is searched. ``_remedy``: where nothing fits, say what would (the remedies' own plans do not look further)."""
    fixed = dict(fixed or {})
    unknown = set(fixed) - {"tp", "pp", "micro_batch", "zero", "recompute", "vpp", "cp", "sp", "recompute_layers",
                            "zero_shard", "split_embedding", "ep", "dispatcher", "ep_overlap", "tp_overlap",
                            "fp8_recipe"}
    if unknown:
        raise ConfigError(f"unknown plan constraint(s): {', '.join(sorted(unknown))}")
    dispatcher, ep_overlap = _experts(config, fixed)
    tp_overlap = fixed.get("tp_overlap") or "megatron"
    if tp_overlap not in OVERLAPS:
        raise ConfigError(f"--tp-overlap must be {', '.join(OVERLAPS)}, got {tp_overlap!r}")
    fp8_recipe = fixed.get("fp8_recipe")
    if fp8_recipe is not None and fp8_recipe not in FP8_RECIPES:
        raise ConfigError(f"--fp8-recipe must be {', '.join(FP8_RECIPES)}, got {fp8_recipe!r}")
    if fp8_recipe is not None and dtype != "fp8":
        raise ConfigError(f"--fp8-recipe {fp8_recipe} scales fp8 projections: it needs --dtype fp8, not {dtype}")
    vpp = fixed.get("vpp")
    if vpp is not None and (isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1):
        raise ConfigError(f"--vpp must be a positive number of virtual stages per device, got {vpp!r}")
    for key, low in (("tp", 1), ("pp", 1), ("micro_batch", 1), ("zero", 0)):
        value = fixed.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low
                                  or (key == "zero" and value > 3)):
            raise ConfigError(f"{_FLAGS[key]} must be " + ("0, 1, 2 or 3" if key == "zero" else "a positive whole "
                              "number") + f", got {value!r}")
    recompute = fixed.get("recompute")
    if not (recompute is None or isinstance(recompute, bool) or recompute in ("selective", "block")):
        raise ConfigError(f"--recompute must be full, selective, block or none, got {recompute!r}")
    cp, sp = _context_and_sequence(config, fixed)
    cps = context_options(config, devices, sp) if cp is None else [cp]
    shard = fixed.get("zero_shard")
    if shard is not None:
        if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1:
            raise ConfigError(f"--zero-shard must be a positive number of ranks, got {shard!r}")
        if fixed.get("zero") == 0:
            raise ConfigError(f"--zero-shard {shard} shards ZeRO's state over groups of {shard} ranks: it needs "
                              "--zero 1, 2 or 3, not --zero 0")
    layers_pin = fixed.get("recompute_layers")
    if layers_pin is not None:
        if isinstance(layers_pin, bool) or not isinstance(layers_pin, int) or layers_pin < 1:
            raise ConfigError(f"--recompute-layers must be a positive number of layers, got {layers_pin!r}")
        if fixed.get("recompute") not in (None, "block"):
            raise ConfigError(f"--recompute-layers {layers_pin} recomputes that many layers of a device whole: it is "
                              f"--recompute block, not --recompute {recompute_name(fixed['recompute'])}")
        fixed["recompute"] = "block"
    start = time.perf_counter()
    if devices < 1:
        raise ConfigError(f"the number of devices must be positive, got {devices}")
    spec = spec.for_devices(devices)
    if global_batch < 1:
        raise ConfigError(f"the global batch must be positive, got {global_batch}")
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    if cp is not None and devices % cp:
        raise ConfigError(f"--cp {cp} does not divide the {devices} devices")
    spec.peak(dtype)
    limit = memory_limit or spec.memory * MEMORY_HEADROOM
    args = (devices, global_batch, fixed, cps, sp, limit, memory_limit, max_micro_batch, progress)
    planner = LayerPlanner(config, spec, dtype, dispatcher=dispatcher, ep_overlap=ep_overlap, tp_overlap=tp_overlap,
                           fp8_recipe=fp8_recipe or "delayed")
    fitting, on_device, smallest, considered = _enumerate(planner, *args)
    if smallest is not None and not fitting:
        # nothing fits the headroom with the cross entropy's fp32 copies (memory.LOSS_BYTES_PER_LOGIT): a run that
        # did fit ran a fused one, its gradient written over the logits (flash-attn's
        # ``CrossEntropyLoss(inplace_backward=True)``, as llm-foundry runs it; Liger's); the plan says so. The same
        # candidates again, their layers' plans reused (the loss is the head's alone)
        fused = planner.with_fused_loss()
        found = _enumerate(fused, *args)
        if found[0] or (found[1] and not on_device):
            planner, (fitting, on_device, _, _) = fused, found
    if smallest is None:
        pinned = "".join(f", {k} {v}" for k, v in fixed.items() if v is not None)
        raise ConfigError(
            f"no plan of {devices} devices for global batch {global_batch}{pinned}: the data-parallel degree must "
            f"divide the batch, tensor parallelism the key/value heads ({config.kv_groups}), the feed-forward width "
            f"({config.ffn_size}) and one node ({spec.devices_per_node}), pp at most the layers ({config.layers}"
            + (" + the embedding and the loss" if fixed.get("split_embedding") else "") + "), cp "
            "the devices; interleaving (vpp) needs the micro-batches divisible by pp and at least pp x vpp layers"
            + ("" if fixed.get("split_embedding") else " (with --split-embedding-and-loss the embedding and the loss "
               "count as two more)") + "; a ZeRO shard group (--zero-shard) the data-parallel ranks (dp x cp)"
            + ("; ep the experts and a stage's tp x cp x dp ranks" if config.moe else ""))
    too_big = considered - len(fitting)
    tight = not fitting and bool(on_device)
    if tight:  # the search's headroom is a margin of its own, not the device's: a pinned published run may fit
        fitting = on_device
    if not fitting:
        remedy = _what_would_fit(config, spec, devices, global_batch, dtype, memory_limit, max_micro_batch,
                                 fixed) if _remedy else ""
        raise ConfigError(
            f"{config.describe()} fits nowhere on {devices} x {spec.device_name}: the smallest plan "
            f"({smallest.mesh()}, micro-batch {smallest.b}, ZeRO {smallest.zero}, recompute "
            f"{smallest.recompute_name}) needs {smallest.memory / 2**30:.1f} GiB per device, "
            f"{limit / 2**30:.1f} GiB usable" + (f"; {remedy}" if remedy else ""))
    fitting.sort(key=lambda k: (k.step, k.memory))
    best = fitting[0]
    return MeshPlan(config, spec, devices, global_batch, dtype, best, fitting, planner, considered,
                    too_big, time.perf_counter() - start, limit, tight)
