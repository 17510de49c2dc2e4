"""Faults that used to end badly (issue 42): the scheduler killed under ``autopar launch`` and by hand, a rank that
leaves torch's own collective early or is stuck outside it, checkpoint and strategy-file errors that did not name
the problem, more shards than records, and a worker waiting for an absent scheduler without saying how to wait less.

``vague`` marks an error line that does not name what the case needs named (the file, the tensor and both shapes,
the rank, the operation); the other outcomes are the sweep's."""
import os
import signal
import subprocess
import time

import psutil
from sweep_core import PYTHON, TRACE_MARKS, Run, Verdict, case

from sweep_cases.checkpoints import NET, _saved
from sweep_cases.environment import INIT, MS

JOB = "tests/scripts/job.py"


def _wait_text(path, text, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


def _kill_launch_scheduler(popen):
    launcher = psutil.Process(popen.pid)
    for proc in launcher.children():
        if proc.cmdline() == launcher.cmdline():
            proc.kill()  # the scheduler: forked from the launcher, so its command line is the launcher's
            return proc.pid
    return None


TORCHRUN_TRAINS = """
import time, torch, torch.distributed as dist
dist.init_process_group('gloo')
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), 0.01)
for step in range(10**6):
    opt.zero_grad()
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    if step == 20:
        print('TRAINING', flush=True)
    time.sleep(0.005)
"""


@case("kill", "scheduler SIGKILL while a torchrun-style DDP script trains: ends within the heartbeat timeout")
def scheduler_kill_ddp(ctx):
    logs = ctx.path("logs")
    popen = ctx.start(ctx.launch_cmd(2, ctx.script(TORCHRUN_TRAINS), logs=logs), ctx.env())
    t0 = time.monotonic()
    _wait_text(logs / "worker_0.log", "TRAINING")
    _kill_launch_scheduler(popen)
    killed = time.monotonic()
    run = ctx.finish(popen, 60, t0, logs)
    took = time.monotonic() - killed
    return Verdict(run, "hang" if took > 5 + 3 else None, f"ended {took:.1f} s after the kill, rc {run.rc}")


@case("kill", "scheduler SIGKILL in a hand-started cluster: each worker stops in one line")
def scheduler_kill_by_hand(ctx):
    port = ctx.free_port()
    env = dict(MS, MS_SCHED_PORT=port, JOB_STEPS="100000")
    script = str(ctx.repo / JOB)
    files = {name: ctx.path(f"{name}.log") for name in ("sched", "w0", "w1")}
    procs = {}
    t0 = time.monotonic()
    for name, role in (("sched", "MS_SCHED"), ("w0", "MS_WORKER"), ("w1", "MS_WORKER")):
        with open(files[name], "wb") as fh:
            procs[name] = subprocess.Popen([PYTHON, script], env=ctx.env(**{**env, "MS_ROLE": role}), cwd=ctx.dir,
                                           stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True)
    ok = all(_wait_text(files[w], "RANK ") for w in ("w0", "w1"))
    time.sleep(1.5)
    procs["sched"].kill()
    killed = time.monotonic()
    codes = []
    for w in ("w0", "w1"):
        try:
            codes.append(procs[w].wait(timeout=30))
        except subprocess.TimeoutExpired:
            codes.append(None)
    took = time.monotonic() - killed
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    text = "".join(files[w].read_text(errors="replace") for w in ("w0", "w1"))
    run = Run(max((c for c in codes if c is not None), default=None), "", text, time.monotonic() - t0,
              None in codes)
    lines = [line for line in text.splitlines() if "error" in line]
    one = len(lines) == 2 and all("lost the scheduler" in line for line in lines)
    return Verdict(run, None if ok and one else ("traceback" if ok else "hang"),
                   f"workers {codes} {took:.1f} s after the kill")


LEAVES = """
import time, torch, torch.distributed as dist
import autopar
autopar.init()
steps = 3 if dist.get_rank() == 1 else 100000
for i in range(steps):
    if dist.get_rank() == 1 and i == 2 and STUCK:
        time.sleep(1000)
    t = torch.ones(4)
    dist.all_reduce(t)
    time.sleep(0.01)
"""


def _leaves(ctx, stuck, needs):
    run = ctx.launch(2, ctx.script(LEAVES.replace("STUCK", str(stuck))), limit=90, AUTOPAR_COMM_TIMEOUT="5",
                     AUTOPAR_HEARTBEAT_TIMEOUT="3")
    named = "[rank 0] torch.distributed.all_reduce at " in run.logs and needs in run.logs
    return Verdict(run, None if named or "Traceback" in run.text else "vague")


@case("kill", "a rank leaves torch's own all_reduce loop early (exits 0): one line naming it")
def torch_collective_left_early(ctx):
    return _leaves(ctx, False, "rank 1 (it ended cleanly) had already left the job")


@case("kill", "a rank stuck outside torch's own all_reduce: one line at AUTOPAR_COMM_TIMEOUT")
def torch_collective_stuck(ctx):
    return _leaves(ctx, True, "timed out after 5 s (AUTOPAR_COMM_TIMEOUT)")


# ------------------------------------------------------------------------------------------------- checkpoints
def _named(run, *needles):
    text = run.err + run.out
    if run.rc == 0 or any(mark in run.text for mark in TRACE_MARKS) or all(n in text for n in needles):
        return Verdict(run)  # classified as usual (accepted, traceback, clear error)
    return Verdict(run, "vague")


@case("checkpoint", "load_distributed_checkpoint onto another shape names the tensor, both shapes, the files")
def sliced_other_shape_named(ctx):
    d = _saved(ctx)
    run = ctx.python(f"""
        import torch, autopar as ms
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        ms.load_distributed_checkpoint(net, ['{d}/ckpt_0/net-1_8.ckpt', '{d}/ckpt_1/net-1_8.ckpt'])
    """)
    return _named(run, "'0.weight'", "(32, 8)", "(16, 8)", f"{d}/ckpt_0/net-1_8.ckpt")


@case("checkpoint", "ckpt merge DIR whose newest save lacks one rank's checkpoint names that rank")
def merge_dir_newest_lacks_rank(ctx):
    d = _saved(ctx)
    root = ctx.path("ranks")
    root.mkdir()
    for r in (0, 1):
        (root / f"ckpt_{r}").mkdir()
        for k in (4, 8):
            if (r, k) != (1, 8):
                os.rename(d / f"ckpt_{r}/net-1_{k}.ckpt", root / f"ckpt_{r}/net-1_{k}.ckpt")
    run = ctx.cli("ckpt", "merge", str(root), "--out", str(ctx.path("m.ckpt")))
    return _named(run, "rank 1 of 2", "net-1_8.ckpt")


@case("checkpoint", "sliced checkpoints with one rank's .metadata missing name that rank (no DCP traceback)")
def merge_rank_metadata_missing(ctx):
    d = _saved(ctx)
    (d / "ckpt_1/net-1_8.ckpt/.metadata").unlink()
    run = ctx.cli("ckpt", "merge", str(d / "ckpt_0/net-1_8.ckpt"), str(d / "ckpt_1/net-1_8.ckpt"),
                  "--out", str(ctx.path("m.ckpt")))
    return _named(run, "rank 1 of 2", ".metadata")


@case("checkpoint", "load_distributed_checkpoint of a directory of rank directories (one string)", expect="ok",
      new=True)
def sliced_dir_as_string(ctx):
    d = _saved(ctx)
    (d / "integrated").rename(d.parent / f"{d.name}_integrated")  # only the rank directories stay beside
    return ctx.python(f"""
        import torch, autopar as ms
        net = {NET}
        ms.load_distributed_checkpoint(net, '{d}')
        assert all(bool((p == 8).all()) for p in net.parameters())
    """)


# ------------------------------------------------------------------------------------------------- strategies
STRATEGY_OPS = """
import os, sys, torch
import autopar as ms
from autopar import ops
mode, cols = sys.argv[1], int(sys.argv[2])
f = os.path.join(os.path.dirname(os.path.abspath(__file__)), 's.json')
extra = {'strategy_ckpt_save_file': f} if mode == 'save' else {'strategy_ckpt_load_file': f}
ms.set_auto_parallel_context(parallel_mode='semi_auto_parallel', **extra)
ms.init()
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = ms.Parameter(torch.ones(1))
        self.mul = ops.Mul() if mode == 'load' else ops.Mul().shard(((1, 2), (1, 2)))
    def forward(self, x):
        return self.mul(x, x) * self.w
print('ACCEPTED', tuple(Net()(torch.ones(4, cols)).shape), flush=True)
"""


@case("strategy", "a strategy file whose operator strategy does not fit this network's inputs names the file")
def strategy_file_operator_misfit(ctx):
    script = ctx.script(STRATEGY_OPS)
    first = ctx.launch(2, script, args=("save", "8"))
    if first.rc != 0:
        return Verdict(first, None, "saving the strategy failed")
    run = ctx.launch(2, script, args=("load", "7"))
    text = run.err + run.out + run.logs
    return Verdict(run, None if run.rc == 0 or ("strategy file" in text and "(8, 7)" in text) else "vague")


# ------------------------------------------------------------------------------------------------- datasets
@case("dataset", "num_shards=8 over 3 records (each shard would repeat another's rows silently)")
def more_shards_than_records(ctx):
    return ctx.python("""
        import numpy as np, autopar.dataset as ds
        d = ds.NumpySlicesDataset({'x': np.arange(3)}, num_shards=8, shard_id=5, shuffle=False)
        print([int(r['x']) for r in d.create_dict_iterator(output_numpy=True)])
    """)


# ------------------------------------------------------------------------------------------------- timeouts
@case("environment", "worker with no scheduler says how to wait less (one line, then the error)")
def no_scheduler_says_how(ctx):
    run = ctx.python(INIT, limit=40, **MS, MS_SCHED_PORT=ctx.free_port(), AUTOPAR_CLUSTER_TIMEOUT="4")
    return Verdict(run, None if "AUTOPAR_CLUSTER_TIMEOUT=<seconds>" in run.err or run.rc == 0 else "vague")


@case("launcher", "node 1 with --cluster-timeout 3 and no scheduler: ends after 3 s", new=True)
def launch_cluster_timeout(ctx):
    port = ctx.free_port()
    logs = ctx.path("logs")
    run = ctx.run(ctx.launch_cmd(1, ctx.repo / JOB, "--nnodes", "2", "--node-rank", "1", "--master-addr",
                                 "127.0.0.1", "--master-port", str(port), "--token", "t", "--cluster-timeout", "3",
                                 logs=logs), 60, ctx.env(), logs)
    return Verdict(run, "hang" if run.secs > 30 and not run.timed_out else None, f"{run.secs:.0f} s")


@case("launcher", "--cluster-timeout -1", new=True)
def launch_cluster_timeout_negative(ctx):
    return ctx.run(ctx.launch_cmd(1, ctx.repo / JOB, "--cluster-timeout", "-1", logs=ctx.path("logs")), 30)
