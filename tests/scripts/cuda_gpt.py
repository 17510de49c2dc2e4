"""A nanoGPT-style training loop on the GPU path, as its user writes it for a cluster (torchrun style: the
device from LOCAL_RANK, ``.cuda()``, NCCL, ``torch.autocast("cuda")``, fused AdamW, ``GradScaler`` for fp16) -- for
the fake-CUDA dry run's tests (``autopar launch --dry-run --dry-run-device cuda``) and for a real GPU.
argv: MODE [fp32|bf16|fp16] [mixup] [llama]; MODE as dryrun_gpt.py: dp, zero1, zero2, zero3, semi_megatron,
pipeline, auto. ``mixup``: the batch stays on the host (the mistake a GPU run meets at its first step). ``llama``: a
tiny Hugging Face ``LlamaForCausalLM`` (SDPA attention, GQA, RoPE) called as its users call it, ``labels=``, in
place of the GPT (megatron: its projections split as Megatron splits them; no pipeline)."""
import contextlib
import os
import sys

import torch
from gpt import GPT, GPTConfig
from gpt_modes import GPT_COLUMNS, GPT_ROWS, megatron, set_mode

import autopar

mode = sys.argv[1]
precision = sys.argv[2] if len(sys.argv) > 2 else "fp32"
mixup = "mixup" in sys.argv[3:]
llama = "llama" in sys.argv[3:]
local_rank = int(os.environ.get("LOCAL_RANK", 0))
torch.cuda.set_device(local_rank)
device = torch.device("cuda", local_rank)
autopar.communication.init("nccl")
n = autopar.communication.get_group_size()
set_mode(mode)
torch.manual_seed(0)
torch.cuda.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = True
vocab, block, batch = 512, 64, 4
if llama:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=block,
                                         attn_implementation="sdpa")).cuda()
    columns, rows = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")
else:
    model = GPT(GPTConfig(block_size=block, vocab_size=vocab, n_layer=2, n_head=8, n_embd=256)).cuda()
    columns, rows = GPT_COLUMNS, GPT_ROWS
if mode == "semi_megatron":
    megatron(model, n, columns, rows)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), fused=True)
runner = None
if mode == "pipeline":
    runner = autopar.PipelineParallel(model, None, micro_batches=2, split_points=["transformer.h.1"])
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
amp = torch.autocast("cuda", dtype=dtype) if dtype else contextlib.nullcontext()
scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16" and runner is None)  # a schedule scales nothing
for step in range(3):
    x = torch.randint(0, vocab, (batch, block))
    y = torch.randint(0, vocab, (batch, block))
    if not mixup:
        x, y = x.to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    if runner is not None:
        with amp:
            runner.step(x, y)
    else:
        with amp:
            loss = model(input_ids=x, labels=y).loss if llama else model(x, y)[1]
        scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    if local_rank == 0:
        print(f"step {step}: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB on {torch.cuda.get_device_name()}",
              flush=True)
