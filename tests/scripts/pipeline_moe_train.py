"""Worker: a mixture of experts inside pipeline stages (``PipelineParallel(..., grads="stage")``) equals one process
on the global batch, in float64.

argv: OUT_PREFIX CKPT_DIR [CASES]. Without CASES, 4 ranks: 2 stages x 2 ranks a stage, their 2 ranks as 2
data-parallel replicas with ZeRO-1 or ZeRO-3 over them, or the experts spread over them (expert parallelism: each
rank 2 of the 4, each token sent to its experts' rank; also with the second rank's experts chosen by no token; also
beside ZeRO-1 and ZeRO-3), as a tensor group splitting the projections around the experts, or as a context group
splitting the sequence. With CASES (comma-separated), those of the 8-rank ones: ep over groups of 2 of a stage's 4
replicas (alone, beside ZeRO-1 and ZeRO-3: each expert's two copies split between them too), or over 2 replicas of 2 ranks beside a tensor split (with sequence parallelism or
without) or a context split. Without CASES also a tensor split with sequence parallelism around the experts. The network: two
blocks, each a column/row-split pair of projections with a residual and a top-2 mixture of 4 experts in Hugging
Face's stacked form (``autopar.models.MoEBlock``), routed unevenly by its router; the stages split between the
blocks. Each case: per-step losses and every parameter after 3 AdamW steps against one process; sliced checkpoints
reloaded onto one process. A tensor plan that names the experts, an ep that does not divide a stage's replicas and
ep with grads="full" are one line each; the layout modes' expert parallelism marked on a pipelined network is said
(the experts run whole). Writes {case: result} to OUT_PREFIX.<rank>.
"""
import json
import sys
import warnings
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import autopar
from autopar.communication import get_rank, init
from autopar.errors import ConfigError
from autopar.models.moe import MoEBlock
from autopar.parallel.pipeline.runner import PipelineParallel

out_prefix, ckpt_dir = sys.argv[1], sys.argv[2]
only = sys.argv[3].split(",") if len(sys.argv) > 3 else None  # these cases alone (8 ranks: 4 replicas a stage)
torch.set_default_dtype(torch.float64)
init()
rank = get_rank()


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)  # split by columns, then rows
        self.moe = MoEBlock(16, experts=4, ff=24, top_k=2)

    def forward(self, x):
        return self.moe(x + self.down(torch.relu(self.up(x))))


class Net(torch.nn.Module):
    def __init__(self, idle: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.b0, self.b1, self.head = torch.nn.Linear(8, 16), Block(), Block(), torch.nn.Linear(16, 5)
        if idle:  # every token's two experts among the first two: the second half of the experts takes none
            for block in (self.b0, self.b1):
                block.moe.router.register_forward_hook(lambda m, a, out: out + torch.tensor([50.0, 50.0, 0.0, 0.0]))

    def forward(self, x):
        return self.head(self.b1(self.b0(self.embed(x))))


g = torch.Generator().manual_seed(1)
X, Y = torch.randn(3, 8, 6, 8, generator=g), torch.randint(0, 5, (3, 8, 6), generator=g)
PROJECTIONS = {f"b{i}.{m}": s for i in (0, 1) for m, s in (("up", "colwise"), ("down", "rowwise"))}
SEQUENCE = {**PROJECTIONS, "b0.moe.norm": "sequence", "b1.moe.norm": "sequence"}
# ep: the experts spread over a stage's 2 replicas (each rank 2 of the 4; tokens sent to their experts' rank);
# ep_idle: and the second rank's experts chosen by no token
CASES = {"zero1": {"zero": "level1"}, "zero3": {"zero": "level3"}, "tp": {"tp": 2, "tensor_parallel": PROJECTIONS},
         "cp": {"cp": 2}, "ep": {"ep": 2}, "ep_idle": {"ep": 2}, "ep_zero1": {"ep": 2, "zero": "level1"},
         "ep_zero3": {"ep": 2, "zero": "level3"},
         # on 8 ranks (4 replicas a stage): the experts spread over each group of 2 replicas, a copy on each group
         # (under ZeRO each group's copy of an expert split over the groups too: ZeRO's shards of the copies)
         "ep_groups": {"ep": 2}, "ep_groups_zero1": {"ep": 2, "zero": "level1"},
         "ep_groups_zero3": {"ep": 2, "zero": "level3"},
         # on 8 ranks (2 replicas of 2 ranks a stage): the experts spread over the replicas beside a tensor split of
         # the projections around them, or beside a context split of the sequence (each rank its own tokens)
         "ep_tp": {"ep": 2, "tp": 2, "tensor_parallel": PROJECTIONS}, "ep_cp": {"ep": 2, "cp": 2},
         # Megatron's sequence parallelism around the experts: the MoEs' norms (and what follows them up to the next
         # column split) on each rank's half of the sequence, the tokens the experts take a strided split of the
         # flattened batch -- their weights' gradients partial sums over the tensor group (4 ranks: tp_seq; 8 ranks:
         # beside the experts spread over the replicas, ep_seq)
         "tp_seq": {"tp": 2, "tensor_parallel": SEQUENCE}, "ep_seq": {"ep": 2, "tp": 2, "tensor_parallel": SEQUENCE}}
EIGHT_RANKS = {"ep_groups", "ep_groups_zero1", "ep_groups_zero3", "ep_tp", "ep_cp", "ep_seq"}  # (with 4 replicas or 2 of 2 ranks)
CASES = {k: v for k, v in CASES.items() if (only is None and k not in EIGHT_RANKS) or (only and k in only)}


def loss_fn(out, y):
    return torch.nn.functional.cross_entropy(out.reshape(-1, 5), y.reshape(-1))


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def reference(idle: bool):
    ref, losses = Net(idle), []
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    routed = torch.zeros(4)
    for step in range(len(X)):
        h = ref.b0.moe.norm(ref.embed(X[step]) + 0).reshape(-1, 16)  # the first router's choices
        routed += torch.bincount(ref.b0.moe.router(h).topk(2, dim=-1).indices.flatten(), minlength=4).double()
        loss = loss_fn(ref(X[step]), Y[step])
        losses.append(float(loss))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: p.detach() for k, p in ref.named_parameters()}, losses, routed.tolist()


REFS = {idle: reference(idle) for idle in (False, True)}
results = {"routed": REFS[False][2], "routed_idle": REFS[True][2]}
for key, kwargs in CASES.items():
    want, ref_losses, _ = REFS[key == "ep_idle"]
    try:
        net = Net(key == "ep_idle")
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        runner = PipelineParallel(net, loss_fn, 2, ["b1"], grads="stage", **kwargs)
        rows = slice(runner.replica * 8 // runner.replicas, (runner.replica + 1) * 8 // runner.replicas)
        losses = []
        for step in range(len(X)):
            losses.append(float(runner.step(X[step, rows], Y[step, rows])))
            opt.step()
            opt.zero_grad()
        sliced = None
        experts = {n: list(p.to_local().shape) for n, p in runner.stage_module.named_parameters()
                   if getattr(p, "_autopar_spread", False)}  # each rank's share of its stage's experts
        # the optimizer's state of the experts on this rank (AdamW's exp_avg): the share it steps
        states = {n: list(opt.state[p]["exp_avg"].to_local().shape) for n, p in runner.stage_module.named_parameters()
                  if getattr(p, "_autopar_spread", False) and p in opt.state}
        # the rest of the stage: ZeRO's shards (FSDP2's DTensors over the replicas), or whole
        shards = sum(isinstance(p, DTensor) for p in runner.stage_module.parameters()
                     if not getattr(p, "_autopar_spread", False))
        if key in ("zero1", "ep", "ep_zero1", "ep_groups", "ep_groups_zero1", "ep_tp"):  # each rank's shards, reloaded onto one process
            autopar.save_checkpoint(net, f"{ckpt_dir}/{key}_sliced_{rank}", integrated_save=False)
            torch.distributed.barrier()
            plain = Net()
            autopar.load_distributed_checkpoint(plain, sorted(str(p) for p in Path(ckpt_dir).glob(f"{key}_sliced_*")))
            sliced = max(float((p.detach() - want[k]).abs().max()) for k, p in plain.named_parameters())
        runner.gather_parameters()
        results[key] = {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)) if runner.replicas == 1
                        else None,
                        "param_diff": max(float((whole(p) - want[k]).abs().max()) for k, p in net.named_parameters()),
                        "stage": runner.stage_index, "sliced_diff": sliced, "experts": experts, "shards": shards,
                        "expert_states": states,
                        "sync": runner.gradient_sync}
    except Exception as exc:  # noqa: BLE001 - recorded: the test names the case
        import traceback

        results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "trace": traceback.format_exc()[-1500:]}

for case, kwargs in () if only else (("split_experts", {"tp": 2, "tensor_parallel": {"b0.moe.experts": "colwise"}}),
                     ("ep_uneven", {"ep": 3}), ("ep_full", {"ep": 2, "grads": "full"})):  # one line each
    try:
        PipelineParallel(Net(), loss_fn, 2, ["b1"], **{"grads": "stage", **kwargs})
        results[case] = "no error"
    except ConfigError as exc:
        results[case] = str(exc)
if not only:
    marked = Net()  # the layout modes' expert parallelism marked, then pipelined: said, the experts whole
    autopar.shard(marked, {"*.experts": "expert"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PipelineParallel(marked, loss_fn, 2, ["b1"], grads="stage")
    results["marked"] = [str(w.message) for w in caught]
json.dump(results, open(f"{out_prefix}.{rank}", "w"), indent=1)
print(f"RANK {rank} DONE", flush=True)
