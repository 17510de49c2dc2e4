"""Worker: tensor parallelism inside pipeline stages (the PyTorch door: ``PipelineParallel(..., grads="stage",
tp=2, tensor_parallel={module name: "colwise" | "rowwise"})``) equals one process on the global batch, in float64.

argv: OUT_PREFIX CKPT_DIR [zero]. 2 stages x 2 tensor-parallel ranks (4 ranks); with ``zero``, 2 stages x 2
data-parallel replicas x 2 tensor-parallel ranks (8 ranks), nanoGPT only, its stages' weights split over the tensor
group and then ZeRO-1-sharded over the replicas (FSDP2 on the split DTensors). Cases: a 4-Linear network with a skip
connection across the stage boundary (Megatron's column / row pairs, AdamW made before the first step), and a
nanoGPT (tests/scripts/gpt.py: fused q/k/v split by columns, heads split, the output head tied to the embedding
across the stages, the loss inside ``forward``), and the nanoGPT with sequence parallelism too (its norms, dropout
and residual stream on half the sequence); each against one process on the same batches: per-step losses and
every parameter of the rank's stage after the steps; the split weights' local halves; the integrated checkpoint
after training holds the whole trained network. Bad input, each one line. Writes {case: result} to OUT_PREFIX.<rank>.
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
from gpt import GPT, GPTConfig
from pipeline_net import Net
from torch.distributed.tensor import Shard

import autopar
from autopar.communication import get_rank, init
from autopar.errors import ConfigError
from autopar.parallel.pipeline.runner import PipelineParallel
from autopar.parallel.tensor import sequence_attention

out_prefix, ckpt_dir = sys.argv[1], sys.argv[2]
zero = "level1" if sys.argv[3:4] == ["zero"] else None
torch.set_default_dtype(torch.float64)  # exact math shows as ~1e-15; fp32 rounding under AdamW would hide it
init()
rank = get_rank()


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.0))


rng = np.random.default_rng(0)
CASES = {
    "net": (Net, torch.nn.functional.cross_entropy, ["l3"], {"l1": "colwise", "l2": "rowwise", "l3": "colwise",
                                                            "l4": "rowwise"},
            (torch.tensor(rng.standard_normal((4, 16, 8))), torch.tensor(rng.integers(0, 5, (4, 16))))),
    "gpt": (gpt, None, ["transformer.h.1"],
            {f"transformer.h.{i}.{m}": s for i in range(2) for m, s in (("attn.c_attn", "colwise"),
                                                                         ("attn.c_proj", "rowwise"),
                                                                         ("mlp.c_fc", "colwise"),
                                                                         ("mlp.c_proj", "rowwise"))},
            (torch.tensor(rng.integers(0, 64, (4, 8, 16))), torch.tensor(rng.integers(0, 64, (4, 8, 16))))),
}
# the same split named by parameters, each with its placement on the tensor group
CASES["net_params"] = CASES["net"][:3] + ({"l1.weight": Shard(0), "l1.bias": Shard(0), "l2.weight": Shard(1),
                                           "l3.weight": Shard(0), "l3.bias": Shard(0), "l4.weight": Shard(1)},) \
    + CASES["net"][4:]
# and Megatron's sequence parallelism with it: the norms, the embeddings' dropout and the residual stream on the
# rank's half of the sequence
CASES["gpt_sp"] = CASES["gpt"][:3] + ({**CASES["gpt"][3], "transformer.drop": "sequence", "transformer.ln_f": "sequence",
                                       **{f"transformer.h.{i}.{n}": "sequence" for i in range(2)
                                          for n in ("ln_1", "ln_2")}},) + CASES["gpt"][4:]
SPLIT_ON_THE_SEQUENCE = ("ln_1", "ln_2", "ln_f", "transformer.h.0", "transformer.h.1")
# each case's PipelineParallel arguments beside grads="stage" (the tensor split unless only the context is): context
# parallelism inside the stages runs every piece on half the sequence (token ids and targets too), attention by the
# all-gather form, the ring or Ulysses' all-to-all (4 ranks: 2 stages x cp 2); with ZeRO over 2 replicas, and beside the tensor split
# (8 ranks: 2 stages x 2 replicas x cp 2, and 2 stages x cp 2 x tp 2)
RUNS = ({"gpt": {}, "gpt_cp_zero": {"cp": 2}, "gpt_cp_tp": {"cp": 2, "tp": 2, "zero": None}} if zero else
        {"net": {}, "net_params": {}, "gpt": {}, "gpt_sp": {}, "gpt_cp": {"cp": 2}, "gpt_cp_ring": {"cp": 2, "cp_algo": "ring"},
         "gpt_cp_ulysses": {"cp": 2, "cp_algo": "ulysses"}})
for key in RUNS:
    CASES.setdefault(key, CASES["gpt"])
ATTENDED: dict[str, int] = {}  # the context-parallel attention calls, by algorithm (a spy: the real ones run)


def spy(algo: str, real):
    def spied(*args, **kwargs):
        ATTENDED[algo] = ATTENDED.get(algo, 0) + 1
        return real(*args, **kwargs)
    return spied


for algo in ("attention", "ring", "ulysses"):
    setattr(sequence_attention, algo, spy(algo, getattr(sequence_attention, algo)))


def loss_of(net, loss_fn, x, y):
    return loss_fn(net(x), y) if loss_fn is not None else net(x, y)[1]


def sliced_diff(net, build, ref, tag: str) -> float:
    """Each rank's sliced checkpoint of ``net``, the set reloaded into one process's ``build()``: its largest
    difference from the one-process reference ``ref``."""
    autopar.save_checkpoint(net, f"{ckpt_dir}/{tag}_sliced_{rank}", integrated_save=False)
    torch.distributed.barrier()
    plain = build()
    autopar.load_distributed_checkpoint(plain, sorted(str(p) for p in Path(ckpt_dir).glob(f"{tag}_sliced_*.ckpt")))
    return max(float((p.detach() - want.detach()).abs().max())
               for (_, p), want in zip(plain.named_parameters(), ref.parameters()))


results = {}
for key, (build, loss_fn, points, plan, (X, Y)) in CASES.items():
    if key not in RUNS:
        continue
    extra = RUNS[key]
    kwargs = {"zero": zero, **({"tp": 2, "tensor_parallel": plan} if "cp" not in extra or "tp" in extra else {}),
              **extra}
    try:
        ref = build()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        ref_losses = []
        for step in range(len(X)):
            loss = loss_of(ref, loss_fn, X[step], Y[step])
            ref_losses.append(float(loss.detach()))
            opt.zero_grad()
            loss.backward()
            opt.step()
        net = build()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)  # made before the stages are split: moved onto them
        runner = PipelineParallel(net, loss_fn, 2, points, grads="stage", **kwargs)
        losses, placed = [], {}
        ATTENDED.clear()
        for step in range(len(X)):
            losses.append(float(runner.step(X[step], Y[step])))
            opt.step()
            opt.zero_grad()
            if step == 0 and key in ("gpt_sp", "gpt_cp", "gpt_cp_ring", "gpt_cp_ulysses"):  # where the norms' and the blocks' outputs
                # lie, from the next step on
                for name, module in runner.stage_module.graph_module.named_modules():
                    if name.endswith(SPLIT_ON_THE_SEQUENCE):
                        module.register_forward_hook(lambda m, a, out, name=name, placed=placed: placed.__setitem__(
                            name, [str(out.placements), list(out.to_local().shape), list(out.shape)]))
        halves = {n.removeprefix("graph_module."): (tuple(p.to_local().shape), tuple(p.shape))
                  for n, p in runner.stage_module.named_parameters()
                  if hasattr(p, "to_local") and any(q.is_shard() for q in p.placements)}  # (a row split's bias: whole)
        # each rank's slices, reloaded whole onto one process's layout
        sliced = sliced_diff(net, build, ref, key) if key in ("gpt", "gpt_cp") or zero else None
        runner.gather_parameters()  # the whole trained network on every rank
        want = dict(ref.named_parameters())
        stage = [k for k, stages in runner.owner.items() if runner.stage_index in stages and k in want]
        results[key] = {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                        "param_diff": max(float((p.detach() - want[k].detach()).abs().max())
                                          for k, p in net.named_parameters() if k in stage),
                        "whole_diff": max(float((p.detach() - want[k].detach()).abs().max())
                                          for k, p in net.named_parameters()),
                        "stage": runner.stage_index, "halves": halves, "sync": runner.gradient_sync,
                        "placed": placed, "attended": dict(ATTENDED), "sliced_diff": sliced}
        if key == "gpt" and not zero:  # the integrated file, written by rank 0, holds the whole trained network
            autopar.save_checkpoint(net, f"{ckpt_dir}/tp.ckpt")
            torch.distributed.barrier()
            loaded = autopar.load_checkpoint(f"{ckpt_dir}/tp.ckpt")
            results[key]["ckpt_diff"] = max(float((loaded[k].detach() - v.detach()).abs().max())
                                            for k, v in want.items())
    except Exception as exc:  # noqa: BLE001 - recorded: the test names the case
        import traceback

        results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "trace": traceback.format_exc()[-1500:]}



class MindSporeMLP(autopar.nn.Cell):
    """Megatron's MLP as MindSpore writes it: Parameters and MatMul operators with strategies for one stage's ranks
    -- the first weight's columns split over ``mp``, the second's rows (``dp``: the batch, data parallel)."""

    def __init__(self, dp: int, mp: int):
        super().__init__()
        self.w1 = autopar.Parameter(torch.randn(8, 16) * 0.3, name="w1")
        self.w2 = autopar.Parameter(torch.randn(16, 8) * 0.3, name="w2")
        self.matmul1 = autopar.ops.MatMul().shard(((dp, 1), (1, mp)))
        self.relu = autopar.ops.ReLU().shard(((dp, mp),))
        self.matmul2 = autopar.ops.MatMul().shard(((dp, mp), (mp, 1)))

    def construct(self, x):
        return self.matmul2(self.relu(self.matmul1(x, self.w1)), self.w2)


def two_stages(net: autopar.nn.Cell, block, dp: int, mp: int) -> None:
    """Two blocks (a stage each) and a Dense head on the second stage."""
    torch.manual_seed(0)
    net.block1, net.block2 = block(dp, mp), block(dp, mp)
    net.head = autopar.nn.Dense(8, 6, dtype=torch.float64)
    net.block1.pipeline_stage, net.block2.pipeline_stage, net.head.pipeline_stage = 0, 1, 1


class MindSporeNet(autopar.nn.Cell):
    """Two such blocks and the head column-split by ``autopar.shard`` (its bias with it)."""

    def __init__(self, dp: int = 1, mp: int = 1):
        super().__init__()
        two_stages(self, MindSporeMLP, dp, mp)
        autopar.shard(self.head, ((dp, 1), (mp, 1)))

    def construct(self, x):
        return self.head(self.block2(self.block1(x) + x))


class MindSporeSequenceBlock(autopar.nn.Cell):
    """MindFormers' sequence parallelism: Dense layers split as Megatron's pair, the norm after the residual on the
    rank's slice of the sequence (``norm.shard(((dp, mp, 1),))``)."""

    def __init__(self, dp: int, mp: int):
        super().__init__()
        self.up = autopar.nn.Dense(8, 16, dtype=torch.float64)
        self.down = autopar.nn.Dense(16, 8, dtype=torch.float64)
        self.norm = autopar.nn.LayerNorm((8,), dtype=torch.float64)
        autopar.shard(self.up, ((dp, 1, 1), (mp, 1)))
        autopar.shard(self.down, ((dp, 1, mp), (1, mp)))
        self.norm.shard(((dp, mp, 1),))

    def construct(self, x):
        return self.norm(x + self.down(torch.relu(self.up(x))))


class MindSporeSequenceNet(autopar.nn.Cell):
    def __init__(self, dp: int = 1, mp: int = 1):
        super().__init__()
        two_stages(self, MindSporeSequenceBlock, dp, mp)

    def construct(self, x):
        return self.head(self.block2(self.block1(x)).mean(1))


def mindspore_door(dp: int, mp: int, replicas: int, build=MindSporeNet, seq: int = 0, **context) -> dict:
    """The MindSpore spelling: semi_auto_parallel with pipeline_stages=2, the operators' strategies written for a
    stage's ranks, Model.train of PipelineCell(WithLossCell(net, loss), micro_size=2) on each replica's share of
    the global batch -- against one process (PipelineCell sums its micro-batches' losses: 2x the mean's)."""
    import warnings

    from autopar.parallel.pipeline.runner import pipeline_of
    from autopar.train import Model
    from autopar.train.callbacks import Callback

    X = torch.tensor(rng.standard_normal((3, 8, seq, 8) if seq else (3, 8, 8)))
    Y = torch.tensor(rng.integers(0, 6, (3, 8)))
    ref = build()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for step in range(len(X)):
        loss = torch.nn.functional.cross_entropy(ref(X[step]), Y[step]) * 2
        ref_losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True, pipeline_stages=2,
                                      **context)
    net = build(dp, mp)
    opt = torch.optim.AdamW(net.trainable_params(), lr=1e-2)
    placed = {}  # where each norm's output lies (from the second step on: the stages are built in the first)

    class Losses(Callback):
        def __init__(self):
            self.values = []

        def step_end(self, run_context):
            self.values.append(float(run_context.original_args().net_outputs))
            if seq and len(self.values) == 1:
                for name, module in pipeline_of(net).stage_module.graph_module.named_modules():
                    if name.endswith("norm"):
                        module.register_forward_hook(lambda m, a, out, name=name: placed.__setitem__(
                            name, [str(out.placements), list(out.to_local().shape), list(out.shape)]))

    losses = Losses()

    per, replica = len(X[0]) // replicas, rank % (4 if zero else 2) // (mp if mp > 1 else 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = Model(autopar.nn.PipelineCell(autopar.nn.WithLossCell(net, torch.nn.CrossEntropyLoss()),
                                              micro_size=2), optimizer=opt)
        model.train(1, [(X[s][replica * per:(replica + 1) * per], Y[s][replica * per:(replica + 1) * per])
                        for s in range(len(X))], callbacks=[losses])
    runner = pipeline_of(net)
    halves = {n.removeprefix("graph_module."): (tuple(p.to_local().shape), tuple(p.shape))
              for n, p in runner.stage_module.named_parameters()
              if hasattr(p, "to_local") and any(q.is_shard() for q in p.placements[-1:])}  # (the tensor group's)
    # each rank's slices (its stage's weights, split over its tensor group), reloaded whole onto one process
    sliced = sliced_diff(net, build, ref, f"{build.__name__}{mp}{dp}") if mp > 1 else None
    runner.gather_parameters()
    want = dict(ref.named_parameters())
    stage = [k for k, stages in runner.owner.items() if runner.stage_index in stages and k in want]
    autopar.reset_auto_parallel_context()
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses.values, ref_losses)),
            "param_diff": max(float((p.detach() - want[k].detach()).abs().max())
                              for k, p in net.named_parameters() if k in stage),
            "whole_diff": max(float((p.detach() - want[k].detach()).abs().max()) for k, p in net.named_parameters()),
            "stage": runner.stage_index, "halves": halves, "sync": runner.gradient_sync, "placed": placed,
            "sliced_diff": sliced,
            "warned": [str(w.message) for w in caught if "not applied" in str(w.message)
                       or "shards nothing" in str(w.message)]}


# the MindSpore door: 2 ranks a stage -- the weights split over both (a tensor group of 2), or the batch only (2
# data-parallel replicas, nothing to split); with ZeRO (8 ranks): split over 2 and sharded over 2 replicas
# and MindFormers' sequence parallelism: each norm on the rank's half of the sequence
for key, (dp, mp, replicas, context) in ({"ms_tp_zero": (2, 2, 2, {"enable_parallel_optimizer": True})} if zero
                                         else {"ms_tp": (1, 2, 1, {}), "ms_dp": (2, 1, 2, {}),
                                               "ms_sp": (1, 2, 1, {"build": MindSporeSequenceNet, "seq": 4}),
                                               # (the optimizer shard asked where the split leaves one replica: said)
                                               "ms_tp_one_replica": (1, 2, 1, {"enable_parallel_optimizer": True})}
                                         ).items():
    try:
        results[key] = mindspore_door(dp, mp, replicas, **context)
    except Exception as exc:  # noqa: BLE001 - recorded: the test names the case
        import traceback

        results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "trace": traceback.format_exc()[-1500:]}

errors = {}
for case, kwargs in () if zero else (("no_plan", {"tp": 2}), ("no_tp", {"tensor_parallel": {"l1": "colwise"}}),
                     ("full", {"grads": "full", "tp": 2, "tensor_parallel": {"l1": "colwise"}}),
                     ("indivisible", {"tp": 3, "tensor_parallel": {"l1": "colwise"}}),
                     ("unknown", {"tp": 2, "tensor_parallel": {"l9": "colwise"}}),
                     ("style", {"tp": 2, "tensor_parallel": {"l1": "diagonal"}}),
                     ("placement", {"tp": 2, "tensor_parallel": {"l1.weight": Shard(2)}}),
                     ("module_placement", {"tp": 2, "tensor_parallel": {"l1": Shard(0)}}),
                     ("sequence_alone", {"tp": 2, "tensor_parallel": {"l1": "colwise", "l2": "rowwise",
                                                                      "l4": "sequence"}}),
                     ("cp_full", {"grads": "full", "cp": 2}), ("cp_algo", {"cp": 2, "cp_algo": "zigzag"}),
                     ("cp_with_sp", {"cp": 2, "tp": 2, "tensor_parallel": {"l1": "colwise", "l4": "sequence"}}),
                     ("cp_uneven", {"cp": 2})):
    try:
        runner = PipelineParallel(Net(), torch.nn.functional.cross_entropy, 2, ["l3"], **{"grads": "stage", **kwargs})
        if case == "sequence_alone":  # (found when the stages are built: stage 1 splits nothing)
            runner.step(*CASES["net"][4][0][:1], CASES["net"][4][1][0])
        if case == "cp_uneven":  # (found when the stages are built: a "sequence" of 7 over 2 ranks)
            runner.step(CASES["net"][4][0][0][:, :7], CASES["net"][4][1][0])
        errors[case] = "no error"
    except ConfigError as exc:
        errors[case] = str(exc)
results["errors"] = errors
json.dump(results, open(f"{out_prefix}.{rank}", "w"), indent=1)
print(f"RANK {rank} DONE", flush=True)
