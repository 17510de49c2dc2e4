"""Worker: expert parallelism on a mixture-of-experts network written as its users write one (a top-2 router, the
experts' weights stacked ``[num_experts, ...]`` in Hugging Face's form, the load-balancing auxiliary loss of Switch /
Mixtral added to the task loss inside ``forward``, as Hugging Face's MoE models do), float64, AdamW with clipping, 3 steps -- against one process on the same global
batches. The router is skewed so that routing is uneven and expert 0 receives no token at all.

Cases: ``ep`` (the experts over every rank: 8 experts on 2 or 4; its sliced checkpoint read back whole into one
process), ``ep_zero3`` (with ZeRO-3), ``ep_tp`` (with the
router's input projection split by columns and its output projection by rows), ``ep_seq`` (Megatron's
sequence parallelism beside the experts -- a column- then a row-split projection, a norm on each rank's slice of the
sequence, the experts' tokens the flattened slices), ``ms_moe`` (the MindSpore door:
``nn.transformer.MoE`` with ``MoEConfig`` and ``MoEParallelConfig(expert_parallel=n)``, tokens over capacity
dropped as one process drops them); ``..._ep2`` (4 ranks: the experts over groups of 2 consecutive ranks --
``("expert", 2)`` / ``expert_parallel=2`` -- the groups replicas of each other); mistakes -- experts the ranks do not
divide, ``"expert"`` on a module that is not stacked by expert.

argv: OUT_PREFIX CASES_JSON. Writes {case: {...}} to OUT_PREFIX.<rank>.
"""
import json
import sys
import traceback

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import autopar
from autopar.communication import get_group_size, get_rank, init

out_prefix, cases = sys.argv[1], json.loads(sys.argv[2])
init()
rank, n = get_rank(), get_group_size()
torch.set_default_dtype(torch.float64)
STEPS, GLOBAL, SEQ, D, HIDDEN, TOP_K = 3, 8, 4, 16, 24, 2
X = torch.randn(STEPS, GLOBAL, SEQ, D, generator=torch.Generator().manual_seed(0))
Y = torch.randn(STEPS, GLOBAL, SEQ, D, generator=torch.Generator().manual_seed(1))


class Experts(torch.nn.Module):
    """Stacked experts as transformers writes them: each token's chosen experts, weighted and summed."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up = torch.nn.Parameter(torch.randn(num_experts, 2 * HIDDEN, D) * 0.2)
        self.down = torch.nn.Parameter(torch.randn(num_experts, D, HIDDEN) * 0.2)

    received: list[int] = []  # the tokens each call ran over (on this rank)

    def forward(self, hidden, top_k_index, top_k_weights):
        Experts.received.append(hidden.shape[0])
        out = torch.zeros_like(hidden)
        mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)  # + a "no expert" slot
        for e in range(self.num_experts):
            slot, token = torch.where(mask[e])
            if token.numel() == 0:
                continue
            gate, up = F.linear(hidden[token], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y)
        return out


class MoE(torch.nn.Module):
    def __init__(self, num_experts: int = 8, sequence: bool = False):
        super().__init__()
        self.proj_in = torch.nn.Linear(D, D)
        if sequence:  # a row-split projection after proj_in, then a norm the sequence splits (Megatron's SP)
            self.mix, self.norm = torch.nn.Linear(D, D), torch.nn.LayerNorm(D)
        self.router = torch.nn.Linear(D, num_experts)
        self.experts = Experts(num_experts)
        self.proj_out = torch.nn.Linear(D, D)
        with torch.no_grad():
            self.router.weight[0] = 0.0
            self.router.bias[0] = -100.0  # expert 0 is never chosen
            self.router.bias[1] = 1.0  # expert 1 is chosen often

    def forward(self, x, y):
        b, s, d = x.shape
        h = self.proj_in(x)
        if hasattr(self, "norm"):
            h = self.norm(self.mix(torch.relu(h)))
        h = h.reshape(-1, d)
        logits = self.router(h)
        probs = logits.softmax(dim=-1)
        weights, index = probs.topk(TOP_K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(h, index, weights)
        # Switch / Mixtral load balancing: experts' token fractions times their mean router probabilities
        fraction = F.one_hot(index, logits.shape[-1]).to(probs.dtype).mean(dim=(0, 1))
        aux = logits.shape[-1] * (fraction * probs.mean(dim=0)).sum()
        return F.mse_loss(self.proj_out(out.reshape(b, s, d)), y) + 0.01 * aux


class MindSporeMoE(autopar.nn.Cell):
    """The MindSpore door: ``nn.transformer.MoE`` with ``MoEConfig`` (capacity 1.0: tokens beyond an expert's
    capacity are dropped) and ``MoEParallelConfig(expert_parallel=n)``; its auxiliary loss added to the task loss."""

    def __init__(self, expert_parallel: int):
        super().__init__()
        from autopar.nn.transformer import MoE as MsMoE
        from autopar.nn.transformer import MoEConfig, MoEParallelConfig

        self.dense_in = autopar.nn.Dense(D, D, dtype=torch.float64)
        self.moe = MsMoE(D, HIDDEN, hidden_act="gelu", param_init_type=torch.float64, moe_config=MoEConfig(
            expert_num=8, capacity_factor=1.0, aux_loss_factor=0.05, num_experts_chosen=2),
            parallel_config=MoEParallelConfig(expert_parallel=expert_parallel))
        self.dense_out = autopar.nn.Dense(D, D, dtype=torch.float64)

    def construct(self, x, y):
        out, aux = self.moe(self.dense_in(x))
        return ((self.dense_out(out) - y) ** 2).mean() + aux


def fresh(num_experts: int = 8, door: str = "torch", expert_parallel: int = 1, sequence: bool = False):
    if door == "mindspore":
        torch.manual_seed(3)
        return MindSporeMoE(expert_parallel)
    torch.manual_seed(2)
    return MoE(num_experts, sequence)


def train(model, rows):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        model(X[step, rows], Y[step, rows]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.named_parameters()}


def routed(model) -> list[int]:
    """Tokens each expert received in the first step (whole batch), as one process routes them."""
    with torch.no_grad():
        h = model.proj_in(X[0]).reshape(-1, D)
        index = model.router(h).softmax(-1).topk(TOP_K, dim=-1)[1]
    return torch.bincount(index.flatten(), minlength=model.experts.num_experts).tolist()


def set_mode(case: str) -> None:
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True)
    if "zero3" in case:
        autopar.set_auto_parallel_context(enable_parallel_optimizer=True,
                                          parallel_optimizer_config={"optimizer_level": "level3"})


def run(case: str) -> dict:
    set_mode(case)
    ep = 2 if case.endswith("_ep2") else n  # experts over groups of 2 ranks, the groups replicas (4 ranks)
    if case.startswith("ms_moe"):
        model = fresh(door="mindspore", expert_parallel=ep)
        got = train(model, slice(rank * GLOBAL // n, (rank + 1) * GLOBAL // n))
        return {"param": max((got[k] - REF_MS[k]).abs().max().item() for k in REF_MS),
                "local_experts": model.moe.experts.mapping.to_local().shape[0], "dropped": model.moe.dropped,
                "dropped_one": DROPPED_MS}
    model = fresh(sequence=case == "ep_seq")
    autopar.shard(model, {"experts": ("expert", ep) if ep < n else "expert"})
    if case == "ep_tp":
        autopar.shard(model, {"proj_in": "colwise", "proj_out": "rowwise"})
    if case == "ep_seq":  # Megatron's sequence parallelism beside the experts: the norm on each rank's slice of the
        # sequence, the experts' tokens the flattened slices
        autopar.shard(model, {"proj_in": "colwise", "mix": "rowwise", "norm": "sequence"})
    want = REF_SEQ if case == "ep_seq" else REF
    placed = []  # where the experts' tokens lie (ep_seq: the flattened sequence split, a strided split of them)
    if case == "ep_seq":
        model.experts.register_forward_pre_hook(lambda m, args: placed.append(
            type(args[0].placements[0]).__name__ if isinstance(args[0], DTensor) else "plain"))
    Experts.received.clear()
    got = train(model, slice(rank * GLOBAL // n, (rank + 1) * GLOBAL // n))
    local = model.experts.gate_up.to_local().shape[0] if isinstance(model.experts.gate_up, DTensor) else None
    result = {"param": max((got[k] - want[k]).abs().max().item() for k in want), "local_experts": local,
              "received": Experts.received[0], "tokens": placed[:1]}
    if case == "ep":  # each rank's slices saved, read back whole into one process
        autopar.save_checkpoint(model, f"{out_prefix}.{case}_{rank}", integrated_save=False)
        torch.distributed.barrier()
        autopar.reset_auto_parallel_context()
        with autopar.context.managed():
            one = fresh()
            autopar.load_distributed_checkpoint(one, [f"{out_prefix}.{case}_{r}.ckpt" for r in range(n)])
        result["reload"] = max((p.detach() - REF[k]).abs().max().item() for k, p in one.named_parameters())
    return result


def mistake(case: str) -> dict:
    set_mode("ep")
    try:
        if case == "indivisible":
            model = fresh(num_experts=2 * n + 1)
            autopar.shard(model, {"experts": "expert"})
            model(X[0, :2], Y[0, :2])
        else:
            autopar.shard(fresh(), {"proj_in": "expert"})
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


autopar.reset_auto_parallel_context()
with autopar.context.managed():  # one process on the global batches
    ROUTED = routed(fresh())
    REF = train(fresh(), slice(0, GLOBAL))
    REF_SEQ = train(fresh(sequence=True), slice(0, GLOBAL))
    one_ms = fresh(door="mindspore")
    REF_MS = train(one_ms, slice(0, GLOBAL))
    DROPPED_MS = one_ms.moe.dropped
results = {"routed": ROUTED}
for case in cases:
    try:
        results[case] = mistake(case) if case in ("indivisible", "not_stacked") else run(case)
    except Exception as exc:  # noqa: BLE001 - recorded: the test names the case
        results[case] = {"error": f"{type(exc).__name__}: {str(exc)[:600]}", "trace": traceback.format_exc()[-3000:]}
json.dump(results, open(f"{out_prefix}.{rank}", "w"), indent=1)
print(f"RANK {rank} DONE", flush=True)
