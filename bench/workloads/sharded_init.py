"""Worker for ``bench/sharded_init.py``: a nanoGPT-like GPT built eagerly (whole on every rank, then sharded) or under
``autopar.deferred_init`` (each rank makes only its shards), SGD, a few steps, in ZeRO-3 or in AUTO_PARALLEL with a
device memory that data parallel does not fit (``MAX_DEVICE_MEMORY``: the plan must split; a meta-built network is
planned without being made). Prints one ``BENCH {...}`` line per rank: peak RSS at three points (after the build,
after the first step -- setting up done -- and at the end), the network's full parameter bytes, and the seconds to
build and to the first step's end.

With ``$BENCH_RANK_MEMORY_BYTES`` the rank first moves itself into a memory cgroup of that limit
(``bench/rank_memory.py``): the kernel kills it if it needs more.

argv: BUILD LAYERS HIDDEN VOCAB SEQ STEPS [MODE [MAX_DEVICE_MEMORY]]"""
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rank_memory  # noqa: E402

capped = rank_memory.join_capped()  # before torch: the interpreter's own memory counts against the cap
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "scripts"))
from gpt import GPT, GPTConfig  # noqa: E402

import autopar  # noqa: E402
from autopar.communication import get_group_size, get_rank, init  # noqa: E402

build, layers, hidden, vocab, seq, steps = sys.argv[1], *map(int, sys.argv[2:7])
mode = sys.argv[7] if len(sys.argv) > 7 else "zero3"
init()
rank, n = get_rank(), get_group_size()
if mode == "auto":
    autopar.set_auto_parallel_context(parallel_mode="auto_parallel", gradients_mean=True,
                                      max_device_memory=sys.argv[8])
else:
    autopar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True,
                                      enable_parallel_optimizer=True,
                                      parallel_optimizer_config={"optimizer_level": "level3"})


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


config = GPTConfig(block_size=seq, vocab_size=vocab, n_layer=layers, n_head=max(1, hidden // 64), n_embd=hidden)
torch.manual_seed(0)
t0 = time.perf_counter()
model = autopar.deferred_init(GPT, config) if build == "deferred" else GPT(config)
built_s, after_build = time.perf_counter() - t0, rss_mib()
full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(rank)
for step in range(steps):
    x = torch.randint(0, vocab, (1, seq), generator=g)
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step == 0:
        first_step_s, after_first = time.perf_counter() - t0, rss_mib()
        first_end = time.perf_counter()
steady_s = (time.perf_counter() - first_end) / (steps - 1) if steps > 1 else float("nan")
from autopar.parallel.state import state_of  # noqa: E402
from autopar.parallel.summary import describe  # noqa: E402

plan = describe(state_of(model), model) if state_of(model) is not None else mode
print("BENCH " + json.dumps({"rank": rank, "world": n, "build": build, "full_param_mib": full_bytes / 2**20,
                             "rss_after_build_mib": after_build, "rss_after_first_step_mib": after_first,
                             "rss_peak_mib": rss_mib(), "build_s": built_s, "to_first_step_s": first_step_s,
                             "steady_step_s": steady_s,
                             "loss": float(loss), "mode": mode, "plan": plan, "capped": capped is not None}),
      flush=True)
