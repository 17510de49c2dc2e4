"""The MindSpore dynamic-cluster contract started by hand (as the CPU tutorial's run.sh) and its bad inputs."""
import re
import time

import pytest

from autopar.cluster.netutil import bind_listener, free_port
from procutil import PYTHON, SCRIPTS

JOB = str(SCRIPTS / "job.py")


def ms_env(procs, role, workers, port, **extra):
    return procs.env(MS_ROLE=role, MS_WORKER_NUM=str(workers), MS_SCHED_HOST="127.0.0.1", MS_SCHED_PORT=str(port),
                     **extra)


def start_job(procs, tmp_path, workers, started=None, **extra):
    port = free_port()
    sched = procs.start([PYTHON, JOB], ms_env(procs, "MS_SCHED", workers, port, **extra), log=tmp_path / "sched.log")
    ws = [procs.start([PYTHON, JOB], ms_env(procs, "MS_WORKER", workers, port, **extra), log=tmp_path / f"w{i}.log")
          for i in range(workers if started is None else started)]
    return port, sched, ws


def test_manual_scheduler_and_three_workers(procs, tmp_path):
    _, sched, ws = start_job(procs, tmp_path, 3)
    assert [w.wait(timeout=120) for w in ws] == [0, 0, 0]
    assert sched.wait(timeout=30) == 0
    ranks = sorted(int(re.search(r"RANK (\d) OF 3 local (\d)/3", (tmp_path / f"w{i}.log").read_text()).group(1))
                   for i in range(3))
    assert ranks == [0, 1, 2]
    assert "job succeeded" in (tmp_path / "sched.log").read_text()
    assert not procs.wait_no_leftovers()


def test_scheduler_names_the_failed_rank(procs, tmp_path):
    _, sched, ws = start_job(procs, tmp_path, 3, JOB_FAIL_RANK="1", JOB_FAIL_MODE="exit3", JOB_STEPS="400")
    t0 = time.monotonic()
    assert sched.wait(timeout=60) != 0
    for w in ws:
        w.wait(timeout=30)
    assert time.monotonic() - t0 < 30
    log = (tmp_path / "sched.log").read_text()
    # the rank that died is the one named (ranks are assigned by the scheduler: find which process was rank 1)
    assert re.search(r"job failed \(rank 1 on \S+: no heartbeat", log), log
    assert not procs.wait_no_leftovers()


@pytest.mark.parametrize("call", ["sys", "builtin"])
def test_a_nonzero_exit_status_fails_the_job(procs, tmp_path, call):
    """Every rank finished its work, but one ended with sys.exit(3): the scheduler must not call that a success."""
    _, sched, ws = start_job(procs, tmp_path, 2, JOB_FAIL_RANK="1", JOB_END_STATUS="3", JOB_END_CALL=call,
                             JOB_STEPS="5", JOB_FAIL_STEP="-1")
    statuses = sorted(w.wait(timeout=120) for w in ws)
    assert statuses == [0, 3]
    assert sched.wait(timeout=30) != 0
    log = (tmp_path / "sched.log").read_text()
    assert re.search(r"job failed \(rank 1 on \S+: exited with status 3\)", log), log
    assert not procs.wait_no_leftovers()


def test_fewer_workers_than_announced(procs, tmp_path):
    _, sched, ws = start_job(procs, tmp_path, 3, started=2, AUTOPAR_CLUSTER_TIMEOUT="12")
    assert sched.wait(timeout=60) != 0
    assert all(w.wait(timeout=60) != 0 for w in ws)
    assert "only 2 of 3 workers joined within 12 s" in (tmp_path / "sched.log").read_text()
    for i in range(2):
        text = (tmp_path / f"w{i}.log").read_text()
        assert "autopar: error:" in text and "of 3 workers joined" in text and "Traceback" not in text


@pytest.mark.parametrize(
    "env, message",
    [
        ({"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "abc", "MS_SCHED_PORT": "1234"}, "MS_WORKER_NUM='abc' is not an integer"),
        ({"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "0", "MS_SCHED_PORT": "1234"}, "MS_WORKER_NUM='0' must be a positive integer"),
        ({"MS_ROLE": "MS_BOSS", "MS_WORKER_NUM": "2", "MS_SCHED_PORT": "1234"}, "unknown MS_ROLE='MS_BOSS'"),
        ({"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_SCHED_PORT": "70000"}, "MS_SCHED_PORT=70000 is not a TCP port"),
        ({"RANK": "4", "WORLD_SIZE": "2"}, "RANK=4 is beyond the world size WORLD_SIZE=2"),
    ],
)
def test_bad_environment_is_one_line(procs, env, message):
    res = procs.run([PYTHON, JOB], procs.env(**env), timeout=60)
    assert res.returncode != 0
    assert f"autopar: error: {message}" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_scheduler_unreachable(procs):
    port = free_port()
    env = procs.env(MS_ROLE="MS_WORKER", MS_WORKER_NUM="2", MS_SCHED_HOST="127.0.0.1", MS_SCHED_PORT=str(port),
                    AUTOPAR_CLUSTER_TIMEOUT="2")
    t0 = time.monotonic()
    res = procs.run([PYTHON, JOB], env, timeout=60)
    assert res.returncode != 0 and time.monotonic() - t0 < 30
    assert f"autopar: error: cannot reach the scheduler at 127.0.0.1:{port} within 2 s" in res.stderr, res.stderr


def test_scheduler_port_in_use(procs):
    with bind_listener("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        res = procs.run([PYTHON, JOB], ms_env(procs, "MS_SCHED", 2, port), timeout=60)
    assert res.returncode != 0
    assert f"autopar: error: port {port} on 127.0.0.1 is already in use" in res.stderr, res.stderr


def test_duplicate_and_extra_registrations_are_refused(procs, tmp_path):
    """Two workers claiming rank 0, and one claiming a rank beyond the world: refused; the job still completes."""
    port = free_port()
    sched = procs.start([PYTHON, JOB], ms_env(procs, "MS_SCHED", 2, port), log=tmp_path / "s.log")
    finish = tmp_path / "finish"
    good = [procs.start([PYTHON, JOB], ms_env(procs, "MS_WORKER", 2, port, AUTOPAR_RANK=str(i), JOB_STEPS="2000",
                                              JOB_UNTIL_FILE=str(finish)), log=tmp_path / f"g{i}.log")
            for i in range(2)]
    deadline = time.monotonic() + 60
    while "all 2 workers joined" not in (tmp_path / "s.log").read_text():
        assert time.monotonic() < deadline, "the job never formed"
        time.sleep(0.2)
    dup = procs.run([PYTHON, JOB], ms_env(procs, "MS_WORKER", 2, port, AUTOPAR_RANK="0"), timeout=60)
    beyond = procs.run([PYTHON, JOB], ms_env(procs, "MS_WORKER", 2, port, AUTOPAR_RANK="5"), timeout=60)
    assert dup.returncode != 0 and "autopar: error: rank 0 registered twice" in dup.stderr, dup.stderr
    assert beyond.returncode != 0 and "autopar: error: rank 5 is beyond the world size 2" in beyond.stderr
    finish.touch()
    assert [g.wait(timeout=120) for g in good] == [0, 0]
    assert sched.wait(timeout=30) == 0
