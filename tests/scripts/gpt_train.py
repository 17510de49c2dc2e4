"""Worker: a nanoGPT-style training loop (tests/scripts/gpt.py's GPT, ``configure_optimizers`` AdamW with weight-decay
groups, warm-up + cosine lr, 2 micro-steps of accumulation with ``loss / 2``, ``clip_grad_norm_(1.0)``) in every
parallel mode, with only autopar's context call added -- against one process on the same global batches.

argv: OUT_PREFIX MODES_JSON. Modes: data, semi_megatron (``autopar.shard``: c_attn / c_fc columns, c_proj rows),
auto, zero1, zero3, pipeline (``autopar.PipelineParallel`` split before ``transformer.h.1``; the loss computed inside
the network, so ``step(X, Y)``), pipeline_logits (the model behind nanoGPT users' every-position-logits wrapper, which
makes targets inside ``forward``; the loss as ``loss_fn``). Per mode: the largest parameter difference, the tie (``lm_head.weight`` is
``transformer.wte.weight``) and ``state_dict()`` loaded into a fresh one-process GPT. Writes JSON to OUT_PREFIX.<rank>.
"""
import json
import sys
import traceback

import torch

import autopar
from autopar.communication import get_group_size, get_rank, init

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpt import GPT, GPTConfig, get_lr  # noqa: E402

out_prefix, modes = sys.argv[1], json.loads(sys.argv[2])
init()
rank, n = get_rank(), get_group_size()
CFG = GPTConfig(bias=False)  # nanoGPT's option; with biases, the key bias has an exactly-zero gradient whose float noise
# Adam normalises into updates of ~1e-5 that differ between any two summation orders, one process included
ITERS, MICRO, GLOBAL = 4, 2, 8
g = torch.Generator().manual_seed(0)
DATA = torch.randint(0, CFG.vocab_size, (ITERS, MICRO, GLOBAL, CFG.block_size + 1), generator=g)


def batch(it, micro, parts=1, part=0):
    rows = DATA[it, micro]
    rows = rows[part * GLOBAL // parts:(part + 1) * GLOBAL // parts]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def fresh() -> GPT:
    torch.manual_seed(1)
    return GPT(CFG)


def set_lr(opt, it):
    for group in opt.param_groups:
        group["lr"] = get_lr(it)


def train(model, step_fn, parts, part):
    opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
    for it in range(ITERS):
        set_lr(opt, it)
        for micro in range(MICRO):
            step_fn(model, *batch(it, micro, parts, part))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def backward_step(model, x, y):
    _, loss = model(x, y)
    (loss / MICRO).backward()


def summed_step(model, x, y):  # what a pipeline's step() does: the micro-steps' gradients add up, undivided
    _, loss = model(x, y)
    loss.backward()


def full(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.named_parameters()}


def reference(step_fn) -> dict:
    autopar.reset_auto_parallel_context()
    with autopar.context.managed():  # one process: its calls must not parallelize it
        return full(train(fresh(), step_fn, 1, 0))


def set_mode(mode: str) -> None:
    autopar.reset_auto_parallel_context()
    name = {"auto": "auto_parallel", "semi_megatron": "semi_auto_parallel"}.get(mode, "data_parallel")
    autopar.set_auto_parallel_context(parallel_mode=name, gradients_mean=True)
    if mode.startswith("zero"):
        autopar.set_auto_parallel_context(enable_parallel_optimizer=True,
                                          parallel_optimizer_config={"optimizer_level": f"level{mode[-1]}"})


def megatron(model: GPT) -> GPT:
    for block in model.transformer.h:
        autopar.shard(block.attn.c_attn, ((1, 1, 1), (n, 1)))  # output features split (columns)
        autopar.shard(block.mlp.c_fc, ((1, 1, 1), (n, 1)))
        autopar.shard(block.attn.c_proj, ((1, 1, n), (1, n)))  # input features split (rows): partial sums reduced
        autopar.shard(block.mlp.c_proj, ((1, 1, n), (1, n)))
    return model


class AllLogits(torch.nn.Module):
    """The 3 lines nanoGPT users write to get every position's logits: its forward returns them only when given
    targets, so the wrapper makes some inside ``forward`` -- a value the second pipeline stage then needs (for the
    discarded loss), which must reach it intact (torch's shape probe once handed it uninitialised memory)."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx):
        return self.gpt(idx, torch.zeros_like(idx))[0]


def ce(logits, y):
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def run(mode: str) -> dict:
    set_mode(mode)
    model = fresh()
    if mode == "semi_megatron":
        megatron(model)
    if mode == "pipeline":
        autopar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
        runner = autopar.PipelineParallel(model, None, micro_batches=2, split_points=["transformer.h.1"])
        replicas = runner.replicas
        train(model, lambda m, x, y: runner.step(x, y) and None, replicas, runner.replica)
    elif mode == "pipeline_logits":  # nanoGPT's logits-of-every-position wrapper, the loss outside: step(X, Y)
        autopar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
        runner = autopar.PipelineParallel(AllLogits(model), ce, micro_batches=2, split_points=["gpt.transformer.h.1"])
        train(model, lambda m, x, y: runner.step(x, y) and None, runner.replicas, runner.replica)
    else:
        train(model, backward_step, n, rank)
    ref = REF_SUMMED if mode.startswith("pipeline") else REF
    got = full(model)
    worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
    tie = model.lm_head.weight is model.transformer.wte.weight
    sd = model.state_dict()
    plain = all(type(v) is torch.Tensor for v in sd.values())
    autopar.reset_auto_parallel_context()
    with autopar.context.managed():
        one = GPT(CFG)
        one.load_state_dict(sd)
    reload = max((one.state_dict()[k] - ref[k]).abs().max().item() for k in ref)
    return {"param": worst, "tie": tie, "state_dict_plain": plain, "state_dict_reload": reload,
            "tie_after_reload": one.lm_head.weight is one.transformer.wte.weight}


REF, REF_SUMMED = reference(backward_step), reference(summed_step)
results = {}
for mode in modes:
    try:
        results[mode] = run(mode)
    except Exception as exc:  # noqa: BLE001 - recorded: the test names the mode
        results[mode] = {"error": f"{type(exc).__name__}: {str(exc)[:600]}", "trace": traceback.format_exc()[-2500:]}
json.dump(results, open(f"{out_prefix}.{rank}", "w"), indent=1)
print(f"RANK {rank} DONE", flush=True)
