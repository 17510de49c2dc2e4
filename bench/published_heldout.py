"""The cluster planner against published runs it was never tuned on: predicted vs measured, and their order.

``bench/published_gpt.py`` holds the runs the presets were checked against while the model was built. These runs
were collected after the model's mechanisms and constants were fixed (sequence and context parallelism, per-shape
GEMM rates, fp8, NCCL's protocols, FSDP per layer) and nothing was changed after seeing them: they are reported
apart, as the test of what the planner predicts for a run it has not seen.

Each run is pinned as its source states it; what the source does not state (micro-batch, recomputation, ZeRO level,
sequence parallelism, virtual stages) is left to the planner's search, which takes its fastest plan that fits --
as a user would who knows only what was published. Sources and every figure are cited per row; ``note`` says where
the hardware or the model differs from what is planned.

    python bench/published_heldout.py [--out bench/results/published_heldout.json]

Ordering: for every two runs of one source, model, sequence and dtype whose published per-device figure differs by
more than 10 %, whether the planner orders them the same way.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from published_gpt import grand_teton, ordered_pairs, plan_row, predicted  # bench/ is the script's own folder

from autopar.errors import ConfigError
from autopar.planner.cluster import load_cluster, plan_gpt
from autopar.planner.gpt import GPTConfig

MLM = ("NVIDIA/Megatron-LM README.md @d98e8a64, 'Weak Scaling Results' table (images/model_table.png, Megatron-Core "
       "r0.8.0, H100); vocabulary 131072, sequence 4096, --overlap-grad-reduce --overlap-param-gather (the distributed "
       "optimizer: ZeRO-1)")
TT = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @b5bcd76c (Llama 3.1, H100 96 GB HBM2e at 500 W; "
      "sequence 8192 from the train configs' default at the benchmarked commit 9dec370a)")
TT_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @b5bcd76c, 'Vanilla TP' column"
# torchtitan's micro-batches: its "local batch size" is a data-parallel rank's batch, run whole without gradient
# accumulation (global batch = local x FSDP degree in every table); under pipelines split into as many micro-batches as
# stages by default (torchtitan @9dec370a, ``experimental.pipeline_parallel_microbatches``: "The default value will be
# the number of pipeline stages"): 405B's local 32 as 8 of 4. Its tensor parallelism is Megatron's with the norms split
# on the sequence (``apply_tp``: ``SequenceParallel()`` for the norms): ``--sp``
DGXC24 = "NVIDIA/dgxc-benchmarking @35a9aecc (v24.11.1)"
DGXC25 = "NVIDIA/dgxc-benchmarking @85380ffe (v25.04.01) README.md config and performance tables"
NEMO = "NVIDIA/NeMo docs/source/performance/performance_summary.md @8e3d65dc (NeMo 24.07, DGX-H100, FP8)"
NEMO_CP = ("NVIDIA/NeMo docs/source/performance/performance_long_sequence.md @8275bf6c (Llama 2 7B, FP8, NeMo "
           "24.03.01, DGX-H100)")
BRIDGE = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md @067f987d (DGX-H100, FP8 current scaling)"
LLAMA3 = ("Llama 3 Herd of Models, arXiv 2407.21783, Table 4 (405B pre-training on H100 80 GB, RoCE 400 Gb/s a GPU; "
          "the 8K stage without activation checkpointing; sec. 3.3.2: 'Our use of FSDP for Llama 3 shards the optimizer "
          "states and gradients, but for model shards we do not reshard after forward computation': ZeRO-2)")
FOUNDRY = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md @49521837 (MPT, PyTorch FSDP FULL_SHARD, flash "
           "attention; MFU counts no recomputation)")

# model shapes: (family, layers, hidden, heads, kv_heads, ffn, vocab, seq). Nemotron-4's squared-ReLU MLP (two
# matrices of ffn) is planned as a SwiGLU of 2/3 the width: the same FLOPs and parameters.
LLAMA31_8B = ("llama", 32, 4096, 32, 8, 14336, 128256, 8192)
LLAMA31_70B = ("llama", 80, 8192, 64, 8, 28672, 128256, 8192)
LLAMA31_405B = ("llama", 126, 16384, 128, 8, 53248, 128256, 8192)
LLAMA31_405B_KV16 = ("llama", 126, 16384, 128, 16, 53248, 128256, 8192)  # dgxc 24.11's yaml: num_query_groups 16
LLAMA2_70B = ("llama", 80, 8192, 64, 8, 28672, 32000, 4096)
LLAMA2_7B = ("llama", 32, 4096, 32, 0, 11008, 32000, 0)  # sequence per row
NEMOTRON_15B = ("llama", 32, 6144, 48, 8, 24576 * 2 // 3, 256000, 4096)
NEMOTRON_340B = ("llama", 96, 18432, 96, 8, 73728 * 2 // 3, 256000, 4096)


def mlm(layers, hidden, heads):
    return ("gpt", layers, hidden, heads, 0, 0, 131072, 4096)


def mpt(layers, hidden, heads):
    return ("gpt", layers, hidden, heads, 0, 0, 50368, 2048)


H96 = "h100-grand-teton"  # torchtitan's H100 96 GB HBM2e at 500 W (published_gpt.grand_teton)

# (name, source and quoted row, model, gpus, machine, global batch, pins, dtype, (metric, value), note)
RUNS = [
    ("MLM 1.7B, 48 GPUs", MLM + ": '1.7B | 16 | 2048 | 24 | 1 | 1 | 48 | 48 | 192 | 408.8 | 41%'", mlm(24, 2048, 16),
     48, "h100-ib", 192, {"tp": 1, "pp": 1, "zero": 1}, "bf16", ("model_tflops_per_gpu", 408.8), "dtype unstated"),
    ("MLM 7.1B, 96 GPUs", MLM + ": '7.1B | 32 | 4096 | 30 | 2 | 1 | 48 | 96 | 192 | 465.9 | 47%'", mlm(30, 4096, 32),
     96, "h100-ib", 192, {"tp": 2, "pp": 1, "zero": 1}, "bf16", ("model_tflops_per_gpu", 465.9), "dtype unstated"),
    ("MLM 16B, 192 GPUs", MLM + ": '16B | 48 | 6144 | 32 | 4 | 1 | 48 | 192 | 192 | 489.1 | 49%'", mlm(32, 6144, 48),
     192, "h100-ib", 192, {"tp": 4, "pp": 1, "zero": 1}, "bf16", ("model_tflops_per_gpu", 489.1), "dtype unstated"),
    ("MLM 32B, 384 GPUs", MLM + ": '32B | 56 | 7168 | 48 | 8 | 1 | 48 | 384 | 192 | 459.6 | 46%'", mlm(48, 7168, 56),
     384, "h100-ib", 192, {"tp": 8, "pp": 1, "zero": 1}, "bf16", ("model_tflops_per_gpu", 459.6), "dtype unstated"),
    ("MLM 70B, 768 GPUs", MLM + ": '70B | 64 | 8192 | 84 | 8 | 2 | 48 | 768 | 384 | 419.7 | 42%'", mlm(84, 8192, 64),
     768, "h100-ib", 384, {"tp": 8, "pp": 2, "zero": 1}, "bf16", ("model_tflops_per_gpu", 419.7), "dtype unstated"),
    ("MLM 119B, 1536 GPUs", MLM + ": '119B | 80 | 10240 | 92 | 8 | 4 | 48 | 1536 | 768 | 420.5 | 43%'",
     mlm(92, 10240, 80), 1536, "h100-ib", 768, {"tp": 8, "pp": 4, "zero": 1}, "bf16", ("model_tflops_per_gpu", 420.5),
     "dtype unstated"),
    ("MLM 177B, 2304 GPUs", MLM + ": '177B | 96 | 12288 | 96 | 8 | 6 | 48 | 2304 | 1152 | 432.8 | 44%'",
     mlm(96, 12288, 96), 2304, "h100-ib", 1152, {"tp": 8, "pp": 6, "zero": 1}, "bf16",
     ("model_tflops_per_gpu", 432.8), "dtype unstated"),
    ("MLM 314B, 3072 GPUs", MLM + ": '314B | 128 | 16384 | 96 | 8 | 8 | 48 | 3072 | 1536 | 474.4 | 48%'",
     mlm(96, 16384, 128), 3072, "h100-ib", 1536, {"tp": 8, "pp": 8, "zero": 1}, "bf16",
     ("model_tflops_per_gpu", 474.4), "dtype unstated"),
    ("MLM 462B, 6144 GPUs", MLM + ": '462B | 144 | 18432 | 112 | 8 | 16 | 48 | 6144 | 3072 | 459.9 | 47%'",
     mlm(112, 18432, 144), 6144, "h100-ib", 3072, {"tp": 8, "pp": 16, "zero": 1}, "bf16",
     ("model_tflops_per_gpu", 459.9), "dtype unstated"),
    ("torchtitan Llama 3.1 8B FSDP, 8 GPUs", TT + ", Table 1 (local batch 2, selective AC): '| FSDP | 5,762 | 82.4 |'",
     LLAMA31_8B, 8, H96, 16, {"tp": 1, "pp": 1, "zero": 3, "micro_batch": 2}, "bf16",
     ("tokens_per_s_per_gpu", 5762), "500 W H100, eager PyTorch"),
    ("torchtitan Llama 3.1 8B FSDP, 128 GPUs", TT + ", Table 3: '| FSDP | 5,605 | 67.0 |'", LLAMA31_8B, 128, H96, 256,
     {"tp": 1, "pp": 1, "zero": 3, "micro_batch": 2}, "bf16", ("tokens_per_s_per_gpu", 5605),
     "500 W H100, eager PyTorch"),
    ("torchtitan Llama 3.1 8B FSDP 4 x CP 2 at 64K, fp8", TT + ", Table 2 (full AC, compile, Float8): "
     "'| FSDP 4, CP 2 | 65536 | 2,540 | 84.2 |'", LLAMA31_8B[:-1] + (65536,), 8, H96, 4,
     {"tp": 1, "pp": 1, "cp": 2, "zero": 3, "micro_batch": 1, "recompute": True}, "fp8",
     ("tokens_per_s_per_gpu", 2540), "500 W H100"),
    ("torchtitan Llama 3.1 70B FSDP 32 x TP 8, fp8", TT + ", Table 4 (local batch 16, full AC): '| 2D | 829 | 71.9 |'",
     LLAMA31_70B, 256, H96, 512, {"tp": 8, "sp": True, "pp": 1, "zero": 3, "micro_batch": 16, "recompute": True,
                                  "tp_overlap": "none"}, "fp8",
     ("tokens_per_s_per_gpu", 829), "500 W H100; vanilla (DTensor) TP: its collectives exposed"),
    ("torchtitan Llama 3.1 405B FSDP 8 x TP 8 x PP 8, 1F1B, fp8", TT + ", Table 5 (full AC): '| 1F1B | 100 | 82.5 |'",
     LLAMA31_405B, 512, H96, 256, {"tp": 8, "sp": True, "pp": 8, "zero": 3, "micro_batch": 4, "recompute": True, "vpp": 1}, "fp8",
     ("tokens_per_s_per_gpu", 100), "500 W H100; async TP"),
    ("torchtitan Llama 3.1 405B FSDP 8 x TP 8 x PP 8, interleaved, fp8", TT + ", Table 5: '| Interleaved 1F1B | 128 | "
     "72.7 |'", LLAMA31_405B, 512, H96, 256, {"tp": 8, "sp": True, "pp": 8, "zero": 3, "micro_batch": 4, "recompute": True}, "fp8",
     ("tokens_per_s_per_gpu", 128), "500 W H100; async TP; virtual stages unstated (searched)"),
    ("torchtitan Llama 3 70B FSDP 32 x TP 8, bf16", TT_ASYNC + ", '70b on 256 H100s ... full AC, local batch size 16': "
     "'| None (bfloat16) | 597.3 |'", LLAMA31_70B, 256, H96, 512,
     {"tp": 8, "sp": True, "pp": 1, "zero": 3, "micro_batch": 16, "recompute": True, "tp_overlap": "none"}, "bf16",
     ("tokens_per_s_per_gpu", 597.3), "500 W H100; vanilla (DTensor) TP: its collectives exposed"),
    ("torchtitan Llama 3 8B FSDP 8 x TP 8, bf16", TT_ASYNC + ", '8b on 64 H100s ... per op SAC, local batch size 12': "
     "'| None (bfloat16) | 4378 |'", LLAMA31_8B, 64, H96, 96,
     {"tp": 8, "sp": True, "pp": 1, "zero": 3, "micro_batch": 12, "tp_overlap": "none"}, "bf16",
     ("tokens_per_s_per_gpu", 4378), "500 W H100; vanilla (DTensor) TP: its collectives exposed"),
    ("dgxc Llama 3.1 8B CP 2, 8 GPUs", DGXC24 + " llama3.1/README_8b.md '(TP=1, PP=1, CP=2, MBS=1, GA=32) ... (GBS=128)': "
     "step 12.91 s", LLAMA31_8B, 8, "h100-ib", 128,
     {"tp": 1, "pp": 1, "cp": 2, "micro_batch": 1, "zero": 1, "recompute": False}, "bf16", ("step_s", 12.91), ""),
    ("dgxc Llama 3.1 70B TP 4 x PP 4 x CP 2, 64 GPUs", DGXC24 + " llama3.1/README_70b.md '(TP=4, PP=4, CP=2, VP=5, MBS=1, "
     "GA=64) ... 64x H100 (GBS=128)': step 14.72 s", LLAMA31_70B, 64, "h100-ib", 128,
     {"tp": 4, "pp": 4, "cp": 2, "vpp": 5, "micro_batch": 1, "zero": 1, "recompute": False, "sp": True}, "bf16",
     ("step_s", 14.72), ""),
    ("dgxc Llama 3.1 70B TP 4 x PP 4 x CP 2, 2048 GPUs", DGXC24 + " llama3.1/README_70b.md, 2048x H100 (GBS=4096): "
     "step 14.98 s", LLAMA31_70B, 2048, "h100-ib", 4096,
     {"tp": 4, "pp": 4, "cp": 2, "vpp": 5, "micro_batch": 1, "zero": 1, "recompute": False, "sp": True}, "bf16",
     ("step_s", 14.98), ""),
    ("dgxc Llama 3.1 70B TP 4 x PP 4 x CP 2, fp8", DGXC24 + " llama3.1/README_70b.md FP8 '(TP=4, PP=4, CP=2, VP=5, "
     "MBS=1, GA=64)', 64x H100: step 11.01 s", LLAMA31_70B, 64, "h100-ib", 128,
     {"tp": 4, "pp": 4, "cp": 2, "vpp": 5, "micro_batch": 1, "zero": 1, "recompute": False, "sp": True}, "fp8",
     ("step_s", 11.01), "fp8 parameters"),
    ("dgxc Llama 3.1 405B TP 8 x PP 9 x CP 2, 576 GPUs", DGXC24 + " llama3.1/README_405b.md '(TP=8, PP=9, CP=2, VP=7, "
     "MBS=1, GA=63)', GBS 252: step 17.20 s", LLAMA31_405B_KV16, 576, "h100-ib", 252,
     {"tp": 8, "pp": 9, "cp": 2, "vpp": 7, "micro_batch": 1, "zero": 1, "recompute": False, "sp": True}, "bf16",
     ("step_s", 17.20), "16 key/value heads as the benchmark's yaml"),
    ("dgxc Llama 3.1 405B TP 8 x PP 9 x CP 2, fp8, 1152 GPUs", DGXC24 + " llama3.1/README_405b.md FP8, 1152x H100, GBS "
     "504: step 11.31 s", LLAMA31_405B_KV16, 1152, "h100-ib", 504,
     {"tp": 8, "pp": 9, "cp": 2, "vpp": 7, "micro_batch": 1, "zero": 1, "recompute": False, "sp": True}, "fp8",
     ("step_s", 11.31), "16 key/value heads; fp8 parameters"),
    ("dgxc Nemotron-4 15B TP 4, micro-batch 4", DGXC24 + " nemotron/README_15b.md '(TP=4, PP=1, MBS=4, GA=4) ... 64x "
     "H100 (GBS=256)': step 2.86 s", NEMOTRON_15B, 64, "h100-ib", 256,
     {"tp": 4, "pp": 1, "micro_batch": 4, "zero": 1, "recompute": False, "sp": True}, "bf16", ("step_s", 2.86),
     "squared-ReLU MLP planned as an equal-FLOP SwiGLU"),
    ("dgxc Nemotron-4 340B TP 8 x PP 8, 128 GPUs", DGXC24 + " nemotron/README_340b.md '(TP=8, PP=8, MBS=1, GA=16, VP=12) "
     "... 128x H100 (GBS=32)': step 4.61 s", NEMOTRON_340B, 128, "h100-ib", 32,
     {"tp": 8, "pp": 8, "vpp": 12, "micro_batch": 1, "zero": 1, "sp": True}, "bf16", ("step_s", 4.61),
     "squared-ReLU MLP planned as an equal-FLOP SwiGLU; selective recomputation (nothing to drop with fused attention)"),
    ("dgxc Llama 3.1 70B TP 4 x PP 8, fp8", DGXC25 + ": '| 70b | FP8 | 64 | 8192 | 80 | 4 | 8 | 1 | NA | 2 | 5 | 1 | "
     "128 | 64 |', step 9.86 s", LLAMA31_70B, 64, "h100-ib", 128,
     {"tp": 4, "pp": 8, "cp": 1, "vpp": 5, "micro_batch": 1}, "fp8", ("step_s", 9.86), ""),
    ("dgxc Llama 3.1 405B TP 8 x PP 8 x CP 2, 1024 GPUs", DGXC25 + ": '| 405b | BF16/FP8 | 1024 | 8192 | 126 | 8 | 8 | 2 "
     "| NA | 8 | 8 | 1 | 512 | 64 |', BF16 step 19.84 s", LLAMA31_405B, 1024, "h100-ib", 512,
     {"tp": 8, "pp": 8, "cp": 2, "vpp": 8, "micro_batch": 1}, "bf16", ("step_s", 19.84), ""),
    ("dgxc Nemotron-4 15B TP 2, micro-batch 2", DGXC25 + ": '| 15b | BF16/FP8 | 64 | 4096 | 32 | 2 | 1 | 1 | NA | 32 | "
     "NA | 2 | 256 | 4 |', BF16 step 2.67 s", NEMOTRON_15B, 64, "h100-ib", 256,
     {"tp": 2, "pp": 1, "cp": 1, "micro_batch": 2}, "bf16", ("step_s", 2.67),
     "squared-ReLU MLP planned as an equal-FLOP SwiGLU"),
    ("NeMo Llama 3 8B CP 2, fp8", NEMO + ": '| LLAMA3-8B | 8 | 128 | 1 | 8192 | 1 | 1 | 2 | 1 | 12273 | 711 |'",
     LLAMA31_8B, 8, "h100-ib", 128, {"tp": 1, "pp": 1, "cp": 2, "micro_batch": 1, "vpp": 1}, "fp8",
     ("tokens_per_s_per_gpu", 12273), ""),
    ("NeMo Llama 3 70B TP 4 x PP 4 x CP 2, fp8", NEMO + ": '| LLAMA3-70B | 64 | 128 | 1 | 8192 | 4 | 4 | 2 | 5 | 1524 | "
     "734 |'", LLAMA31_70B, 64, "h100-ib", 128, {"tp": 4, "pp": 4, "cp": 2, "vpp": 5, "micro_batch": 1}, "fp8",
     ("tokens_per_s_per_gpu", 1524), ""),
    ("NeMo Llama 2 70B TP 4 x PP 4, VP 20, fp8", NEMO + ": '| LLAMA2-70B | 64 | 128 | 1 | 4096 | 4 | 4 | 1 | 20 | 1728 | "
     "768 |'", LLAMA2_70B, 64, "h100-ib", 128, {"tp": 4, "pp": 4, "cp": 1, "vpp": 20, "micro_batch": 1}, "fp8",
     ("tokens_per_s_per_gpu", 1728), ""),
    ("NeMo Nemotron-4 340B TP 8 x PP 8, fp8", NEMO + ": '| Nemotron-340B | 128 | 32 | 1 | 4096 | 8 | 8 | 1 | 12 | 326 | "
     "686 |'", NEMOTRON_340B, 128, "h100-ib", 32, {"tp": 8, "pp": 8, "cp": 1, "vpp": 12, "micro_batch": 1}, "fp8",
     ("tokens_per_s_per_gpu", 326), "squared-ReLU MLP planned as an equal-FLOP SwiGLU"),
    ("NeMo Llama 2 7B at 16K, TP 2, fp8", NEMO_CP + ": 16K, 16 GPUs, TP 2, PP 1, DP 8, CP 1: 660 TFLOP/s",
     LLAMA2_7B[:-1] + (16384,), 16, "h100-ib", 8, {"tp": 2, "pp": 1, "cp": 1, "micro_batch": 1}, "fp8",
     ("model_tflops_per_gpu", 660), "global batch unstated: one sequence a data-parallel rank"),
    ("NeMo Llama 2 7B at 32K, TP 2 x CP 2, fp8", NEMO_CP + ": 32K, 32 GPUs, TP 2, PP 1, DP 8, CP 2: 610 TFLOP/s",
     LLAMA2_7B[:-1] + (32768,), 32, "h100-ib", 8, {"tp": 2, "pp": 1, "cp": 2, "micro_batch": 1}, "fp8",
     ("model_tflops_per_gpu", 610), "global batch unstated: one sequence a data-parallel rank"),
    ("NeMo Llama 2 7B at 128K, TP 4 x CP 4, fp8", NEMO_CP + ": 128K, 128 GPUs, TP 4, PP 1, DP 8, CP 4: 555 TFLOP/s",
     LLAMA2_7B[:-1] + (131072,), 128, "h100-ib", 8, {"tp": 4, "pp": 1, "cp": 4, "micro_batch": 1}, "fp8",
     ("model_tflops_per_gpu", 555), "global batch unstated: one sequence a data-parallel rank"),
    ("Megatron-Bridge Llama 3 8B FSDP, fp8", BRIDGE + ", 25.11: '| LLAMA3_8B | 8 | FP8-CS | 128 | 1 | 8192 | 8 | 1 | 1 "
     "| 1 | n/a | 1 | 16 | 14451 | 744 |'", LLAMA31_8B, 8, "h100-ib", 128,
     {"tp": 1, "pp": 1, "cp": 1, "micro_batch": 1, "zero": 3}, "fp8", ("tokens_per_s_per_gpu", 14451), ""),
    ("Megatron-Bridge Llama 3 70B TP 4 x PP 8, GBS 128, fp8", BRIDGE + ", 25.11: '| LLAMA3_70B | 64 | FP8-CS | 128 | 1 | "
     "8192 | 0 | 4 | 8 | 1 | 5 | 1 | 64 | 1602 | 719 |'", LLAMA31_70B, 64, "h100-ib", 128,
     {"tp": 4, "pp": 8, "cp": 1, "vpp": 5, "micro_batch": 1}, "fp8", ("tokens_per_s_per_gpu", 1602), ""),
    ("Megatron-Bridge Llama 3 70B TP 4 x PP 8, GBS 256, fp8", BRIDGE + ", 26.02: '| DGX-H100 | 64 | FP8 | 256 | 1 | "
     "8192 | 0 | 4 | 8 | 1 | 5 | n/a | 1621 | 728 |'", LLAMA31_70B, 64, "h100-ib", 256,
     {"tp": 4, "pp": 8, "cp": 1, "vpp": 5, "micro_batch": 1}, "fp8", ("tokens_per_s_per_gpu", 1621), ""),
    ("Megatron-Bridge Llama 3.1 405B TP 8 x PP 8 x CP 2, GBS 512, fp8", BRIDGE + ", 25.11: '| LLAMA3.1_405B | 1024 | "
     "FP8-CS | 512 | 1 | 8192 | 0 | 8 | 8 | 2 | 8 | 1 | 64 | 292 | 737 |'", LLAMA31_405B, 1024, "h100-ib", 512,
     {"tp": 8, "pp": 8, "cp": 2, "vpp": 8, "micro_batch": 1}, "fp8", ("tokens_per_s_per_gpu", 292), ""),
    ("Megatron-Bridge Llama 3.1 405B TP 8 x PP 8 x CP 2, GBS 1536, fp8", BRIDGE + ", 26.02: '| DGX-H100 | 1024 | FP8 | "
     "1536 | 1 | 8192 | 0 | 8 | 8 | 2 | 8 | n/a | 311 | 784 |'", LLAMA31_405B, 1024, "h100-ib", 1536,
     {"tp": 8, "pp": 8, "cp": 2, "vpp": 8, "micro_batch": 1}, "fp8", ("tokens_per_s_per_gpu", 311), ""),
    ("Llama 3 405B, 8,192 GPUs", LLAMA3 + ": '8,192 8 1 16 64 8,192 32 16M 430 43%'", LLAMA31_405B, 8192, "h100-ib",
     2048, {"tp": 8, "pp": 16, "cp": 1, "zero": 2, "recompute": False}, "bf16", ("model_tflops_per_gpu", 430),
     "uneven interleaving with V unstated: planned plain 1F1B (searched V needs 126 layers divisible)"),
    ("Llama 3 405B, 16,384 GPUs", LLAMA3 + ": '16,384 8 1 16 128 8,192 16 16M 400 41%'", LLAMA31_405B, 16384,
     "h100-ib", 2048, {"tp": 8, "pp": 16, "cp": 1, "zero": 2, "recompute": False}, "bf16",
     ("model_tflops_per_gpu", 400), "as above"),
    ("Llama 3 405B at 128K, CP 16, 16,384 GPUs", LLAMA3 + ": '16,384 8 16 16 8 131,072 16 16M 380 38%' (DP 8; one "
     "stored copy reads 4)", LLAMA31_405B[:-1] + (131072,), 16384, "h100-ib", 128,
     {"tp": 8, "pp": 16, "cp": 16, "zero": 2}, "bf16", ("model_tflops_per_gpu", 380),
     "all-gather context parallelism planned as a ring"),
    ("llm-foundry MPT-70B, 128 H100s", FOUNDRY + ", H100 >= 128 GPUs: '| 70b | 2048 | 128 | h100_80gb | 43.36 | 57.81 | "
     "428 | 8 | 1 | 1024 | 66 | 135490 | 1058 |'", mpt(80, 8192, 64), 128, "h100-ib", 1024,
     {"tp": 1, "pp": 1, "zero": 3, "micro_batch": 8, "recompute": True}, "bf16", ("tokens_per_s_per_gpu", 1058), ""),
    ("llm-foundry MPT-70B, 512 H100s", FOUNDRY + ": '| 70b | 2048 | 512 | h100_80gb | 41.25 | 55.0 | 408 | 8 | 1 | "
     "4096 | 251 | 515636 | 1007 |'", mpt(80, 8192, 64), 512, "h100-ib", 4096,
     {"tp": 1, "pp": 1, "zero": 3, "micro_batch": 8, "recompute": True}, "bf16", ("tokens_per_s_per_gpu", 1007), ""),
    ("llm-foundry MPT-13B, 8 H100s", FOUNDRY + ", H100: '| 13b | 2048 | 8 | h100_80gb | 39.79 | 39.79 | 393 | 2 | 1 | "
     "16 | 18 | 38336 | 4792 |'", mpt(40, 5120, 40), 8, "h100-ib", 16,
     {"tp": 1, "pp": 1, "zero": 3, "micro_batch": 2, "recompute": False}, "bf16", ("tokens_per_s_per_gpu", 4792), ""),
    ("llm-foundry MPT-7B, 8 H100s", FOUNDRY + ", H100: '| 7b | 2048 | 8 | h100_80gb | 46.44 | 46.44 | 459 | 6 | 1 | 48 "
     "| 41 | 85144 | 10643 |'", mpt(32, 4096, 32), 8, "h100-ib", 48,
     {"tp": 1, "pp": 1, "zero": 3, "micro_batch": 6, "recompute": False}, "bf16", ("tokens_per_s_per_gpu", 10643), ""),
    ("llm-foundry MPT-70B, 64 A100s", FOUNDRY + ", A100 80GB with 1600 Gbps RoCE: '| 70b | 2048 | 64 | a100_80gb | "
     "53.33 | 71.1 | 166 | 8 | 4 | 2048 | 12 | 26274 | 410 |'", mpt(80, 8192, 64), 64, "a100-ib", 2048,
     {"tp": 1, "pp": 1, "zero": 3, "micro_batch": 8, "recompute": True}, "bf16", ("tokens_per_s_per_gpu", 410), ""),
]


# memory per GPU where the source publishes it (torchtitan's tables: GiB a GPU), to compare with the plan's
MEMORY_GIB = {
    "torchtitan Llama 3.1 8B FSDP, 8 GPUs": 82.4, "torchtitan Llama 3.1 8B FSDP, 128 GPUs": 67.0,
    "torchtitan Llama 3.1 8B FSDP 4 x CP 2 at 64K, fp8": 84.2, "torchtitan Llama 3.1 70B FSDP 32 x TP 8, fp8": 71.9,
    "torchtitan Llama 3.1 405B FSDP 8 x TP 8 x PP 8, 1F1B, fp8": 82.5,
    "torchtitan Llama 3.1 405B FSDP 8 x TP 8 x PP 8, interleaved, fp8": 72.7,
}


def machine(name: str, gpus: int):
    """The preset of the run's node type, with as many nodes as the run used (a cluster file would say so)."""
    spec = load_cluster("h100-ib" if name == H96 else name)
    if name == H96:
        spec = grand_teton(spec)
    return spec.for_devices(gpus)


# The attention kernel each stack runs where it is not Transformer Engine's: torchtitan calls PyTorch's SDPA (its flash
# backend is FlashAttention-2), llm-foundry flash-attn 2 / its Triton FlashAttention ("flash attention", FOUNDRY)
FLASH2 = (TT, TT_ASYNC, FOUNDRY)


def config(shape, source: str = "") -> GPTConfig:
    family, layers, hidden, heads, kv, ffn, vocab, seq = shape
    attention = "flash2" if source.startswith(FLASH2) else "fused"
    return GPTConfig(layers, hidden, heads, seq=seq, vocab=vocab, ffn=ffn, kv_heads=kv, family=family,
                     attention=attention)


def per_device(metric: str, value: float, row) -> float:
    """A per-device throughput (higher is faster) to order runs by: a step time becomes tokens/s a device."""
    if metric != "step_s":
        return value
    cfg = config(row[2], row[1])
    return row[5] * cfg.seq / value / row[3]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    rows = []
    for row in RUNS:
        name, source, shape, gpus, mach, batch, pins, dtype, (metric, value), note = row
        start = time.perf_counter()
        out = {"run": name, "source": source, "gpus": gpus, "machine": mach, "global_batch": batch, "dtype": dtype,
               "pinned": pins, "note": note, "metric": metric, "published": value}
        if dtype == "fp8":  # torchtitan's float8 is torchao's, its default recipe tensorwise; the rest run TE's
            pins = {**pins, "fp8_recipe": "tensorwise" if name.startswith("torchtitan") else "delayed"}
        try:
            plan = plan_row(config(shape, source), machine(mach, gpus), gpus, batch, pins, dtype)
        except ConfigError as e:
            out.update(planned=False, error=str(e))
            print(f"[bench] {name}: not planned: {e}", file=sys.stderr, flush=True)
            rows.append(out)
            continue
        guess = predicted(plan, metric)
        c = plan.best
        out.update(planned=True, predicted=round(guess, 3), error_pct=round(100 * (guess - value) / value, 1),
                   predicted_step_s=round(c.step, 4),
                   plan={"mesh": c.mesh(), "micro_batch": c.b, "zero": c.zero, "recompute": c.recompute_name,
                         "memory_gib": round(c.memory / 2**30, 1), "mfu": round(plan.mfu(), 3),
                         "memory_tight": plan.tight},
                   predicted_per_device=per_device(metric, guess, row), published_per_device=per_device(
                       metric, value, row), plan_seconds=round(time.perf_counter() - start, 2))
        if name in MEMORY_GIB:
            out.update(published_memory_gib=MEMORY_GIB[name], memory_error_pct=round(
                100 * (c.memory / 2**30 - MEMORY_GIB[name]) / MEMORY_GIB[name], 1))
        print(f"[bench] {name}: published {value}, predicted {guess:.1f} ({out['error_pct']:+.1f}%)", file=sys.stderr,
              flush=True)
        rows.append(out)
    planned = [r for r in rows if r["planned"]]
    errors = sorted(abs(r["error_pct"]) for r in planned)
    summary = {"runs": len(rows), "planned": len(planned), "median_abs_error_pct": errors[len(errors) // 2],
               "max_abs_error_pct": errors[-1], "within_10_pct": sum(e <= 10 for e in errors),
               "within_25_pct": sum(e <= 25 for e in errors),
               "signed_median_error_pct": sorted(r["error_pct"] for r in planned)[len(planned) // 2]}
    memory = sorted(abs(r["memory_error_pct"]) for r in planned if "memory_error_pct" in r)
    summary["memory"] = {"runs": len(memory), "median_abs_error_pct": memory[len(memory) // 2] if memory else None,
                         "note": "published figures are the allocator's peak (reserved) on a 96 GB part; the plan's "
                                 "is what its tensors need, its recomputation as searched unless pinned"}
    summary["ordering"] = ordering(planned)
    summary["free_search"] = free_search(planned)
    out = {"rows": rows, "summary": summary}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(table(rows), file=sys.stderr)
    print(json.dumps(summary, indent=1), file=sys.stderr)


def ordering(planned: list[dict]) -> dict:
    """Pairs of runs of one job -- one source (one software stack and cluster), one model shape, sequence and dtype
    -- whose published per-device throughput differs by more than 10 %: how many the planner orders the same way."""
    shapes = {r[0]: (r[1].split(" @")[0].split(",")[0], r[2], r[7]) for r in RUNS}
    jobs: dict = {}
    for r in planned:
        jobs.setdefault(shapes[r["run"]], []).append(r)
    listed = [{"faster_published": fast["run"], "slower_published": slow["run"], "ordered_right": same}
              for runs in jobs.values()
              for fast, slow, same in ordered_pairs(runs, "published_per_device", "predicted_per_device")]
    return {"pairs_more_than_10_pct_apart": len(listed), "ordered_right": sum(p["ordered_right"] for p in listed),
            "pairs": listed}


def free_search(planned: list[dict]) -> list[dict]:
    """For each job published in several configurations (one source, model, dtype, GPU count and global batch): the
    planner's own pick, searched freely (what autopar's runtime runs, context and sequence parallelism included), against
    the published configurations as the planner predicts them -- tokens/s a GPU."""
    spec_of = {r[0]: r for r in RUNS}
    jobs: dict = {}
    for r in planned:
        row = spec_of[r["run"]]
        jobs.setdefault((row[1].split(" @")[0].split(",")[0], row[2], row[7], row[3], row[5]), []).append(r)
    out = []
    for (_, shape, dtype, gpus, batch), runs in jobs.items():
        if len(runs) < 2:
            continue
        source = spec_of[runs[0]["run"]][1]
        tokens = batch * config(shape, source).seq / gpus  # a step's tokens a GPU
        plan = plan_gpt(config(shape, source), machine(spec_of[runs[0]["run"]][4], gpus), gpus, batch, dtype)
        pinned = {r["run"]: round(tokens / r["predicted_step_s"], 1) for r in runs}
        out.append({"runs": [r["run"] for r in runs], "pinned_predicted_tokens_per_s_per_gpu": pinned,
                    "best_published": max(runs, key=lambda r: r["published_per_device"])["run"],
                    "pick": f"{plan.best.mesh()}, micro {plan.best.b}, ZeRO {plan.best.zero}, recompute "
                            f"{plan.best.recompute_name}",
                    "pick_predicted_tokens_per_s_per_gpu": round(tokens / plan.best.step, 1),
                    "pick_at_least_as_fast": tokens / plan.best.step >= max(pinned.values())})
    return out


def table(rows: list[dict]) -> str:
    """The markdown table of docs/performance.md."""
    lines = ["| run | GPUs | dtype | pinned | published | predicted | error | planned as |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pins = ", ".join(f"{k} {v}" for k, v in r["pinned"].items())
        unit = {"step_s": "s/step", "tokens_per_s_per_gpu": "tokens/s/GPU", "model_tflops_per_gpu": "TFLOP/s/GPU"}
        if not r["planned"]:
            lines.append(f"| {r['run']} | {r['gpus']} | {r['dtype']} | {pins} | {r['published']} {unit[r['metric']]} | "
                         f"not planned: {r['error'][:90]} | - | - |")
            continue
        plan = r["plan"]
        lines.append(f"| {r['run']} | {r['gpus']} | {r['dtype']} | {pins} | {r['published']} {unit[r['metric']]} | "
                     f"{r['predicted']:.4g} | {r['error_pct']:+.1f}% | {plan['mesh']}, micro {plan['micro_batch']}, "
                     f"ZeRO {plan['zero']}, recompute {plan['recompute']}"
                     + (f", {plan['memory_gib']} GiB (tight)" if plan.get("memory_tight") else "") + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
