"""Worker: context parallelism on a nanoGPT-style GPT (tests/scripts/gpt.py) in float64 -- AdamW with weight-decay
groups, clipping, 3 steps -- against one process on the same global batches. The inputs' sequence is split by
``dataset_strategy`` (each rank loads its slice of the sequence of its data-parallel group's rows); everything
token-wise runs on that slice, attention gathers the keys and values.

Cases: ``cp`` (the sequence over every rank), ``dp_cp`` (4 ranks: dp 2 x cp 2), ``cp_zero1`` / ``cp_zero3``
(``enable_parallel_optimizer``), ``cp_optimizer_after`` (the optimizer made after the first forward), ``cp_ulysses``
(``context_parallel_algo="ulysses"``: all-to-all onto the heads), ``cp_ring`` (ring attention, the causal work
balanced over mirrored chunks), ``..._tp`` (4 ranks: cp 2 x Megatron's tensor parallelism 2; ``cp_sp_tp``: and
sequence parallelism, the norms' and dropouts' slices split again over the tensor-parallel ranks), ``..._mask`` (a per-sample mask made inside the
network instead of ``is_causal``, split with the batch), ``..._gqa`` (grouped-query attention: 2 key-value heads for 4
query heads); and the mistakes -- a sequence the ranks do not
divide, attention dropout, Ulysses with heads the ranks do not divide, a sequence split in data_parallel, a
sequence the ring cannot give each rank two equal chunks of.

argv: OUT_PREFIX CASES_JSON. Writes {case: {...}} to OUT_PREFIX.<rank>.
"""
import json
import sys
import traceback

import torch
from torch.distributed.tensor import DTensor

import autopar
from autopar.communication import get_group_size, get_rank, init

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import gpt  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from gpt_modes import GPT_SPLITS  # noqa: E402

out_prefix, cases = sys.argv[1], json.loads(sys.argv[2])
init()
rank, n = get_rank(), get_group_size()
torch.set_default_dtype(torch.float64)
CFG = GPTConfig(bias=False, block_size=16, n_head=4, n_embd=16)
STEPS, GLOBAL = 3, 4
DATA = torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL, CFG.block_size + 1), generator=torch.Generator().manual_seed(0))


def fresh() -> GPT:
    torch.manual_seed(1)
    return GPT(CFG)


def degrees(case: str) -> tuple[int, int]:
    if case.endswith("_tp"):  # cp 2 x tp 2 (4 ranks): the inputs split on the sequence only
        return 1, 2
    dp = 2 if case.startswith("dp_cp") and n == 4 else 1
    return dp, n // dp


def local_batch(step: int, case: str, seq: int = CFG.block_size):
    """This rank's slice: its data-parallel group's rows, its context-parallel part of their sequence."""
    dp, cp = degrees(case)
    d, c = (rank // cp) % dp, rank % cp
    rows = DATA[step, d * GLOBAL // dp:(d + 1) * GLOBAL // dp]
    part = -(-seq // cp)  # a sequence the ranks do not divide: the last slice is shorter
    x, y = rows[:, :seq], rows[:, 1:seq + 1]
    return x[:, c * part:(c + 1) * part].clone(), y[:, c * part:(c + 1) * part].clone()


def full(model) -> dict:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.named_parameters()}


def set_mode(case: str) -> None:
    autopar.reset_auto_parallel_context()
    dp, cp = degrees(case)
    autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True,
                                      dataset_strategy=((dp, cp), (dp, cp)))
    if "ulysses" in case:
        autopar.set_auto_parallel_context(context_parallel_algo="ulysses")
    if "ring" in case:  # MindFormers' spelling on 4 ranks, autopar's on 2
        autopar.set_auto_parallel_context(context_parallel_algo="colossalai_cp" if n == 4 else "ring")
    if "zero" in case:
        autopar.set_auto_parallel_context(enable_parallel_optimizer=True,
                                          parallel_optimizer_config={"optimizer_level": f"level{case[-1]}"})


def train(model, batches, after_first_forward=False):
    opt = None if after_first_forward else model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
    losses = []
    for x, y in batches:
        _, loss = model(x, y)
        if opt is None:
            opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


class MaskedAttention:
    """``F`` for the GPT's attention with an explicit mask made inside the network instead of ``is_causal``: causal,
    and sample b of the batch unable to see its first b keys -- a mask per sample, split with the batch."""

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):
        b, t = q.shape[0], q.shape[-2]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        keys = torch.arange(t)[None, :] >= torch.arange(b)[:, None]  # [b, t]
        mask = causal[None, None] & keys[:, None, None, :]
        mask[..., 0] = True  # every query sees at least one key
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class GroupedAttention:
    """``F`` for the GPT's attention as grouped-query attention: every other head's keys and values serve two query
    heads (``enable_gqa=True``, as Hugging Face's Llama calls SDPA): the ring passes 2 key-value heads, not 4."""

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):
        return torch.nn.functional.scaled_dot_product_attention(q, k[:, ::2], v[:, ::2], attn_mask=attn_mask,
                                                                dropout_p=dropout_p, is_causal=is_causal,
                                                                enable_gqa=True)


def attention_of(case: str):
    return MaskedAttention() if case.endswith("mask") else GroupedAttention() if case.endswith("gqa") else \
        torch.nn.functional


def run(case: str) -> dict:
    gpt.F = attention_of(case)
    set_mode(case)
    model = fresh()
    if case.endswith("_tp"):  # Megatron's tensor parallelism over the other 2 ranks, each input's sequence split kept
        for name, module in model.named_modules():
            if name.endswith(("attn.c_attn", "mlp.c_fc")):
                autopar.shard(module, ((1, 2, 1), (2, 1)))
            elif name.endswith(("attn.c_proj", "mlp.c_proj")):
                autopar.shard(module, ((1, 2, 2), (1, 2)))
            elif "_sp_" in case and name.endswith(GPT_SPLITS):  # and Megatron's sequence parallelism: norms, dropouts
                autopar.shard(module, ((1, 4, 1),))  # their sequence over all 4 (cp's 2 slices, split by tp)
    seen = {}
    model.transformer.h[0].ln_1.register_forward_hook(  # runs before the runtime's (added at the first call)
        lambda m, a, out: seen.update(local=list(out.shape)))
    losses = train(model, [local_batch(s, case) for s in range(STEPS)], after_first_forward=case.endswith("after"))
    got = full(model)
    ref_losses, ref = REFERENCES[type(gpt.F).__name__]
    gpt.F = torch.nn.functional
    weight = model.transformer.h[0].attn.c_attn.weight
    return {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param": max((got[k] - ref[k]).abs().max().item() for k in ref), "ln_1": seen,
            "c_attn": list((weight.to_local() if isinstance(weight, DTensor) else weight).shape)}


def mistake(case: str) -> dict:
    set_mode({"ulysses_heads": "cp_ulysses", "ring_odd_chunks": "cp_ring"}.get(case, "cp"))
    if case == "data_parallel_split":
        autopar.set_auto_parallel_context(parallel_mode="data_parallel")
    model = fresh()
    if case == "ulysses_heads":  # one head: it does not divide the ranks
        torch.manual_seed(1)
        model = GPT(GPTConfig(bias=False, block_size=16, n_head=1, n_embd=16))
    if case == "attention_dropout":
        for block in model.transformer.h:
            block.attn.dropout = 0.1
    seq = {"sequence_indivisible": CFG.block_size - 1, "ring_odd_chunks": 2 * n + n}.get(case, CFG.block_size)
    try:
        model(*local_batch(0, "cp", seq=seq))
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


MISTAKES = ("sequence_indivisible", "attention_dropout", "ulysses_heads", "data_parallel_split", "ring_odd_chunks")
autopar.reset_auto_parallel_context()
REFERENCES = {}
with autopar.context.managed():  # one process on the global batches, with each attention
    for gpt.F in (torch.nn.functional, MaskedAttention(), GroupedAttention()):
        reference = fresh()
        REFERENCES[type(gpt.F).__name__] = (
            train(reference, [(DATA[s, :, :-1].clone(), DATA[s, :, 1:].clone()) for s in range(STEPS)]),
            full(reference))
    gpt.F = torch.nn.functional
results = {}
for case in cases:
    try:
        results[case] = mistake(case) if case in MISTAKES else run(case)
    except Exception as exc:  # noqa: BLE001 - recorded: the test names the case
        results[case] = {"error": f"{type(exc).__name__}: {str(exc)[:600]}", "trace": traceback.format_exc()[-3000:]}
json.dump(results, open(f"{out_prefix}.{rank}", "w"), indent=1)
print(f"RANK {rank} DONE", flush=True)
