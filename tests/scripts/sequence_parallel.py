"""Worker: sequence parallelism (Korthikanti et al. 2022) with tensor parallelism on a nanoGPT-style GPT
(tests/scripts/gpt.py) in float64 -- AdamW with weight-decay groups, clipping, 3 steps -- against one process on the
same global batches, through both doors:

- ``torch_styles``: torchtitan's plan by names, torch's own objects (``ColwiseParallel()``, ``RowwiseParallel(
  output_layouts=Shard(1))``, ``SequenceParallel()``, ``PrepareModuleInput`` on the attention and the MLP);
- ``strings``: the same plan in autopar's strings (``"colwise"`` / ``"rowwise"`` / ``"sequence"``), the optimizer
  made after the first forward;
- ``ms_tuples``: MindSpore's strategy spelling, data x model parallel (on 4 ranks dp 2 x mp 2): Megatron's column /
  row tuples and ``((dp, mp, 1),)`` for the norms and dropouts -- ``Cell.shard`` on autopar's ``nn.LayerNorm``;
- ``ms_tuples_zero1`` / ``ms_tuples_zero3``: the same with ``enable_parallel_optimizer``;
- ``full_batch``: every rank feeds the whole batch (Megatron's tensor-parallel data contract) with batch 1 -- the
  case sequence parallelism exists for: nothing else splits the norms there;
- ``no_sp`` / ``full_batch_no_sp``: tensor parallelism alone (the contrast for the layouts and the collectives);
- the mistakes (``MISTAKES``): sequence parallelism without tensor parallelism, a sequence the ranks do not divide,
  a norm split on its features -- each the first call's one line.

Per case: the largest loss and parameter differences, the layout of a norm's output and its local shape, and the
collectives of one more forward (torch's ``CommDebugMode``).

argv: OUT_PREFIX CASES_JSON. Writes {case: {...}} to OUT_PREFIX.<rank>.
"""
import json
import sys
import traceback

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

import autopar
from autopar.communication import get_group_size, get_rank, init

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpt import GPT, GPTConfig  # noqa: E402

out_prefix, cases = sys.argv[1], json.loads(sys.argv[2])
init()
rank, n = get_rank(), get_group_size()
torch.set_default_dtype(torch.float64)
CFG = GPTConfig(bias=False, block_size=8, n_head=4, n_embd=16)
STEPS, GLOBAL = 3, 4
DATA = torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL, CFG.block_size + 1), generator=torch.Generator().manual_seed(0))
SPLIT = ("*.ln_1", "*.ln_2", "transformer.ln_f", "transformer.drop", "*.resid_dropout", "*.mlp.dropout")


def fresh() -> GPT:
    torch.manual_seed(1)
    model = GPT(CFG)
    model.transformer.ln_f = autopar.nn.LayerNorm((CFG.n_embd,), epsilon=1e-5).double()  # a Cell: Cell.shard
    return model


def train(model, rows, after_first_forward=False):
    opt = None if after_first_forward else model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
    losses = []
    for step in range(STEPS):
        x, y = DATA[step, rows, :-1].contiguous(), DATA[step, rows, 1:].contiguous()
        _, loss = model(x, y)
        if opt is None:
            opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def full(model) -> dict:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.named_parameters()}


def torch_plan():
    plan = {"*.c_attn": ColwiseParallel(), "*.c_fc": ColwiseParallel(),
            "*.c_proj": RowwiseParallel(output_layouts=Shard(1)),
            "*.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "*.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    plan.update({pattern: SequenceParallel() for pattern in SPLIT})
    return plan


def string_plan():
    plan = {"*.c_attn": "colwise", "*.c_fc": "colwise", "*.c_proj": "rowwise"}
    plan.update({pattern: "sequence" for pattern in SPLIT})
    return plan


def ms_tuples(model):
    dp = 2 if n == 4 else 1
    mp = n // dp
    for name, module in model.named_modules():
        if name.endswith(("c_attn", "c_fc")):
            autopar.shard(module, ((dp, 1, 1), (mp, 1)))
        elif name.endswith("c_proj"):
            autopar.shard(module, ((dp, 1, mp), (1, mp)))
        elif name.endswith(("ln_1", "ln_2", "drop", "dropout")):
            autopar.shard(module, ((dp, mp, 1),))
    model.transformer.ln_f.shard(((dp, mp, 1),))  # the MindSpore spelling on a Cell


def run(case: str, ref_losses, ref_params) -> dict:
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True,
                                      full_batch=case.startswith("full_batch"))
    if case.startswith("ms_tuples_zero"):
        autopar.set_auto_parallel_context(enable_parallel_optimizer=True,
                                          parallel_optimizer_config={"optimizer_level": f"level{case[-1]}"})
    model = fresh()
    if case == "torch_styles":
        autopar.shard(model, torch_plan())
    elif case.startswith("ms_tuples"):
        ms_tuples(model)
    elif case in ("no_sp", "full_batch_no_sp"):
        autopar.shard(model, {k: v for k, v in string_plan().items() if v != "sequence"})
    else:
        autopar.shard(model, string_plan())
    rows = slice(0, 1) if case.startswith("full_batch") else slice(rank * GLOBAL // n, (rank + 1) * GLOBAL // n)
    losses = train(model, rows, after_first_forward=case == "strings")
    means = []
    for loss in losses:  # each rank's loss is its rows' mean (the whole batch's under full_batch)
        if not case.startswith("full_batch"):
            torch.distributed.all_reduce(loss)
            loss = loss / n
        means.append(loss.item())
    got = full(model)
    ref_l, ref_p = (ref_losses[1], ref_params[1]) if case.startswith("full_batch") else (
        ref_losses[0], ref_params[0])
    seen = {}
    hook = model.transformer.h[0].ln_2.register_forward_hook(  # after the runtime's: the output as laid out
        lambda m, a, out: seen.update(placements=str(tuple(out.placements)), local=list(out.to_local().shape)))
    attended = {}  # attention's output as it reaches the row-split projection: split by heads (the fused c_attn's
    # q, k and v each split over the ranks), not gathered whole
    pre = model.transformer.h[0].attn.c_proj.register_forward_pre_hook(lambda m, a: attended.update(
        placements=str(tuple(a[0].placements)), local=list(a[0].to_local().shape)))
    with torch.no_grad(), CommDebugMode() as comms:  # a forward's collectives (the mode breaks full_batch's backward)
        model(DATA[0, rows, :-1].contiguous(), DATA[0, rows, 1:].contiguous())
    hook.remove()
    pre.remove()
    counts = {str(k).rsplit(".", 1)[-1]: v for k, v in comms.get_comm_counts().items()}
    return {"loss": max(abs(a - b) for a, b in zip(means, ref_l)),
            "param": max((got[k] - ref_p[k]).abs().max().item() for k in ref_p), "ln_2": seen, "comms": counts,
            "attended": attended, "saved_whole": saved_whole(model, rows)}


def saved_whole(model, rows) -> int:
    """How many activations one forward keeps for its backward whole -- every token of the sequence, every feature
    -- on this rank (the ones autopar keeps split and gathers again are not handed to an outer hook)."""
    whole = (rows.stop - rows.start) * CFG.block_size * CFG.n_embd
    weights = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in model.parameters()}
    count = 0

    def pack(t):
        nonlocal count
        local = t.to_local() if isinstance(t, DTensor) else t
        count += int(local.is_floating_point() and local.numel() == whole and local.shape[-1] == CFG.n_embd
                     and local.untyped_storage().data_ptr() not in weights)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(DATA[0, rows, :-1].contiguous(), DATA[0, rows, 1:].contiguous())
    return count


MISTAKES = {  # what a user gets wrong -> the plan
    "no_tensor_parallel": {pattern: "sequence" for pattern in SPLIT},
    "sequence_indivisible": string_plan(),
    "features_split": dict(string_plan(), **{"*.ln_1": None}),
}


def mistake(case: str) -> dict:
    """The first call's one line (no traceback), for a plan that cannot run."""
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True)
    model = fresh()
    plan = MISTAKES[case]
    autopar.shard(model, {k: v for k, v in plan.items() if v is not None})
    if case == "features_split":
        for block in model.transformer.h:
            autopar.shard(block.ln_1, ((1, 1, n),))
    seq = 7 if case == "sequence_indivisible" else CFG.block_size
    try:
        model(DATA[0, :1, :seq].clone(), DATA[0, :1, 1:seq + 1].clone())
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def reference(rows):
    autopar.reset_auto_parallel_context()
    with autopar.context.managed():  # one process: its calls must not parallelize it
        model = fresh()
        losses = [loss.item() for loss in train(model, rows)]
        return losses, full(model)


(ref_all, params_all), (ref_one, params_one) = reference(slice(0, GLOBAL)), reference(slice(0, 1))
results = {}
for case in cases:
    try:
        results[case] = mistake(case) if case in MISTAKES else run(case, (ref_all, ref_one), (params_all, params_one))
    except Exception as exc:  # noqa: BLE001 - recorded: the test names the case
        results[case] = {"error": f"{type(exc).__name__}: {str(exc)[:600]}", "trace": traceback.format_exc()[-3000:]}
json.dump(results, open(f"{out_prefix}.{rank}", "w"), indent=1)
print(f"RANK {rank} DONE", flush=True)
