"""Faults of running jobs: processes killed, stopped or exiting early, the launcher killed, saves interrupted, and a
torchrun-style script under ``autopar launch``."""
import json
import os
import signal
import time

from sweep_core import PYTHON, Verdict, case

JOB = "tests/scripts/job.py"


def _job(ctx):
    return ctx.repo / JOB


def _start_job(ctx, n=2, script=None, **env):
    logs = ctx.path("logs")
    popen = ctx.start(ctx.launch_cmd(n, script or _job(ctx), logs=logs), ctx.env(**env))
    return popen, logs, time.monotonic()


def _wait_text(path, text, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


@case("kill", "worker SIGKILL mid-run")
def worker_sigkill(ctx):
    popen, logs, t0 = _start_job(ctx, JOB_STEPS="100000")
    _wait_text(logs / "worker_1.log", "RANK 1 OF")
    proc = ctx.find_worker(1)
    proc.kill()
    run = ctx.finish(popen, 60, t0, logs)
    return Verdict(run, None if "rank 1 failed: killed by signal SIGKILL" in run.err else "traceback",
                   f"rc {run.rc}")


@case("kill", "worker SIGTERM mid-run")
def worker_sigterm(ctx):
    popen, logs, t0 = _start_job(ctx, JOB_STEPS="100000")
    _wait_text(logs / "worker_1.log", "RANK 1 OF")
    ctx.find_worker(1).send_signal(signal.SIGTERM)
    return ctx.finish(popen, 60, t0, logs)


@case("kill", "worker SIGSTOP: the job ends within the heartbeat timeout + a few s")
def worker_sigstop(ctx):
    popen, logs, t0 = _start_job(ctx, JOB_STEPS="100000", AUTOPAR_HEARTBEAT_TIMEOUT="5")
    _wait_text(logs / "worker_1.log", "RANK 1 OF")
    ctx.find_worker(1).suspend()
    stopped = time.monotonic()
    run = ctx.finish(popen, 90, t0, logs)
    took = time.monotonic() - stopped
    return Verdict(run, "hang" if took > 5 + 8 else None, f"ended {took:.0f} s after the stop")


@case("kill", "worker raises mid-run (its own traceback in the report's tail is the user's)")
def worker_raises(ctx):
    run = ctx.launch(2, _job(ctx), JOB_FAIL_RANK="1", JOB_STEPS="50")
    clear = "rank 1 failed: exited with code 1" in run.err and "rank 0 failed" not in run.err
    others = run.logs.replace(run.logs[run.logs.find("RANK 1 OF"):], "") if "RANK 1 OF" in run.logs else run.logs
    return Verdict(run, "clear error" if clear and "Traceback" not in others else None)


@case("kill", "worker sys.exit(3) after its work")
def worker_exit3(ctx):
    return ctx.launch(2, _job(ctx), JOB_FAIL_RANK="1", JOB_END_STATUS="3", JOB_STEPS="5", JOB_FAIL_STEP="-1")


@case("kill", "a rank exits 0 before init() (the others must not wait the cluster timeout)")
def exit_before_init(ctx):
    script = ctx.script("""
        import os, sys
        if os.environ.get('AUTOPAR_RANK') == '1':
            sys.exit(0)
        import autopar
        autopar.init()
        print('never here', flush=True)
    """)
    run = ctx.launch(2, script, limit=35, AUTOPAR_CLUSTER_TIMEOUT="45")
    return Verdict(run, "hang" if run.secs > 20 and not run.timed_out else None, f"{run.secs:.0f} s")


@case("kill", "a script that never calls init() ends promptly", expect="ok")
def never_init(ctx):
    run = ctx.launch(2, ctx.script("print('hello', flush=True)\n"), limit=40)
    return Verdict(run, "hang" if run.secs > 12 and not run.timed_out else None, f"{run.secs:.0f} s")


GRANDCHILDREN = """
import os, subprocess, sys, time
import autopar
autopar.init()
subprocess.Popen(['sleep', '1000'])                                    # a helper in the worker's own group
subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)'], start_new_session=True)  # an uploader
open(os.path.join(os.environ['AUTOPAR_LOG_DIR'], 'started_%d' % autopar.get_rank()), 'w').close()
time.sleep(1000)
"""


@case("kill", "launcher SIGKILL: every process of the job goes with it", expect="ok")
def launcher_sigkill(ctx):
    popen, logs, t0 = _start_job(ctx, script=ctx.script(GRANDCHILDREN))
    deadline = time.monotonic() + 60
    while not all((logs / f"started_{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(popen.pid, signal.SIGKILL)
    return Verdict(ctx.finish(popen, 30, t0), "held")  # unless something is left behind (checked first)


@case("kill", "launcher SIGTERM: every process of the job goes with it", expect="ok")
def launcher_sigterm(ctx):
    popen, logs, t0 = _start_job(ctx, script=ctx.script(GRANDCHILDREN))
    deadline = time.monotonic() + 60
    while not all((logs / f"started_{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.2)
    popen.send_signal(signal.SIGTERM)
    run = ctx.finish(popen, 60, t0)
    return Verdict(run, "held" if run.rc == 143 else None)


@case("kill", "scheduler SIGKILL: one line, exit 137, no C++ dumps")
def scheduler_sigkill(ctx):
    popen, logs, t0 = _start_job(ctx, JOB_STEPS="100000")
    _wait_text(logs / "worker_1.log", "RANK 1 OF")
    time.sleep(1)
    import psutil

    launcher = psutil.Process(popen.pid)
    for proc in launcher.children():
        if proc.cmdline() == launcher.cmdline():
            proc.kill()  # the scheduler: forked from the launcher, so its command line is the launcher's
    run = ctx.finish(popen, 60, t0, logs)
    return Verdict(run, None if run.rc == 137 else "traceback", f"rc {run.rc}")


RAW_TORCH = """
import os, time, torch, torch.distributed as dist
import autopar
autopar.init()
for i in range(100000):
    if dist.get_rank() == 1 and i == 20:
        os.kill(os.getpid(), 9)
    t = torch.ones(1000)
    dist.all_reduce(t)
    time.sleep(0.01)
"""


@case("kill", "a peer leaves during torch's own all_reduce (no raw gloo traceback)")
def gloo_peer_leaves(ctx):
    return ctx.launch(2, ctx.script(RAW_TORCH))


TORCHRUN_STYLE = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
ddp = int(os.environ.get('RANK', -1)) != -1
if ddp:
    dist.init_process_group(backend='gloo')
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
if ddp:
    model = DDP(model)
t = torch.tensor([float(dist.get_rank() if ddp else 0)])
if ddp:
    dist.all_reduce(t)
print('WORLD', dist.get_world_size() if ddp else 1, 'SUM', t.item(), flush=True)
"""


@case("torchrun", "a torchrun-style script under autopar launch -n 2 forms one world", expect="ok")
def torchrun_style(ctx):
    run = ctx.launch(2, ctx.script(TORCHRUN_STYLE))
    one_world = run.logs.count("WORLD 2 SUM 1.0") == 2
    return Verdict(run, None if one_world or run.rc != 0 else "accepted", "one world" if one_world else "")


SAVE_KILL = """
import json, os, sys, torch, numpy as np
import autopar as ms, autopar.dataset as ds
from autopar.checkpoint import store
from autopar.train import Callback, CheckpointConfig, Model, ModelCheckpoint
root = sys.argv[1]
ms.set_auto_parallel_context(parallel_mode='data_parallel', gradients_mean=True)
ms.init()
rank, attempt = ms.get_rank(), int(os.environ['AUTOPAR_RESTART'])
original = store.write_integrated
def dying_write(path, model, optimizer, meta, rngs=None):
    if rank == 1 and attempt == 0 and meta.global_step == 6:
        os.kill(os.getpid(), 9)           # killed while writing its checkpoint
    return original(path, model, optimizer, meta, rngs)
store.write_integrated = dying_write
ran = []
class Record(Callback):
    def on_train_step_end(self, rc):
        ran.append(rc.original_args().cur_step_num)
        json.dump(ran, open(os.path.join(root, 'ran_%d_%d.json' % (rank, attempt)), 'w'))
torch.manual_seed(0)
net = torch.nn.Linear(4, 2)
x = np.ones((32, 4), np.float32); y = np.zeros(32, np.int64)
data = ds.NumpySlicesDataset({'x': x, 'y': y}, num_shards=2, shard_id=rank).batch(2)
ck = ModelCheckpoint('net', os.path.join(root, 'ckpt_%d' % rank),
                     CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=KEEP))
Model(net, torch.nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), 0.1)).train(
    1, data, callbacks=[ck, Record()], resume_from=os.path.join(root, 'ckpt_{rank}'))
"""


def _save_kill(ctx, keep):
    script = ctx.script(SAVE_KILL.replace("KEEP", str(keep)))
    run = ctx.launch(2, script, "--max-restarts", "1", args=(str(ctx.dir),), limit=150)
    try:
        resumed = json.loads((ctx.dir / "ran_0_1.json").read_text())
    except (OSError, ValueError):
        return Verdict(run, None, "no second attempt")
    if resumed[0] == 1:
        return Verdict(run, "lost", "restarted at step 1")
    return Verdict(run, "held" if run.rc == 0 else None, f"resumed at step {resumed[0]}")


@case("save", "rank killed while saving, keep_checkpoint_max=2: resume from the common step", expect="ok")
def save_kill_keep2(ctx):
    return _save_kill(ctx, 2)


@case("save", "rank killed while saving, keep_checkpoint_max=1: resume from the common step", expect="ok")
def save_kill_keep1(ctx):
    return _save_kill(ctx, 1)


@case("save", "kill -9 of a process saving in a loop: every complete checkpoint loads", expect="ok")
def save_loop_kill(ctx):
    d = ctx.path("ck")
    d.mkdir()
    popen = ctx.start([PYTHON, str(ctx.repo / "tests/scripts/ckpt_saver.py"), str(d)])
    t0 = time.monotonic()
    _wait_text_stream = time.monotonic() + 60
    while not any(d.glob("big-1_2.ckpt")) and time.monotonic() < _wait_text_stream:
        time.sleep(0.1)
    time.sleep(0.37)
    os.kill(popen.pid, signal.SIGKILL)
    run = ctx.finish(popen, 30, t0)
    check = ctx.python(f"""
        from autopar.checkpoint.store import list_checkpoints, read_integrated
        for f in list_checkpoints('{d}'):
            obj = read_integrated(f.path)
            assert all(float(v.flatten()[0]) == f.step for v in obj['model'].values()), f.path
        print('OK', len(list_checkpoints('{d}')))
    """)
    return Verdict(run, "held" if check.rc == 0 else "lost", check.out.strip())
