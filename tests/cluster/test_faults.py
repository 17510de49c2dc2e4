"""Faults that used to hang, leave processes behind or print tracebacks (issue 33, items 3, 5, 6 and 7): each ends
within seconds, in one line that names the fault, with an exit code that says what happened and nothing left."""
import os
import signal
import time

import psutil

from autopar.cluster.netutil import free_port
from procutil import PYTHON, SCRIPTS, autopar_cmd, find_worker, wait_for

JOB = str(SCRIPTS / "job.py")
DUMPS = ("frame #", "Exception raised from", "Traceback (most recent call last)", "terminate called")






def no_dumps(*texts):
    for text in texts:
        for mark in DUMPS:
            assert mark not in text, f"{mark!r} in:\n{text[-3000:]}"


def test_early_exits_end_the_job_at_once(procs, tmp_path):
    """A rank that exits 0 before init() while the other joined: one line naming it, exit 1, long before the
    cluster timeout (it used to wait all of it). A script that never calls init(): exit 0 at once (it used to
    take ~30 s)."""
    script = tmp_path / "early.py"
    script.write_text("import os, sys\n"
                      "if os.environ['AUTOPAR_RANK'] == '1':\n"
                      "    sys.exit(0)\n"
                      "import autopar\n"
                      "autopar.init()\n")
    t0 = time.monotonic()
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "a"), str(script)),
                    procs.env(AUTOPAR_CLUSTER_TIMEOUT="150"), timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "autopar: error: rank 1 failed: exited with code 0 before joining the job" in res.stderr, res.stderr
    assert time.monotonic() - t0 < 100
    no_dumps(res.stdout, res.stderr)
    plain = tmp_path / "plain.py"
    plain.write_text("print('hello', flush=True)\n")
    t0 = time.monotonic()
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "b"), str(plain)), timeout=120)
    assert res.returncode == 0 and "hello" in res.stdout, res.stderr
    assert time.monotonic() - t0 < 25
    assert not procs.wait_no_leftovers()


GRANDCHILDREN = """
import os, subprocess, sys, time
import autopar
autopar.init()
subprocess.Popen(['sleep', '1000'])                                    # a helper in the worker's own group
subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)'], start_new_session=True)  # its own session
open(os.path.join(os.environ['AUTOPAR_LOG_DIR'], 'started_%d' % autopar.get_rank()), 'w').close()
time.sleep(1000)
"""


def test_launcher_killed_takes_what_the_workers_started(procs, tmp_path):
    script = tmp_path / "spawner.py"
    script.write_text(GRANDCHILDREN)
    logs = tmp_path / "logs"
    launcher = procs.start(autopar_cmd("launch", "-n", "2", "--log-dir", str(logs), str(script)))
    deadline = time.monotonic() + 120
    while not all((logs / f"started_{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and launcher.poll() is None, "the job never started its helpers"
        time.sleep(0.2)
    assert len([p for p in procs.leftovers() if p.name() == "sleep"]) == 2
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=10)
    assert not procs.wait_no_leftovers(timeout=15)


def test_stopped_worker_and_killed_scheduler(procs, tmp_path):
    """SIGSTOP: the job ends within the heartbeat timeout + a few s (it took 28-30 s), naming the stopped rank.
    The scheduler SIGKILLed: exit 137 (it was 247) and no C++ stack dump in the console or the logs."""
    launcher = procs.start(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "a"), JOB),
                           procs.env(JOB_STEPS="100000", AUTOPAR_HEARTBEAT_TIMEOUT="3"))
    wait_for(tmp_path / "a" / "worker_1.log", "RANK 1 OF 2")
    find_worker(procs, 1).suspend()
    t0 = time.monotonic()
    out, err = (x.decode() for x in launcher.communicate(timeout=120))
    assert time.monotonic() - t0 < 3 + 8, time.monotonic() - t0
    assert launcher.returncode == 128 + signal.SIGSTOP, err
    assert "autopar: error: rank 1 failed: stopped (SIGSTOP)" in err and "rank 0 failed" not in err, err
    assert not procs.wait_no_leftovers()

    logs = tmp_path / "b"
    launcher = procs.start(autopar_cmd("launch", "-n", "2", "--log-dir", str(logs), JOB), procs.env(JOB_STEPS="100000"))
    wait_for(logs / "worker_1.log", "RANK 1 OF 2")
    me = psutil.Process(launcher.pid)
    scheduler = next(p for p in me.children() if p.cmdline() == me.cmdline())  # forked from the launcher
    scheduler.kill()
    t0 = time.monotonic()
    out, err = (x.decode() for x in launcher.communicate(timeout=120))
    assert time.monotonic() - t0 < 10 + 5, time.monotonic() - t0  # within AUTOPAR_HEARTBEAT_TIMEOUT (10)
    assert launcher.returncode == 137, err
    assert f"autopar: error: the scheduler (pid {scheduler.pid}) was killed by signal SIGKILL: the job lost its " \
           "rendezvous and every worker was stopped" in err, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
    no_dumps(out, err, *(p.read_text() for p in logs.glob("worker_*.log")))
    assert not procs.wait_no_leftovers()


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


def test_peer_leaves_during_torch_collective(procs, tmp_path):
    """torch's own all_reduce losing its peer: the surviving rank stops with one line ("job aborted ..."), exit
    EXIT_ABORTED, not a raw gloo traceback (started by hand, as a run.sh does: no launcher stops it first)."""
    script = tmp_path / "raw.py"
    script.write_text(RAW_TORCH)
    port = str(free_port())
    env = dict(MS_WORKER_NUM="2", MS_SCHED_HOST="127.0.0.1", MS_SCHED_PORT=port, AUTOPAR_HEARTBEAT_TIMEOUT="3")
    sched = procs.start([PYTHON, str(script)], procs.env(MS_ROLE="MS_SCHED", **env), log=tmp_path / "sched.log")
    workers = [procs.start([PYTHON, str(script)], procs.env(MS_ROLE="MS_WORKER", AUTOPAR_RANK=str(r), **env),
                           log=tmp_path / f"w{r}.log") for r in range(2)]
    assert [w.wait(timeout=120) for w in workers] == [86, -signal.SIGKILL]
    assert sched.wait(timeout=60) != 0
    log0 = (tmp_path / "w0.log").read_text()
    assert "autopar: error: [rank 0] job aborted (rank 1 on" in log0 or "autopar: error: job aborted" in log0, log0
    no_dumps(log0)
    assert "job failed (rank 1 on" in (tmp_path / "sched.log").read_text()
    assert not procs.wait_no_leftovers()


def test_no_scheduler_and_no_peer_end_in_one_line(procs, tmp_path):
    """A worker whose scheduler never comes waits the cluster timeout printing one line (it printed a C++ stack
    dump every few seconds); a hand-started rank-table rank 0 whose peer never comes ends after the cluster
    timeout (it waited the collective timeout, 30 minutes)."""
    port = free_port()
    res = procs.run([PYTHON, JOB], procs.env(MS_ROLE="MS_WORKER", MS_WORKER_NUM="2", MS_SCHED_HOST="127.0.0.1",
                                             MS_SCHED_PORT=str(port), AUTOPAR_CLUSTER_TIMEOUT="4"), timeout=60)
    assert res.returncode != 0
    assert f"autopar: error: cannot reach the scheduler at 127.0.0.1:{port} within 4 s" in res.stderr, res.stderr
    no_dumps(res.stderr)
    assert len(res.stderr.strip().splitlines()) == 2  # "waiting for the scheduler ..." and the error
    assert res.stderr.startswith(f"autopar: waiting for the scheduler at 127.0.0.1:{port} for up to 4 s (to wait "
                                 "less: AUTOPAR_CLUSTER_TIMEOUT=<seconds>, or autopar launch --cluster-timeout / "
                                 "msrun --cluster_time_out)"), res.stderr
    # under autopar launch: --cluster-timeout is what the workers wait (default 600 s, torchrun's rendezvous)
    t0 = time.monotonic()
    res = procs.run(autopar_cmd("launch", "-n", "1", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                                "127.0.0.1", "--master-port", str(port), "--token", "t", "--cluster-timeout", "3",
                                "--log-dir", str(tmp_path / "node1"), JOB), timeout=90)
    assert res.returncode == 1 and time.monotonic() - t0 < 45, res.stderr
    assert f"cannot reach the scheduler at 127.0.0.1:{port} within 3 s" in res.stderr, res.stderr
    assert "AUTOPAR_CLUSTER_TIMEOUT=3\n" in (tmp_path / "node1" / "env_1.log").read_text()

    table = tmp_path / "rank_table.json"
    table.write_text('{"version": "1.0", "server_count": "1", "status": "completed", "server_list": [{"server_id": '
                     '"127.0.0.1", "host_nic_ip": "reserve", "device": [{"device_id": "0", "device_ip": '
                     '"192.1.27.0", "rank_id": "0"}, {"device_id": "1", "device_ip": "192.1.27.1", "rank_id": "1"}]}]}')
    t0 = time.monotonic()
    res = procs.run([PYTHON, JOB], procs.env(RANK_TABLE_FILE=str(table), RANK_ID="0", MASTER_PORT=str(free_port()),
                                             AUTOPAR_CLUSTER_TIMEOUT="5"), timeout=90)
    assert res.returncode != 0 and time.monotonic() - t0 < 60
    assert "autopar: error: only 1 of 2 ranks reached the rendezvous" in res.stderr, res.stderr
    no_dumps(res.stderr)


LEAVES_EARLY = """
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


def test_torch_collective_left_early_or_stuck_is_one_line(procs, tmp_path):
    """Rank 1 leaves torch's own all_reduce loop early (exits 0), or hangs outside it: rank 0's log holds one line
    naming itself, the operation and the script's line (and the rank that left) -- it held a gloo traceback."""
    for stuck in (False, True):
        script = tmp_path / f"leaves_{stuck}.py"
        script.write_text(LEAVES_EARLY.replace("STUCK", str(stuck)))
        logs = tmp_path / f"logs_{stuck}"
        res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(logs), str(script)),
                        procs.env(AUTOPAR_COMM_TIMEOUT="5", AUTOPAR_HEARTBEAT_TIMEOUT="3"), timeout=120)
        assert res.returncode == 1, res.stdout + res.stderr
        log0 = (logs / "worker_0.log").read_text()
        where = f"[rank 0] torch.distributed.all_reduce at {script.name}:10"
        if stuck:
            want = f"{where} timed out after 5 s (AUTOPAR_COMM_TIMEOUT): another rank never joined it"
        else:
            want = f"{where} failed: rank 1 (it ended cleanly) had already left the job"
        assert log0.startswith(f"autopar: error: {want}") and len(log0.strip().splitlines()) == 1, log0
        # the rank's one-line error, once: in the report, not also streamed and repeated in its log's tail
        assert f"autopar: error: rank 0 failed: {want.removeprefix('[rank 0] ')}" in res.stderr, res.stderr
        assert (res.stdout + res.stderr).count(want.split(": ", 1)[-1][:40]) == 1, res.stdout + res.stderr
        no_dumps(res.stdout, res.stderr, *(p.read_text() for p in logs.glob("*.log")))
        assert not procs.wait_no_leftovers()


def test_hand_started_scheduler_killed_is_one_line(procs, tmp_path):
    """A scheduler started by hand (MS_ROLE=MS_SCHED, no TORCH_CPP_LOG_LEVEL) killed while the workers train: each
    worker stops with one line, no C++ stack dump before it (c10d printed one from the heartbeat's store call)."""
    port = str(free_port())
    env = dict(MS_WORKER_NUM="2", MS_SCHED_HOST="127.0.0.1", MS_SCHED_PORT=port, AUTOPAR_HEARTBEAT_TIMEOUT="3",
               JOB_STEPS="100000")
    sched = procs.start([PYTHON, JOB], procs.env(MS_ROLE="MS_SCHED", **env), log=tmp_path / "sched.log")
    workers = [procs.start([PYTHON, JOB], procs.env(MS_ROLE="MS_WORKER", AUTOPAR_RANK=str(r), **env),
                           log=tmp_path / f"w{r}.log") for r in range(2)]
    for r in range(2):
        wait_for(tmp_path / f"w{r}.log", f"RANK {r} OF 2")
    time.sleep(1.5)
    sched.kill()
    t0 = time.monotonic()
    assert [w.wait(timeout=60) for w in workers] == [86, 86]
    assert time.monotonic() - t0 < 3 + 5
    for r in range(2):
        log = (tmp_path / f"w{r}.log").read_text()
        assert log.strip().splitlines()[-1] == f"autopar: error: lost the scheduler at 127.0.0.1:{port}; stopping"
        no_dumps(log)
    assert not procs.wait_no_leftovers()


def test_launch_cluster_timeout_default_is_torchruns(monkeypatch):
    from autopar.cluster.launcher import LaunchConfig, Launcher

    monkeypatch.delenv("AUTOPAR_CLUSTER_TIMEOUT", raising=False)
    assert Launcher(LaunchConfig(nproc=1, script=JOB))._base_env(0)["AUTOPAR_CLUSTER_TIMEOUT"] == "600"
    monkeypatch.setenv("AUTOPAR_CLUSTER_TIMEOUT", "42")
    assert Launcher(LaunchConfig(nproc=1, script=JOB))._base_env(0)["AUTOPAR_CLUSTER_TIMEOUT"] == "42"
    launcher = Launcher(LaunchConfig(nproc=1, script=JOB, cluster_timeout=7))
    assert launcher._base_env(0)["AUTOPAR_CLUSTER_TIMEOUT"] == "7"


def test_an_abort_in_teardown_after_a_clean_end_is_not_a_failure(procs, tmp_path):
    """torch 2.15 now and then aborts a finished process in its C++ teardown ("terminate called without an active
    exception"): a rank whose script ended cleanly counts as ended (one warning line); an abort before the end is
    the failure it is."""
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "late"),
                                str(SCRIPTS / "teardown_abort.py")), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "aborted (SIGABRT) while its process tore down, after its script had ended cleanly" in res.stderr
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "early"),
                                str(SCRIPTS / "teardown_abort.py"), "early"), timeout=120)
    assert res.returncode != 0 and "rank 1 failed: killed by signal SIGABRT" in res.stderr, res.stderr
    # ... and the report says where, from its log: the Python stack of the thread that aborted
    assert "Fatal Python error: Aborted" in res.stderr and 'teardown_abort.py", line 48' in res.stderr, res.stderr
    # a torchrun-style script that never imports autopar: the launcher's boot hook says how it ended
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "plain"),
                                str(SCRIPTS / "teardown_abort.py"), "plain"), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stderr.count("aborted (SIGABRT) while its process tore down") == 2, res.stderr
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "plain-fail"),
                                str(SCRIPTS / "teardown_abort.py"), "plain-fail"), timeout=120)
    assert res.returncode != 0 and "rank 1 failed: killed by signal SIGABRT" in res.stderr, res.stderr
    assert "rank 1 fails after its all-reduce" in res.stderr, res.stderr
