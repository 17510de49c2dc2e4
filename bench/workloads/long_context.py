"""Worker for ``bench/long_context.py``: a Hugging Face ``LlamaForCausalLM`` (grouped-query attention, RoPE, SDPA) in
float64 trained 3 AdamW steps with clipping on one sequence of SEQ tokens -- on one rank holding the whole sequence,
or context parallel over every rank (each loads its slice of the sequence, ``dataset_strategy``; attention as ALGO).
Writes, from rank 0, ``OUT``: the losses, the parameters after the last step (whole), and each rank's peak of tensor
memory as the dry run's storage tracker counts it (the whole run, and a training step once the optimizer state
exists), with its peak RSS.

argv: ALGO SEQ OUT (ALGO: "one" for one rank, else ring / all_gather / ulysses)"""
import json
import resource
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

import autopar
from autopar.communication import get_group_size, get_rank, init
from autopar.dryrun.tracker import StorageTracker

algo, seq, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
init()
rank, n = get_rank(), get_group_size()
torch.set_default_dtype(torch.float64)
STEPS, VOCAB = 3, 512
DATA = torch.randint(0, VOCAB, (STEPS, 1, seq), generator=torch.Generator().manual_seed(0))
if algo != "one":
    autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True,
                                      dataset_strategy=((1, n), (1, n)),
                                      context_parallel_algo=algo)
tracker = StorageTracker()
with tracker:
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=seq,
                                         attn_implementation="sdpa"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses, norms = [], []
    part = seq // n if algo != "one" else seq
    for step in range(STEPS):
        ids = DATA[step, :, rank * part:(rank + 1) * part] if algo != "one" else DATA[step]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.full_tensor() if isinstance(loss, DTensor) else loss))
params = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.named_parameters()}
mine = {"peak_bytes": tracker.peak, "step_peak_bytes": tracker.steady_peak, "parts": dict(tracker.peak_parts),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
every = [None] * n
if dist.is_initialized() and n > 1:
    dist.all_gather_object(every, mine)
else:
    every = [mine]
if rank == 0:
    torch.save(params, out + ".pt")
    with open(out, "w") as f:
        json.dump({"algo": algo, "seq": seq, "world": n, "losses": losses, "grad_norms": norms, "ranks": every}, f)
