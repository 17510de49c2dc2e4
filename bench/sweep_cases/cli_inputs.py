"""Command-line inputs: ``autopar launch`` / ``msrun`` flags, ``autopar plan``, ``autopar data`` / ``train``, and the
dataset and strategy inputs of scripts."""
from sweep_core import PYTHON, Verdict, case

INIT = "import autopar\nautopar.init()\nprint('rank', autopar.get_rank(), 'of', autopar.get_group_size(), flush=True)\n"


def _launch(ctx, *flags, n="2", script=None, limit=60, **env):
    script = script or ctx.script(INIT)
    return ctx.cli("launch", "-n", n, *flags, str(script), limit=limit, **env)


LAUNCH_BAD = [
    ("-n 0", dict(n="0")),
    ("-n -2", dict(n="-2")),
    ("-n abc", dict(n="abc")),
    ("--port 70000", dict(flags=("--port", "70000"))),
    ("--port -1", dict(flags=("--port", "-1"))),
    ("--nnodes 2 without --master-addr", dict(flags=("--nnodes", "2", "--node-rank", "0"))),
    ("--node-rank 3 of --nnodes 2", dict(flags=("--nnodes", "2", "--node-rank", "3", "--master-addr", "127.0.0.1",
                                                "--master-port", "29999"))),
    ("--nnodes 0", dict(flags=("--nnodes", "0"))),
    ("--master-port 70000", dict(flags=("--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                                        "--master-port", "70000"))),
    ("--node-rank 1 without --token", dict(flags=("--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                                                  "--master-port", "29999"))),
    ("--hostfile missing", dict(flags=("--hostfile", "/nonexistent/hosts.txt"))),
    ("--rank-table missing", dict(flags=("--rank-table", "/nonexistent/rt.json", "--server-id", "127.0.0.1"))),
    ("--rank-table without --server-id", dict(flags=("--rank-table", "/nonexistent/rt.json"))),
    ("--max-restarts -1", dict(flags=("--max-restarts", "-1"))),
    ("--host 10.255.255.1 (not this host's)", dict(flags=("--host", "10.255.255.1"))),
    ("unknown flag --foo", dict(flags=("--foo",))),
]

for _name, _kw in LAUNCH_BAD:
    def _fn(ctx, kw=_kw):
        return _launch(ctx, *kw.get("flags", ()), n=kw.get("n", "2"))
    case("launcher", _name)(_fn)


@case("launcher", "script missing")
def script_missing(ctx):
    return ctx.cli("launch", "-n", "2", str(ctx.path("missing.py")))


@case("launcher", "script is a directory")
def script_dir(ctx):
    return ctx.cli("launch", "-n", "2", str(ctx.dir))


@case("launcher", "--log-dir is a file")
def log_dir_file(ctx):
    ctx.path("afile").write_text("x")
    return _launch(ctx, "--log-dir", str(ctx.path("afile")))


@case("launcher", "--log-dir under a file")
def log_dir_under_file(ctx):
    ctx.path("afile").write_text("x")
    return _launch(ctx, "--log-dir", str(ctx.path("afile") / "logs"))


@case("launcher", "--port already in use")
def port_in_use(ctx):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        return _launch(ctx, "--port", str(s.getsockname()[1]))


@case("launcher", "hostfile with a bad line")
def hostfile_bad(ctx):
    ctx.path("hosts.txt").write_text("localhost slots=two\n")
    return _launch(ctx, "--hostfile", str(ctx.path("hosts.txt")))


@case("launcher", "node 1 joins a scheduler that is not there")
def node1_alone(ctx):
    return _launch(ctx, "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
                   str(ctx.free_port()), "--token", "t" * 32, limit=60, AUTOPAR_CLUSTER_TIMEOUT="8")


MSRUN_BAD = [
    ("--worker_num=0", ("--worker_num=0", "--local_worker_num=0")),
    ("--local_worker_num=3 of --worker_num=2", ("--worker_num=2", "--local_worker_num=3")),
    ("--join=maybe", ("--worker_num=2", "--local_worker_num=2", "--join=maybe")),
    ("--sim_level=0 (simulation)", ("--worker_num=2", "--local_worker_num=2", "--sim_level=0")),
    ("--master_port=70000", ("--worker_num=2", "--local_worker_num=2", "--master_port=70000")),
    ("several nodes without --node_rank", ("--worker_num=4", "--local_worker_num=2", "--master_addr=127.0.0.1")),
    ("--worker_num=5 not a multiple of --local_worker_num=2", ("--worker_num=5", "--local_worker_num=2",
                                                             "--node_rank=0")),
]

for _name, _flags in MSRUN_BAD:
    def _fn(ctx, flags=_flags):
        return ctx.run([PYTHON, "-m", "autopar.cli.msrun", *flags, f"--log_dir={ctx.path('logs')}",
                        str(ctx.script(INIT))], 60, ctx.env())
    case("msrun", _name, new=True)(_fn)


# --------------------------------------------------------------------------------------------------- plan
PLAN_BAD = [
    ("nosuch.py:build", ("nosuch.py:build", "-n", "2", "--no-calibrate")),
    ("unknown model name", ("resnet", "-n", "2", "--no-calibrate")),
    ("-n 0", ("mlp", "-n", "0", "--no-calibrate")),
    ("--memory-limit lots", ("mlp", "-n", "2", "--no-calibrate", "--memory-limit", "lots")),
    ("gpt without a size", ("gpt", "-n", "8", "--no-calibrate")),
    ("gpt --size 7b", ("gpt", "--size", "7b", "-n", "8", "--no-calibrate")),
]

for _name, _args in PLAN_BAD:
    def _fn(ctx, args=_args):
        return ctx.cli("plan", *args, limit=120)
    case("plan", _name)(_fn)


@case("plan", "--out under a file")
def plan_out_under_file(ctx):
    ctx.path("afile").write_text("x")
    return ctx.cli("plan", "mlp", "-n", "2", "--width", "64", "--no-calibrate", "--out",
                   str(ctx.path("afile") / "plan.json"))


@case("plan", "FILE.py without the function")
def plan_no_function(ctx):
    ctx.path("net.py").write_text("x = 1\n")
    return ctx.cli("plan", f"{ctx.path('net.py')}:build", "-n", "2", "--no-calibrate")


@case("plan", "FILE.py whose function raises")
def plan_function_raises(ctx):
    ctx.path("net.py").write_text("def build():\n    raise ValueError('my model is broken')\n")
    return ctx.cli("plan", f"{ctx.path('net.py')}:build", "-n", "2", "--no-calibrate")


# ----------------------------------------------------------------------------------------------- datasets
DATA_BAD = [
    ("Cifar10Dataset of a missing directory", "ds.Cifar10Dataset('/nonexistent/cifar')"),
    ("Cifar10Dataset of an empty directory", "ds.Cifar10Dataset(EMPTY)"),
    ("Cifar10Dataset of a truncated file", "ds.Cifar10Dataset(TRUNC)"),
    ("num_shards=0", "ds.NumpySlicesDataset({'x': X}, num_shards=0, shard_id=0)"),
    ("shard_id == num_shards", "ds.NumpySlicesDataset({'x': X}, num_shards=2, shard_id=2)"),
    ("batch(0)", "ds.NumpySlicesDataset({'x': X}).batch(0)"),
    ("columns of different lengths", "ds.NumpySlicesDataset({'x': X, 'y': X[:3]})"),
    ("map over a missing column", "list(ds.NumpySlicesDataset({'x': X}).map(lambda v: v, input_columns=['nope'])"
                                  ".create_tuple_iterator())"),
]

DATA_PRELUDE = """
import os, numpy as np
import autopar.dataset as ds
X = np.zeros((8, 4), np.float32)
EMPTY = os.path.join(os.getcwd(), 'empty'); os.makedirs(EMPTY, exist_ok=True)
TRUNC = os.path.join(os.getcwd(), 'trunc', 'cifar-10-batches-bin'); os.makedirs(TRUNC, exist_ok=True)
for name in ['data_batch_%d.bin' % i for i in range(1, 6)] + ['test_batch.bin']:
    open(os.path.join(TRUNC, name), 'wb').write(b'\\0' * 5000)
TRUNC = os.path.dirname(TRUNC)
"""

for _name, _code in DATA_BAD:
    def _fn(ctx, code=_code):
        return ctx.python(DATA_PRELUDE + f"d = {code}\nprint(len(list(d.create_tuple_iterator())) if hasattr(d, "
                          f"'create_tuple_iterator') else d)\n")
    case("dataset", _name)(_fn)


@case("dataset", "autopar data synth-cifar10 into a file")
def synth_into_file(ctx):
    ctx.path("afile").write_text("x")
    return ctx.cli("data", "synth-cifar10", str(ctx.path("afile")), "--records-per-file", "10")


@case("dataset", "autopar train --synthetic-records 48 after 24 (must not reuse)")
def synthetic_records_reuse(ctx):
    logs = ctx.path("train")
    common = ("train", "-n", "1", "--synthetic", "--epochs", "1", "--batch-size", "4", "--steps-per-epoch", "1",
              "--log-dir", str(logs))
    first = ctx.cli(*common, "--synthetic-records", "24", limit=240)
    if first.rc != 0:
        return Verdict(first, None, "first run failed")
    run = ctx.cli(*common, "--synthetic-records", "48", limit=240)
    size = (logs / "synthetic-cifar10" / "cifar-10-batches-bin" / "data_batch_1.bin").stat().st_size
    return Verdict(run, "held" if size == 48 * 3073 and run.rc == 0 else "accepted", f"{size // 3073} records")


# -------------------------------------------------------------------------------------------- strategies
STRAT = """
import json, os, sys, torch
import autopar as ms
from autopar import ops
ms.set_auto_parallel_context(parallel_mode='semi_auto_parallel', gradients_mean=True, {extra})
ms.init()
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = ms.Parameter(torch.ones(8, {cols}))
        self.mm = ops.MatMul().shard({strategy})
    def forward(self, x):
        return self.mm(x, self.w)
net = Net()
out = net(torch.ones(4, 8))
print('ACCEPTED', tuple(out.shape), flush=True)
"""


def _strategy(ctx, strategy="((1, 1), (1, 2))", cols=6, extra=""):
    return ctx.launch(2, ctx.script(STRAT.format(strategy=strategy, cols=cols, extra=extra)))


@case("strategy", "MatMul strategy with three entries")
def strategy_wrong_count(ctx):
    return _strategy(ctx, "((1, 1), (1, 2), (1, 1))")


@case("strategy", "a split that does not divide the dimension (7 columns by 2)")
def strategy_not_dividing(ctx):
    return _strategy(ctx, cols=7)


@case("strategy", "more parts than devices")
def strategy_too_many(ctx):
    return _strategy(ctx, "((1, 1), (1, 4))", cols=8)


@case("strategy", "strategy_ckpt_load_file missing")
def strategy_file_missing(ctx):
    return _strategy(ctx, extra="strategy_ckpt_load_file='/nonexistent/strategy.json'")


@case("strategy", "strategy_ckpt_load_file not JSON")
def strategy_file_garbage(ctx):
    ctx.path("s.json").write_text("{oops")
    return _strategy(ctx, extra=f"strategy_ckpt_load_file={str(ctx.path('s.json'))!r}")


@case("strategy", "strategy file written for another parameter shape (the lead's item)")
def strategy_file_other_shape(ctx):
    first = _strategy(ctx, cols=8, extra=f"strategy_ckpt_save_file={str(ctx.path('s.json'))!r}")
    if first.rc != 0:
        return Verdict(first, None, "saving the strategy failed")
    return _strategy(ctx, cols=4, extra=f"strategy_ckpt_load_file={str(ctx.path('s.json'))!r}")

