"""Worker: pipeline parallelism (pipeline_stages=2, nn.PipelineCell, torch.distributed.pipelining) equals one process.

argv: OUT_PREFIX CKPT_DIR [LOAD_FROM]. 2 stages x (world / 2) data-parallel replicas. Cases: Model.train with
PipelineCell(WithLossCell(net, loss), micro_size=4), schedules 1F1B and GPipe, SGD and AdamW (the MindSpore door:
cell.pipeline_stage; the micro-batches' losses summed, as MindSpore's PipelineCell), MindSpore 2.3's functional
pipeline (PipelineCell inside value_and_grad, PipelineGradReducer); the PyTorch door (PipelineParallel with split
points, a plain loop, AdamW made before the first step; the mean) recording each step's loss. Each against one process on the same global batch: per-step losses, and
this rank's stage parameters after 5 steps. Bad input: a cell with no stage, stages that do not divide the ranks,
micro_size < stages (a warning). Saves the MindSpore-door SGD/1f1b case integrated (CKPT_DIR/integrated.ckpt[.r])
and sliced (CKPT_DIR/sliced_<r>); with LOAD_FROM, loads that sliced set (written by another world size) into a
plain DATA_PARALLEL network. Writes {case: result} to OUT_PREFIX.<rank>.
"""
import json
import sys
import warnings

import numpy as np
import torch
from pipeline_net import Net

import autopar
from autopar import nn
from autopar.communication import get_group_size, get_rank, init
from autopar.errors import ConfigError
from autopar.parallel.pipeline.runner import PipelineParallel, pipeline_of
from autopar.train import Model
from autopar.train.callbacks import Callback

out_prefix, ckpt_dir = sys.argv[1], sys.argv[2]
load_from = sys.argv[3] if len(sys.argv) > 3 else None
init()
rank, n = get_rank(), get_group_size()
replicas = n // 2
GLOBAL = 16
rng = np.random.default_rng(0)
X = torch.tensor(rng.standard_normal((5, GLOBAL, 8)).astype(np.float32))
Y = torch.tensor(rng.integers(0, 5, (5, GLOBAL)))
OPTIMIZERS = {"SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
              "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01)}


def staged() -> Net:
    net = Net()
    for name, stage in (("l1", 0), ("l2", 0), ("l3", 1), ("l4", 1)):
        getattr(net, name).pipeline_stage = stage
    return net


def reference(opt_name: str, micro_size: int = 1) -> tuple[list[float], dict]:
    """One process on the global batch. ``micro_size``: MindSpore's PipelineCell adds its micro-batches' losses, so
    its loss and gradients are micro_size x the mean's (the PyTorch door's PipelineParallel keeps the mean)."""
    autopar.reset_auto_parallel_context()
    net = Net()
    opt = OPTIMIZERS[opt_name](net.parameters())
    losses = []
    for step in range(5):
        loss = torch.nn.functional.cross_entropy(net(X[step]), Y[step]) * micro_size
        losses.append(float(loss))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses, {k: v.detach().clone() for k, v in net.named_parameters()}


def replica_batch(step: int):
    d, per = rank % replicas, GLOBAL // replicas
    return X[step][d * per:(d + 1) * per], Y[step][d * per:(d + 1) * per]


def set_pipeline(scheduler: str = "1f1b") -> None:
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True, pipeline_stages=2,
                                      pipeline_config={"pipeline_scheduler": scheduler})


class Losses(Callback):
    def __init__(self):
        self.values = []

    def step_end(self, run_context):
        self.values.append(float(run_context.original_args().net_outputs))


class StepEnd(Callback):
    def __init__(self, fn):
        self.fn = fn

    def step_end(self, run_context):
        self.fn()


def stage_diff(runner: PipelineParallel, ref: dict) -> float:
    if runner._sharded:  # ZeRO: the shards trained; the network's parameters are whole again after a gather
        runner.gather_parameters()
        own = dict(runner.network.named_parameters())
        held = [(k, own[k]) for k, stages in runner.owner.items() if runner.stage_index in stages and k in own]
    else:
        name_of = {id(p): k for k, p in runner.network.named_parameters()}  # the stage's parameters: the network's
        held = [(name_of[id(p)], p) for p in runner.stage_module.parameters()]
    assert held, "this stage holds no parameters"
    return max(float((p - ref[k]).abs().max()) for k, p in held)


def optimizer_state_numel(opt) -> int:
    """Elements of the optimizer state this rank holds (a ZeRO shard's: its slice)."""
    return sum((v.to_local() if hasattr(v, "to_local") else v).numel() for st in opt.state.values()
               for v in st.values() if isinstance(v, torch.Tensor) and v.dim())


def train_model(scheduler: str, opt_name: str, **context):
    """Model.train of PipelineCell(WithLossCell(staged net, loss), micro_size=4) over 5 steps, the context's other
    keys as given: (network, optimizer, the losses' callback)."""
    set_pipeline(scheduler)
    if context:
        autopar.set_auto_parallel_context(**context)
    net = staged()
    opt = OPTIMIZERS[opt_name](net.parameters())
    model = Model(nn.PipelineCell(nn.WithLossCell(net, torch.nn.CrossEntropyLoss()), micro_size=4), optimizer=opt)
    cb = Losses()
    model.train(1, [replica_batch(s) for s in range(5)], callbacks=[cb])
    return net, opt, cb


def interleaved() -> Net:
    """2 stages x 2 segments (MindSpore's pipeline_segment): rank 0 runs l1 and l3, rank 1 l2 and l4."""
    net = Net()
    for name, segment, stage in (("l1", 0, 0), ("l2", 0, 1), ("l3", 1, 0), ("l4", 1, 1)):
        getattr(net, name).pipeline_segment, getattr(net, name).pipeline_stage = segment, stage
    return net


results = {}
refs = {name: reference(name) for name in OPTIMIZERS}  # the PyTorch door: the mean
summed = {name: reference(name, micro_size=4) for name in OPTIMIZERS}  # the MindSpore door: PipelineCell's sum
for scheduler in ("1f1b", "gpipe"):
    for opt_name in OPTIMIZERS:
        key = f"model/{scheduler}/{opt_name}"
        try:
            net, opt, cb = train_model(scheduler, opt_name)
            runner = pipeline_of(net)
            results[key] = {"loss_diff": max(abs(a - b) for a, b in zip(cb.values, summed[opt_name][0])),
                            "param_diff": stage_diff(runner, summed[opt_name][1]),
                            "stage": runner.stage_index}
            if key == "model/1f1b/SGD":
                autopar.save_checkpoint(net, f"{ckpt_dir}/integrated.ckpt" + (f".{rank}" if rank else ""))
                autopar.save_checkpoint(net, f"{ckpt_dir}/sliced_{rank}", integrated_save=False)
                results[key]["saved"] = {k: v.detach().tolist() for k, v in net.named_parameters()}
        except Exception as exc:  # noqa: BLE001 - recorded: the test names the case
            import traceback

            results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "trace": traceback.format_exc()[-1500:]}
# built without its memory (MindSpore's no_init_parameters): each stage makes only its own layers' parameters, with
# the values the eager build draws -- the other stage's stay on the meta device until training ends and the whole
# network is made current on every rank
key = "model/1f1b/AdamW/no_init"
try:
    set_pipeline("1f1b")
    with nn.utils.no_init_parameters():
        net = staged()
    never_made = []
    model = Model(nn.PipelineCell(nn.WithLossCell(net, torch.nn.CrossEntropyLoss()), micro_size=4),
                  optimizer=OPTIMIZERS["AdamW"](net.parameters()))
    cb = Losses()
    model.train(1, [replica_batch(s) for s in range(5)], callbacks=[cb, StepEnd(lambda: never_made.append(
        sorted(k for k, p in net.named_parameters() if p.is_meta)))])
    runner = pipeline_of(net)
    results[key] = {"loss_diff": max(abs(a - b) for a, b in zip(cb.values, summed["AdamW"][0])),
                    "param_diff": stage_diff(runner, summed["AdamW"][1]), "stage": runner.stage_index,
                    "never_made": never_made[0]}
except Exception as exc:  # noqa: BLE001 - recorded: the test names the case
    import traceback

    results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "trace": traceback.format_exc()[-1500:]}
for scheduler in ("1f1b", "gpipe"):  # interleaved: two pieces per rank (Interleaved1F1B / LoopedBFS)
    key = f"interleaved/{scheduler}/SGD"
    try:
        set_pipeline(scheduler)
        autopar.set_auto_parallel_context(pipeline_config={"pipeline_scheduler": scheduler, "pipeline_interleave": True})
        net = interleaved()
        model = Model(nn.PipelineCell(nn.WithLossCell(net, torch.nn.CrossEntropyLoss()), micro_size=4),
                      optimizer=OPTIMIZERS["SGD"](net.parameters()))
        cb = Losses()
        model.train(1, [replica_batch(s) for s in range(5)], callbacks=[cb])
        runner = pipeline_of(net)
        results[key] = {"loss_diff": max(abs(a - b) for a, b in zip(cb.values, summed["SGD"][0])),
                        "param_diff": stage_diff(runner, summed["SGD"][1]), "stage": runner.stage_index,
                        "pieces": len(list(runner.stage_module.children())) if runner.virtual_stages > 1 else 1}
    except Exception as exc:  # noqa: BLE001
        import traceback

        results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "trace": traceback.format_exc()[-1500:]}
# ZeRO inside the stages (enable_parallel_optimizer: each stage's optimizer state, and at level 3 its weights,
# sharded over the stage's replicas on FSDP2) -- with one replica a stage (2 ranks) nothing to shard, which is said
for level, opt_name, scheduler in (("level1", "AdamW", "1f1b"), ("level3", "SGD", "gpipe")):
    key = f"zero/{level}/{opt_name}/{scheduler}"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            net, opt, cb = train_model(scheduler, opt_name, enable_parallel_optimizer=True,
                                       parallel_optimizer_config={"optimizer_level": level})
        runner = pipeline_of(net)
        stage_numel = sum(ref.numel() for k, ref in summed[opt_name][1].items()
                          if runner.stage_index in runner.owner.get(k, ()))
        slots = 2 if opt_name == "AdamW" else 1
        results[key] = {"loss_diff": max(abs(a - b) for a, b in zip(cb.values, summed[opt_name][0])),
                        "param_diff": stage_diff(runner, summed[opt_name][1]), "stage": runner.stage_index,
                        "state_share": optimizer_state_numel(opt) / (slots * stage_numel),
                        "warned": " | ".join(str(w.message) for w in caught if "parallel_optimizer" in str(w.message)),
                        "banner": __import__("autopar.parallel.summary", fromlist=["describe"]).describe(
                            runner.state, net)}
        if level == "level1":  # a checkpoint of the sharded stages holds the whole, current network
            autopar.save_checkpoint(net, f"{ckpt_dir}/zero.ckpt")  # (written by rank 0)
            torch.distributed.barrier()
            loaded = autopar.load_checkpoint(f"{ckpt_dir}/zero.ckpt")
            results[key]["ckpt_diff"] = max(float((loaded[k].detach() - v).abs().max())
                                            for k, v in summed[opt_name][1].items())
    except Exception as exc:  # noqa: BLE001
        import traceback

        results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "trace": traceback.format_exc()[-1500:]}
# MindSpore 2.3's functional pipeline: PipelineCell called inside value_and_grad, PipelineGradReducer, opt(grads)
key = "functional/1f1b/Momentum"
try:
    set_pipeline("1f1b")
    net = staged()
    net.print = autopar.ops.Print()
    opt = nn.Momentum(net.parameters(), 0.1, 0.9)
    cell = nn.PipelineCell(nn.WithLossCell(net, torch.nn.CrossEntropyLoss()), 4)
    grad_fn = autopar.value_and_grad(lambda x, y: cell(x, y), None, opt.parameters)
    reducer = nn.PipelineGradReducer(opt.parameters)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            loss, grads = grad_fn(*replica_batch(step))
            opt(reducer(grads))
            losses.append(float(loss))
    runner = pipeline_of(net)
    results[key] = {"loss_diff": max(abs(a - b) for a, b in zip(losses, summed["SGD"][0])),
                    "param_diff": stage_diff(runner, summed["SGD"][1]), "stage": runner.stage_index,
                    "print_warned": any("ops.Print in a pipelined network" in str(w.message) for w in caught)}
except Exception as exc:  # noqa: BLE001
    import traceback

    results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "trace": traceback.format_exc()[-1500:]}
# the PyTorch door: split points by name, a plain loop, the optimizer made first; then interleaved (three split
# points, two virtual stages per rank); and with ZeRO inside the stages (grads="stage", zero="level1")
for key, points, virtual, extra in (("torch/1f1b/AdamW", ["l3"], 1, {}),
                                    ("torch/interleaved/AdamW", ["l2", "l3", "l4"], 2, {}),
                                    ("torch/zero/AdamW", ["l3"], 1,
                                     {"grads": "stage", "zero": "level1" if replicas > 1 else None})):
    try:
        autopar.reset_auto_parallel_context()
        net = Net()
        opt = torch.optim.AdamW(net.parameters(), lr=0.01)
        runner = PipelineParallel(net, torch.nn.functional.cross_entropy, micro_batches=4, split_points=points,
                                  virtual_stages=virtual, **extra)
        losses = []
        for step in range(5):
            losses.append(float(runner.step(*replica_batch(step))))
            opt.step()
            opt.zero_grad()
        results[key] = {"loss_diff": max(abs(a - b) for a, b in zip(losses, refs["AdamW"][0])),
                        "param_diff": stage_diff(runner, refs["AdamW"][1]), "stage": runner.stage_index,
                        "sharded": len(runner._sharded)}
    except Exception as exc:  # noqa: BLE001
        results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}

errors = {}
for case, build in (("no_stage", lambda: Net()), ("bad_stages", staged), ("sequence_split", staged)):
    try:  # (sequence_split: a dataset_strategy that splits the sequence -- context parallelism -- with stages)
        autopar.reset_auto_parallel_context()
        autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel",
                                          pipeline_stages=3 if case == "bad_stages" else 2,
                                          **({"dataset_strategy": ((1, 2), (1, 2))} if case == "sequence_split" else {}))
        model = Model(nn.PipelineCell(nn.WithLossCell(build(), torch.nn.CrossEntropyLoss()), 4),
                      optimizer=torch.optim.SGD(Net().parameters(), lr=0.1))
        model.train(1, [replica_batch(0)])
        errors[case] = "no error"
    except ConfigError as exc:
        errors[case] = str(exc)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    autopar.reset_auto_parallel_context()
    PipelineParallel(Net(), torch.nn.CrossEntropyLoss(), micro_batches=1, split_points=["l3"])
errors["bubble"] = " | ".join(str(w.message) for w in caught)
try:  # ZeRO shards what a stage's ranks step alone: with grads="full" every rank steps every parameter
    PipelineParallel(Net(), torch.nn.CrossEntropyLoss(), micro_batches=4, split_points=["l3"], zero="level1")
    errors["zero_full"] = "no error"
except ConfigError as exc:
    errors["zero_full"] = str(exc)
results["errors"] = errors

if load_from:  # the 2-stage sliced checkpoint, onto this world size, in plain DATA_PARALLEL
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
    plain = Net()
    files = sorted(str(p) for p in __import__("pathlib").Path(load_from).glob("sliced_*.ckpt"))
    autopar.load_distributed_checkpoint(plain, files)
    saved = json.load(open(f"{load_from}/saved.json"))
    results["reload"] = {"diff": max(float((p - torch.tensor(saved[k])).abs().max())
                                     for k, p in plain.named_parameters()), "files": len(files)}
json.dump(results, open(f"{out_prefix}.{rank}", "w"), indent=1)
if rank == 0 and "saved" in results.get("model/1f1b/SGD", {}):
    json.dump(results["model/1f1b/SGD"]["saved"], open(f"{ckpt_dir}/saved.json", "w"))
print(f"RANK {rank} DONE", flush=True)
