"""Worker: networks built without their memory -- ``autopar.deferred_init`` (the PyTorch door; torchdistx's
spelling), ``nn.utils.no_init_parameters`` (MindSpore's), a plain ``torch.device("meta")`` (FSDP2's idiom) -- are
materialised by the parallel mode, each rank only what it keeps, with the values one process draws eagerly from
the same seed, bit for bit; then they train as one process on the global batch. Door moe (autopar's MoE block under
``deferred_init``): each rank makes only its experts under expert parallelism; AUTO plans it on the meta device, the
routing a meta router cannot give drawn uniformly for the trace.

argv: OUT_PREFIX CASES_JSON ([[door, mode], ...]). Doors: gpt (a nanoGPT-like GPT: ``apply(_init_weights)`` after
the default init, a tied head, a scaled ``c_proj``), llama (Hugging Face ``LlamaForCausalLM``, its own
``_init_weights``), ms (MindSpore Cells: ``Dense`` with ``weight_init`` strings, a ``Parameter(initializer(...))``,
``TruncatedNormal`` -- drawn with rejection), meta (plain torch layers under ``torch.device("meta")``: each
module's ``reset_parameters()``, drawn from the seed set before the first call), loaded (the GPT under
``deferred_init`` from another seed, then one process's initial values loaded with ``load_param_into_net`` before
its first call: the loaded values are what each rank slices), seeds (the GPT under ``deferred_init`` with a
different seed on every rank and ``parameter_broadcast=True``: every rank draws as rank 0 did). Modes: data, zero3, megatron
(SEMI_AUTO, MindSpore tuples on the MLP: columns then rows; ZeRO-1 beside them), auto (planned on the meta
network: nothing made before the plan), auto_tight (auto with a memory limit data parallel does not fit: the plan
splits, and each rank makes only its slices), pipe (2 ranks: a 2-stage
``PipelineParallel(grads="stage")``, each stage building only its layers; ``never_made``: the other stage's
parameters, still on the meta device after the first step).

Per case, float64: the optimizer (AdamW + clipping) made before the first forward on the meta parameters; step 0
runs at lr 0, after it every parameter must equal one process's initial value exactly (``init_diff``, 0.0); two more
steps must equal one process trained on the global batch (``diff``). Also: which parameters are stored as slices
(``sliced``), the largest tensor one materialisation held (``largest_held``) against the largest parameter
(``largest_param``), bytes. Writes {"door/mode": result} to OUT_PREFIX.<rank>.
"""
import json
import sys
import traceback
import warnings

import torch
import torch.nn.functional as F
from gpt import GPT, GPTConfig

import autopar
from autopar.common import deferred
from autopar.communication import get_group_size, get_rank, init
from autopar.models import MoEBlock
from autopar.parallel.state import state_of

out_prefix, cases = sys.argv[1], json.loads(sys.argv[2])
torch.set_default_dtype(torch.float64)
init()
rank, n = get_rank(), get_group_size()
STEPS, GLOBAL, SEQ, VOCAB, SEED = 3, 4, 8, 64, 7
g = torch.Generator().manual_seed(0)
IDS = torch.randint(0, VOCAB, (STEPS, GLOBAL, SEQ), generator=g)
X = torch.randn(STEPS, GLOBAL, 8, generator=g)
Y = torch.randint(0, 5, (STEPS, GLOBAL), generator=g)
CFG = GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attn_implementation="sdpa"))


def ms_net():
    from autopar import Parameter, nn
    from autopar.common.initializer import TruncatedNormal, initializer

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Dense(8, 16, weight_init="normal", dtype=torch.float64)
            self.act = nn.ReLU()
            self.fc2 = nn.Dense(16, 5, weight_init=TruncatedNormal(0.5, a=-0.6, b=0.6), dtype=torch.float64)
            self.scale = Parameter(initializer("ones", [5], torch.float64), name="scale")

        def construct(self, x):
            return self.fc2(self.act(self.fc1(x))) * self.scale

    return Net()


def plain_net():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 5))


def build(door: str, lazy: bool) -> torch.nn.Module:
    torch.manual_seed(SEED)
    make = {"gpt": lambda: GPT(CFG), "loaded": lambda: GPT(CFG), "seeds": lambda: GPT(CFG), "llama": llama, "ms": ms_net,
            "meta": plain_net, "moe": lambda: MoEBlock(8, 4, 16, 2)}[door]
    if not lazy:
        return make()
    if door == "ms":
        from autopar.nn.utils import no_init_parameters

        with no_init_parameters():
            return make()
    if door == "meta":
        with torch.device("meta"):
            net = make()
        torch.manual_seed(SEED)  # FSDP2's idiom: the initialisers run after the build, from the seed set now
        return net
    if door == "loaded":
        torch.manual_seed(SEED + 1)
    if door == "seeds":
        torch.manual_seed(SEED + rank)
    return autopar.deferred_init(make)


def loss_of(door: str, net, step: int, rows: slice) -> torch.Tensor:
    if door in ("gpt", "loaded", "seeds"):
        return net(IDS[step, rows], IDS[step, rows])[1]
    if door == "llama":
        return net(input_ids=IDS[step, rows], labels=IDS[step, rows]).loss
    return F.cross_entropy(net(X[step, rows]), Y[step, rows])


def full(net) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in net.named_parameters()}


SPLITS = {"gpt": "transformer.h.1", "meta": "1"}  # a 2-stage pipeline's cut


def train(door: str, net, rows: slice, after_first=None, pipe=None) -> None:
    opt = torch.optim.AdamW(net.parameters(), lr=0.0, weight_decay=0.1)  # before the first forward: on meta
    for step in range(STEPS):
        if pipe is not None:  # each stage keeps only its gradients: no clipping (its norm would be the stage's)
            pipe.step(*((IDS[step, rows], IDS[step, rows]) if door == "gpt" else (X[step, rows], Y[step, rows])))
        else:
            loss_of(door, net, step, rows).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0 and after_first is not None:
            after_first()
        for group in opt.param_groups:
            group["lr"] = 1e-2


MLP = {"gpt": ("mlp.c_fc", "mlp.c_proj"), "loaded": ("mlp.c_fc", "mlp.c_proj"), "seeds": ("mlp.c_fc", "mlp.c_proj"), "llama": ("mlp.up_proj", "mlp.down_proj"), "ms": ("fc1", "fc2"),
       "meta": ("0", "2")}


def set_mode(door: str, mode: str, net) -> None:
    autopar.reset_auto_parallel_context()
    name = {"megatron": "semi_auto_parallel", "expert": "semi_auto_parallel", "auto": "auto_parallel",
            "auto_tight": "auto_parallel"}.get(mode, "data_parallel")
    autopar.set_auto_parallel_context(parallel_mode=name, gradients_mean=True, parameter_broadcast=door == "seeds")
    if mode == "auto_tight":  # the GPT's data parallel needs 836 KiB a rank by the plan, ZeRO-3 577: AUTO must split
        autopar.set_auto_parallel_context(max_device_memory="700KB")
    if mode == "zero3":
        autopar.set_auto_parallel_context(enable_parallel_optimizer=True,
                                          parallel_optimizer_config={"optimizer_level": "level3"})
    if mode == "expert":  # each rank keeps E/n experts
        autopar.shard(net, {"experts": "expert"})
    if mode == "megatron":
        autopar.set_auto_parallel_context(enable_parallel_optimizer=True)
        columns, rows = MLP[door]
        for name, module in net.named_modules():
            if name.endswith(columns):
                autopar.shard(module, ((1, 1, 1) if door in ("gpt", "loaded", "seeds", "llama") else (1, 1), (n, 1)))
            elif name.endswith(rows):
                autopar.shard(module, ((1, 1, n) if door in ("gpt", "loaded", "seeds", "llama") else (1, n), (1, n)))


def run(door: str, mode: str) -> dict:
    autopar.reset_auto_parallel_context()
    with autopar.context.managed():
        ref = build(door, lazy=False)
        start = full(ref)
        if mode == "pipe":  # (trained without clipping, as the stages are)
            train(door, ref, slice(None), pipe=_OneProcess(door, ref))
        else:
            train(door, ref, slice(None))
        end = full(ref)
    net = build(door, lazy=True)
    if door == "loaded":
        autopar.load_param_into_net(net, start)
    assert all(p.is_meta for p in net.parameters())
    recordings = deferred.recordings_of(net) if door != "meta" else []  # (a plain meta build's: made at its call)
    set_mode(door, mode, net)
    rows = slice(rank * GLOBAL // n, (rank + 1) * GLOBAL // n)
    seen = {}

    def check_init():
        now = full(net)  # (a pipeline stage: its own parameters -- the other stage's are never made)
        seen["init_diff"] = max((now[k] - start[k]).abs().max().item() for k in start if not now[k].is_meta)
        seen["sliced"] = sorted(k for k, p in net.named_parameters() if p.__class__.__name__ == "DTensor"
                                and p.to_local().numel() < p.numel())
        seen["never_made"] = sorted(k for k, p in net.named_parameters() if p.is_meta)

    pipe = None
    if mode == "pipe":  # 2 stages (2 ranks), each replica the whole batch; each stage builds only its layers
        pipe = autopar.PipelineParallel(net, None if door == "gpt" else torch.nn.CrossEntropyLoss(), micro_batches=2,
                                        split_points=[SPLITS[door]], grads="stage")
        rows = slice(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(door, net, rows, check_init, pipe=pipe)
    seen["warnings"] = [str(w.message) for w in caught if "autopar" in str(w.message)]
    if pipe is not None:
        pipe.gather_parameters()  # every stage's parameters, for the comparison
    now = full(net)
    plan = getattr(state_of(net), "plan", None)
    return {**seen, "diff": max((now[k] - end[k]).abs().max().item() for k in end),
            "plan": "" if plan is None else plan.reason,
            "largest_held": max((r.largest_held for r in recordings), default=0),
            "largest_param": max(p.numel() * 8 for p in ref.parameters())}


class _OneProcess:
    """One process's step for the pipeline's reference: the mean of the two micro-batches' losses, no clipping."""

    def __init__(self, door, net):
        self.door, self.net = door, net

    def step(self, x, y):
        for xs, ys in zip(x.tensor_split(2), y.tensor_split(2)):
            out = self.net(xs, ys)[1] if self.door == "gpt" else F.cross_entropy(self.net(xs), ys)
            (out / 2).backward()


results = {}
for door, mode in cases:
    try:
        results[f"{door}/{mode}"] = run(door, mode)
    except Exception as exc:  # noqa: BLE001 - reported per case
        results[f"{door}/{mode}"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
json.dump(results, open(f"{out_prefix}.{rank}", "w"), indent=1)
print(f"rank {rank}: {json.dumps({k: v.get('error', 'ok') for k, v in results.items()})}", flush=True)
