"""A nanoGPT-style training script as its user writes it, in the mode argv[1] names -- dp, zero1, zero2, zero3,
semi_megatron (Megatron strategies by ``autopar.shard``), semi_megatron_sp (and sequence parallelism), cp (each rank
loads its slice of every sequence: context parallelism; cp_ring: attention as a ring), ep (each MLP a mixture of 4
experts, Mixtral's top-2 router, the experts spread over the ranks: expert parallelism), pipeline (2
stages, ``PipelineParallel``; pipeline_zero1: each stage's optimizer state sharded over its replicas; pipeline_tp:
each stage's attention and MLP split over 2 ranks; pipeline_cp: each stage's sequence split over 2 ranks;
pipeline_moe: the ep mode's mixture split into 2 stages, its experts whole on each rank; pipeline_ep: and spread
over each stage's replicas; pipeline_ep_zero: over groups of 2 of them, with ZeRO-1), auto -- for the dry run's tests: the same script is run simulated (``autopar launch
--dry-run``) and for real on gloo ranks.
argv: MODE [n_layer n_embd vocab block batch [eager|deferred [full_batch]]] (a tiny GPT by default, built eagerly;
deferred: ``autopar.deferred_init``, each rank materialising only what it keeps; full_batch: every rank feeds the same
``batch`` rows, Megatron's tensor-parallel contract)."""
import os
import sys

import torch
from gpt import GPT, GPTConfig
from gpt_modes import megatron, sequence_parallel, set_mode

import autopar
from autopar.models import StackedExperts


class MoE(torch.nn.Module):
    """Mixtral's sparse block in the place of the GPT's MLP: a top-2 softmax router over 4 stacked experts."""

    def __init__(self, width: int, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Linear(width, experts, bias=False)
        self.experts = StackedExperts(experts, width, 2 * width)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        weights, index = torch.softmax(self.router(h), dim=-1).topk(self.top_k, dim=-1)
        return self.experts(h, index, weights / weights.sum(dim=-1, keepdim=True)).reshape(x.shape)


mode = sys.argv[1]
sizes = [int(a) for a in sys.argv[2:7]] or [2, 256, 512, 64, 4]
n_layer, n_embd, vocab, block, batch = sizes
build = sys.argv[7] if len(sys.argv) > 7 else "eager"
autopar.communication.init()
n = autopar.communication.get_group_size()
set_mode(mode)
if sys.argv[8:9] == ["full_batch"]:
    autopar.set_auto_parallel_context(full_batch=True)
torch.manual_seed(0)
config = GPTConfig(block_size=block, vocab_size=vocab, n_layer=n_layer, n_head=max(1, n_embd // 32), n_embd=n_embd)
model = autopar.deferred_init(GPT, config) if build == "deferred" else GPT(config)
if mode in ("ep", "pipeline_moe", "pipeline_ep", "pipeline_ep_zero"):
    for layer in model.transformer.h:
        layer.mlp = MoE(n_embd)
if mode == "ep":
    autopar.shard(model, {"*.experts": "expert"})
if mode.startswith("semi_megatron"):
    megatron(model, n)
if mode == "semi_megatron_sp":
    sequence_parallel(model, n)
opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
runner = None
if mode == "pipeline":
    runner = autopar.PipelineParallel(model, None, micro_batches=2, split_points=[f"transformer.h.{n_layer // 2}"])
if mode == "pipeline_zero1":  # each stage its own gradients, its optimizer state sharded over its replicas
    runner = autopar.PipelineParallel(model, None, micro_batches=2, split_points=[f"transformer.h.{n_layer // 2}"],
                                      grads="stage", zero="level1")
if mode == "pipeline_tp":  # each stage's attention and MLP split over 2 ranks (Megatron's pairs)
    runner = autopar.PipelineParallel(model, None, micro_batches=2, split_points=[f"transformer.h.{n_layer // 2}"],
                                      grads="stage", tp=2, tensor_parallel={
                                          f"transformer.h.{i}.{m}": s for i in range(n_layer)
                                          for m, s in (("attn.c_attn", "colwise"), ("attn.c_proj", "rowwise"),
                                                       ("mlp.c_fc", "colwise"), ("mlp.c_proj", "rowwise"))})
if mode in ("pipeline_moe", "pipeline_ep"):  # the mixture split into stages, its experts whole on each rank, or
    # (pipeline_ep) spread over each stage's replicas
    runner = autopar.PipelineParallel(model, None, micro_batches=2, split_points=[f"transformer.h.{n_layer // 2}"],
                                      grads="stage", ep=n // 2 if mode == "pipeline_ep" else 1)
if mode == "pipeline_ep_zero":  # spread over groups of 2 of each stage's replicas, ZeRO-1 sharding the rest and the
    # groups' copies of the experts (8 ranks: 4 replicas a stage, 2 copies of each expert)
    runner = autopar.PipelineParallel(model, None, micro_batches=2, split_points=[f"transformer.h.{n_layer // 2}"],
                                      grads="stage", ep=2, zero="level1")
if mode == "pipeline_cp":  # each stage's sequence split over 2 ranks (context parallelism inside the stages)
    runner = autopar.PipelineParallel(model, None, micro_batches=2, split_points=[f"transformer.h.{n_layer // 2}"],
                                      grads="stage", cp=2)
tokens = block // n if mode.startswith("cp") else block  # context parallelism: this rank's slice of each sequence
for step in range(int(os.environ.get("DRYRUN_GPT_STEPS", "3"))):  # (2: the first with the optimizer state made)
    x = torch.randint(0, vocab, (batch, tokens))
    y = torch.randint(0, vocab, (batch, tokens))
    if runner is not None:
        runner.step(x, y)
    else:
        _, loss = model(x, y)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step}", flush=True)
