"""A torchrun-style GPT script as nanoGPT's train.py and torchtitan write them, no autopar import: NCCL and one GPU per
local rank where CUDA is available (gloo and the CPU otherwise), bf16 autocast on the GPU.

argv: ddp | fsdp [compile]. ddp: the model built on the device and wrapped in ``DistributedDataParallel(model,
device_ids=[local_rank])``; fsdp: built on the meta device, ``fully_shard`` per block and on the root with a bf16
``MixedPrecisionPolicy``, then ``to_empty`` on the device and ``init_weights`` -- FSDP2's idiom. ``compile``:
``torch.compile`` the model.
"""
import os
import sys

import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig

how = sys.argv[1]
compiled = "compile" in sys.argv[2:]
cuda = torch.cuda.is_available()
dist.init_process_group(backend="nccl" if cuda else "gloo")
rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
torch.manual_seed(1337)
config = GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=4, n_embd=128)
if how == "ddp":
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = GPT(config).to(device)
    model = DDP(model, device_ids=[local_rank] if cuda else None)
else:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = GPT(config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else \
        MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
if compiled:
    model = torch.compile(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=cuda)
amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda and how == "ddp")
for step in range(3):
    x = torch.randint(0, config.vocab_size, (4, config.block_size), device=device)
    y = torch.randint(0, config.vocab_size, (4, config.block_size), device=device)
    with amp:
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
