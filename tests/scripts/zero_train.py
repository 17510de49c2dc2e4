"""Worker: optimizer sharding (enable_parallel_optimizer, ZeRO levels 1-3) trains exactly as one process.

argv: OUT_PREFIX CKPT_DIR. For levels {level1, level2, level3} x optimizers {SGD, Momentum, AdamW} x loops {a plain
torch loop with the optimizer made before the first forward, one made after it, Model.train}: the parameters after
5 steps vs one process on the global batch; the optimizer state this rank holds (elements) vs the whole; plus
gradients_mean=False (sums, MindSpore's default) and gradient accumulation under Model. Saves a sliced checkpoint
of the level3/AdamW/plain case to CKPT_DIR/rank_<r>. Writes {case: result} to OUT_PREFIX.<rank>.
"""
import json
import sys
import warnings

import numpy as np
import torch
from zero_common import OPTIMIZERS, full, state_held, train

import autopar
from autopar.communication import get_group_size, get_rank, init

out_prefix, ckpt_dir = sys.argv[1], sys.argv[2]
init()
rank, n = get_rank(), get_group_size()
rng = np.random.default_rng(0)
LOCAL = 4
X = torch.tensor(rng.standard_normal((5, LOCAL * n, 8)).astype(np.float32))
Y = torch.tensor(rng.integers(0, 5, (5, LOCAL * n)))


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)  # 5 outputs: shards of uneven size on 2 and 4 ranks
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))


def reference(opt_name: str, mean: bool = True, accumulate: int = 1) -> dict:
    autopar.reset_auto_parallel_context()  # one process's training: no mode that would parallelize it
    net = make_net()
    opt = OPTIMIZERS[opt_name](net.parameters())
    for step in range(5):
        loss = torch.nn.functional.cross_entropy(net(X[step]), Y[step]) * (1 if mean else n) / accumulate  # as Model
        loss.backward()
        if (step + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.named_parameters()}


def local(step):
    return X[step][rank * LOCAL:(rank + 1) * LOCAL], Y[step][rank * LOCAL:(rank + 1) * LOCAL]


def run(level: str, opt_name: str, loop: str, mean: bool = True, accumulate: int = 1):
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=mean,
                                      enable_parallel_optimizer=True,
                                      parallel_optimizer_config={"optimizer_level": level})
    net = make_net()
    return net, train(net, opt_name, loop, [local(s) for s in range(5)], accumulate)


def compare(net, opt, ref) -> dict:
    got = {k: full(v).detach() for k, v in net.named_parameters()}
    diff = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    held, slots = state_held(opt)
    whole = sum(p.numel() for p in ref.values()) * slots
    # a rank's share: ceil(rows / n) rows of each parameter (FSDP pads the last shards)
    share = sum(-(-p.shape[0] // n) * (p.numel() // p.shape[0]) for p in ref.values()) * slots
    return {"diff": diff, "state_held": held, "state_whole": whole, "state_share": share,
            "sharded": all(hasattr(p, "to_local") for p in net.parameters())}


results = {}
refs = {name: reference(name) for name in OPTIMIZERS}
for level in ("level1", "level2", "level3"):
    for opt_name in OPTIMIZERS:
        for loop in ("plain_before", "plain_after", "model"):
            key = f"{level}/{opt_name}/{loop}"
            try:
                net, opt = run(level, opt_name, loop)
                results[key] = compare(net, opt, refs[opt_name])
                if key == "level3/AdamW/plain_before":
                    autopar.save_checkpoint(net, f"{ckpt_dir}/rank_{rank}", integrated_save=False, optimizer=opt)
                    results[key]["saved"] = {k: full(v).detach().tolist() for k, v in net.named_parameters()}
            except Exception as exc:  # noqa: BLE001 - recorded: the test names the case
                results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
for key, kwargs, ref in (("sum/Momentum/plain_before", {"mean": False}, reference("Momentum", mean=False)),
                         ("accumulate/SGD/model", {"accumulate": 5}, reference("SGD", accumulate=5))):
    try:
        net, opt = run("level2", key.split("/")[1], key.split("/")[2], **kwargs)
        results[key] = compare(net, opt, ref)
    except Exception as exc:  # noqa: BLE001
        results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
with warnings.catch_warnings(record=True) as caught:  # a mode that does not shard says so, never silently
    warnings.simplefilter("always")
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(parallel_mode="hybrid_parallel", enable_parallel_optimizer=True)
    run_net = make_net()
    torch.nn.functional.cross_entropy(run_net(local(0)[0]), local(0)[1]).backward()
results["warns"] = {"messages": [str(w.message) for w in caught]}
json.dump(results, open(f"{out_prefix}.{rank}", "w"), indent=1)
print(f"RANK {rank} DONE", flush=True)
