"""Worker: every training loop a user writes trains exactly, in every parallel mode, with no call to autopar in it.

argv: OUT_PREFIX MODES_JSON. For each mode (data, semi_megatron, semi_redistribute, auto, hybrid) x loop (torch,
train_one_step, value_and_grad, model) x optimizer (sgd, momentum, adamw_cosine, sgd_clip; in the torch loop also loss scaling by torch's GradScaler:
sgd_scaled unscales and clips, adamw_scaled is fused AdamW): 5 steps on global
batches split over the ranks (hybrid: the same batch on every rank, its layerwise weights sliced), compared with
one process training the same network on the global batches: the largest parameter difference. The loss rotates
through a function, a lambda, a torch Module and an autopar Cell; optimizers are made before the first forward
(odd cases: after it). Per mode also: ``zero_grad(set_to_none=False)``, ``torch.no_grad()`` evaluation, the
``state_dict`` round trip (full tensors), and a checkpoint written from the plain loop that resumes bit-identically.
Writes {case: result} to OUT_PREFIX.<rank>.
"""
import json
import sys
import traceback

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import autopar
import autopar.nn as nn
import autopar.ops as ops
from autopar.communication import get_group_size, get_rank, init
from autopar.train import Callback, Model

out_prefix, modes = sys.argv[1], json.loads(sys.argv[2])
init()
rank, n = get_rank(), get_group_size()
STEPS, GLOBAL = 5, 8
rng = np.random.default_rng(0)
X = torch.tensor(rng.standard_normal((STEPS, GLOBAL, 16)).astype(np.float32))
Y = torch.tensor(rng.integers(0, 6, (STEPS, GLOBAL)))


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(32, 6)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class HybridMLP(nn.Cell):
    """The MLP with this rank's slice of the hidden layer (layerwise_parallel) and an explicit AllReduce."""

    def __init__(self, full: MLP):
        super().__init__()
        cols = slice(rank * 32 // n, (rank + 1) * 32 // n)
        self.w1 = autopar.Parameter(full.fc1.weight.detach()[cols].T.clone(), layerwise_parallel=True)
        self.b1 = autopar.Parameter(full.fc1.bias.detach()[cols].clone(), layerwise_parallel=True)
        self.w2 = autopar.Parameter(full.fc2.weight.detach()[:, cols].T.clone(), layerwise_parallel=True)
        self.b2 = autopar.Parameter(full.fc2.bias.detach().clone())
        self.mm1, self.mm2, self.relu = ops.MatMul(), ops.MatMul(), ops.ReLU()
        self.allreduce = ops.AllReduce()

    def construct(self, x):
        return self.allreduce(self.mm2(self.relu(self.mm1(x, self.w1) + self.b1), self.w2)) + self.b2

    def gathered(self) -> dict:
        def cat(t, dim):
            parts = [torch.empty_like(t) for _ in range(n)]
            torch.distributed.all_gather(parts, t.detach().contiguous())
            return torch.cat(parts, dim)

        return {"fc1.weight": cat(self.w1, 1).T, "fc1.bias": cat(self.b1, 0), "fc2.weight": cat(self.w2, 0).T,
                "fc2.bias": self.b2.detach()}


def base() -> MLP:
    torch.manual_seed(0)
    return MLP()


def make(mode: str) -> torch.nn.Module:
    net = base()
    if mode == "semi_megatron":
        autopar.shard(net.fc1, ((1, 1), (n, 1)))  # fc1's output features split
        autopar.shard(net.fc2, ((1, n), (1, n)))  # fc2's input features split: partial sums reduced
    elif mode == "semi_redistribute":
        autopar.shard(net.fc1, ((1, 1), (n, 1)))  # output features split ...
        autopar.shard(net.fc2, ((n, 1), (1, 1)))  # ... then batch split: a redistribution between them
    elif mode == "hybrid":
        return HybridMLP(net)
    return net


def full_params(net) -> dict:
    if isinstance(net, HybridMLP):
        return net.gathered()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in net.named_parameters()}


def ce(logits, y):
    return F.cross_entropy(logits, y)


LOSSES = [("function", lambda: ce), ("lambda", lambda: (lambda lg, y: F.cross_entropy(lg, y))),
          ("module", lambda: torch.nn.CrossEntropyLoss()),
          ("cell", lambda: nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))]


def optimizer(kind: str, params, mindspore_door: bool):
    params = list(params)
    if kind == "adamw_scaled":  # fused: GradScaler checks for inf without unscaling, the step unscales
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, eps=1e-6, fused=True), None
    if kind in ("sgd", "sgd_clip", "sgd_scaled"):
        return (nn.SGD(params, 0.1) if mindspore_door else torch.optim.SGD(params, lr=0.1)), None
    if kind == "momentum":
        return nn.Momentum(params, 0.1, 0.9), None
    opt = (nn.AdamWeightDecay(params, 0.01, weight_decay=0.1) if mindspore_door
           else torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, eps=1e-6))
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)


def local(step: int, mode: str):
    if mode == "hybrid":  # the network's own AllReduce sums the ranks' partial results of the same samples
        return X[step], Y[step]
    rows = slice(rank * GLOBAL // n, (rank + 1) * GLOBAL // n)
    return X[step][rows], Y[step][rows]


def reference(opt_kind: str, loop: str) -> dict:
    autopar.set_auto_parallel_context(parallel_mode="stand_alone")
    net = base()
    opt, sched = optimizer(opt_kind, net.parameters(), loop == "value_and_grad")
    for step in range(STEPS):
        loss = F.cross_entropy(net(X[step]), Y[step])
        opt.zero_grad()
        loss.backward()
        if opt_kind in ("sgd_clip", "sgd_scaled") and loop == "torch":
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()
        if sched:
            sched.step()
    return {k: v.detach() for k, v in net.named_parameters()}


def set_mode(mode: str) -> None:
    autopar.reset_auto_parallel_context()
    name = {"data": "data_parallel", "auto": "auto_parallel", "hybrid": "hybrid_parallel"}.get(mode,
                                                                                               "semi_auto_parallel")
    autopar.set_auto_parallel_context(parallel_mode=name, gradients_mean=True)


class StepScheduler(Callback):
    def __init__(self, sched):
        self.sched = sched

    def on_train_step_end(self, run_context):
        self.sched.step()


def run_case(mode: str, loop: str, opt_kind: str, loss_fn, late_optimizer: bool) -> float:
    set_mode(mode)
    net = make(mode)
    door = loop in ("value_and_grad", "train_one_step")
    opt = sched = None
    if not late_optimizer:
        opt, sched = optimizer(opt_kind, net.parameters(), door)
    if loop == "model":
        if opt is None:
            opt, sched = optimizer(opt_kind, net.parameters(), door)
        data = [local(step, mode) for step in range(STEPS)]
        Model(net, loss_fn, opt).train(1, data, callbacks=[StepScheduler(sched)] if sched else None)
        return full_params(net)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(STEPS):
        x, y = local(step, mode)
        if loop == "torch":
            loss = loss_fn(net(x), y)
            if opt is None:  # made after the first forward
                opt, sched = optimizer(opt_kind, net.parameters(), door)
            opt.zero_grad(set_to_none=step % 2 == 0)
            if opt_kind.endswith("_scaled"):  # loss scaling by a power of two: the same numbers as without it
                scaler.scale(loss).backward()
                if opt_kind == "sgd_scaled":  # the AMP recipe: unscale, clip, step
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
                scaler.step(opt)
                scaler.update()
                continue
            loss.backward()
            if opt_kind == "sgd_clip":
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            opt.step()
        elif loop == "train_one_step":
            if opt is None:
                with torch.no_grad():
                    net(x)  # a first forward (an evaluation) before the optimizer exists
                opt, sched = optimizer(opt_kind, net.parameters(), door)
            step_cell = nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), opt)
            step_cell.set_train()
            step_cell(x, y)
        else:
            if opt is None:
                with torch.no_grad():
                    net(x)
                opt, sched = optimizer(opt_kind, net.parameters(), door)
            grad_fn = autopar.value_and_grad(nn.WithLossCell(net, loss_fn), None, opt.parameters)
            loss, grads = grad_fn(x, y)
            opt(grads)
        if sched:
            sched.step()
    return full_params(net)


def worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def extras(mode: str) -> dict:
    """no_grad evaluation, state_dict round trip, checkpoint resume from a plain loop."""
    out = {}
    ref_net = base()
    set_mode(mode)
    net = make(mode)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = local(step, mode)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    autopar.set_auto_parallel_context(parallel_mode="stand_alone")
    ref_opt = torch.optim.SGD(ref_net.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        ref_opt.zero_grad()
        F.cross_entropy(ref_net(X[step]), Y[step]).backward()
        ref_opt.step()
    x, _ = local(3, mode)
    with torch.no_grad():  # the reference evaluates stand-alone: in a layout mode its first call would lay it out
        ref_out = ref_net(x)
    set_mode(mode)
    with torch.no_grad():
        out["no_grad_eval"] = (net(x) - ref_out).abs().max().item()
    if mode != "hybrid":
        sd = net.state_dict()
        out["state_dict_full"] = all(type(v) is torch.Tensor for v in sd.values())
        out["state_dict_vs_ref"] = worst(dict(sd), {k: v.detach() for k, v in ref_net.state_dict().items()})
        net.load_state_dict(sd)
        out["state_dict_reload"] = worst(full_params(net), {k: v.detach() for k, v in ref_net.named_parameters()})
        # resume: 3 steps, save with the optimizer, 2 more; vs a fresh network + optimizer loaded from the file
        ckpt = f"{out_prefix}.{mode}.resume.ckpt"  # integrated: every rank saves the same full tensors
        autopar.save_checkpoint(net, ckpt + (f".{rank}" if rank else ""), optimizer=opt)
        torch.distributed.barrier()
        net2 = make(mode)
        opt2 = torch.optim.SGD(net2.parameters(), lr=0.1, momentum=0.9)
        autopar.load_checkpoint(ckpt, net2, optimizer=opt2)
        for step in (3, 4):
            x, y = local(step, mode)
            for m, o in ((net, opt), (net2, opt2)):
                loss = F.cross_entropy(m(x), y)
                o.zero_grad()
                loss.backward()
                o.step()
        out["resume_bitwise"] = worst(full_params(net), full_params(net2))
    return out


def errors() -> dict:
    """What cannot work fails at its first step with one line saying what to do."""
    out = {}
    set_mode("semi_megatron")
    net = make("semi_megatron")
    stray = torch.nn.Parameter(torch.ones(3))
    try:
        autopar.value_and_grad(nn.WithLossCell(net, ce), None, [stray])(*local(0, "data"))
    except autopar.AutoparError as exc:
        out["unused_weights"] = str(exc)
    opt = nn.SGD(net.parameters(), 0.1)
    try:
        opt([torch.zeros(1)])
    except autopar.AutoparError as exc:
        out["gradient_count"] = str(exc)
    layered = make("semi_megatron")
    layered.fc2.bias.layerwise_parallel = True
    try:
        layered(local(0, "data")[0])
    except autopar.AutoparError as exc:
        out["layerwise_in_semi_auto"] = str(exc)
    return out


results = {"errors": errors()}
LOOPS = ["torch", "train_one_step", "value_and_grad", "model"]
OPTS = ["sgd", "momentum", "adamw_cosine", "sgd_clip", "sgd_scaled", "adamw_scaled"]
k = 0
for mode in modes:
    for loop in LOOPS:
        for opt_kind in OPTS:
            if opt_kind in ("sgd_clip", "sgd_scaled") and (loop != "torch" or mode == "hybrid"):
                # clipping is a line of the user's own loop, the other loops have no place for it; in HYBRID the
                # layerwise slices are plain tensors whose norm torch takes per rank (docs/any-loop.md: HYBRID_PARALLEL)
                continue
            if opt_kind == "adamw_scaled" and loop != "torch":  # torch's GradScaler: a line of the user's loop
                continue
            loss_name, loss_factory = LOSSES[k % len(LOSSES)]
            key = f"{mode}/{loop}/{opt_kind}/{loss_name}"
            try:
                got = run_case(mode, loop, opt_kind, loss_factory(), late_optimizer=k % 2 == 1)
                results[key] = {"param": worst(got, reference(opt_kind, loop))}
            except Exception as exc:  # noqa: BLE001 - recorded, the test names the case
                results[key] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
            k += 1
    try:
        results[f"{mode}/extras"] = extras(mode)
    except Exception as exc:  # noqa: BLE001
        results[f"{mode}/extras"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
json.dump(results, open(f"{out_prefix}.{rank}", "w"), indent=1)
print(f"RANK {rank} DONE {len(results)} cases", flush=True)
