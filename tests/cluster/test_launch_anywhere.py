"""Issue 8: several hosts on loopback, rank tables, mpirun, faults (kill a worker / the scheduler, a stuck
collective), restart-and-resume, and a wrong-token joiner refused while the real job completes."""
import json
import random
import re
import shutil
import signal
import time

import pytest
import torch

from autopar.cluster.netutil import free_port
from procutil import PYTHON, ROOT, SCRIPTS, autopar_cmd, wait_for

JOB = str(SCRIPTS / "job.py")




def test_two_hosts_on_loopback_share_one_scheduler(procs, tmp_path):
    port, token = free_port(), "0123456789abcdef"
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--token", token, "-n", "2"]
    nodes = [procs.start(autopar_cmd("launch", *common, "--node-rank", str(k), "--log-dir", str(tmp_path / f"n{k}"),
                                     JOB), procs.env(JOB_STEPS="20"), log=tmp_path / f"launcher{k}.log")
             for k in range(2)]
    assert [p.wait(timeout=180) for p in nodes] == [0, 0], [(tmp_path / f"launcher{k}.log").read_text() for k in (0, 1)]
    seen = {}
    for k in range(2):
        for r in (2 * k, 2 * k + 1):
            m = re.search(r"RANK (\d) OF 4 local (\d)/2 contract mindspore", (tmp_path / f"n{k}" / f"worker_{r}.log").read_text())
            seen[int(m[1])] = int(m[2])
    assert seen == {0: 0, 1: 1, 2: 0, 3: 1}  # ranks by node, local ranks per node
    assert (tmp_path / "n0" / "scheduler.log").exists() and not (tmp_path / "n1" / "scheduler.log").exists()
    assert not procs.wait_no_leftovers()


def rank_table(path, server="127.0.0.1", ranks=((0, 0), (1, 1))):
    devices = [{"device_id": str(d), "device_ip": f"192.1.27.{d}", "rank_id": str(r)} for r, d in ranks]
    path.write_text(json.dumps({"version": "1.0", "server_count": "1", "status": "completed",
                                "server_list": [{"server_id": server, "device": devices, "host_nic_ip": "reserve"}]}))
    return path


def test_rank_table_launch_and_a_violation(procs, tmp_path):
    table = rank_table(tmp_path / "rank_table_2pcs.json")
    env = procs.env(MASTER_PORT=str(free_port()))
    res = procs.run(autopar_cmd("launch", "--rank-table", str(table), "--server-id", "127.0.0.1", "--log-dir",
                                str(tmp_path / "logs"), JOB), env, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    for r in range(2):
        log = (tmp_path / "logs" / f"worker_{r}.log").read_text()
        assert f"RANK {r} OF 2 local {r}/2 contract ranktable" in log
        assert f"DEVICE_ID={r}\n" in (tmp_path / "logs" / f"env_{r}.log").read_text()
    bad = rank_table(tmp_path / "bad.json", ranks=((0, 0), (0, 1)))
    res = procs.run(autopar_cmd("launch", "--rank-table", str(bad), "--server-id", "127.0.0.1", JOB), timeout=60)
    assert res.returncode == 2 and "autopar: error: rank table" in res.stderr and "used twice" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed (.ci/run installs it)")
def test_mpirun_runs_the_allgather_example(procs):
    env = procs.env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_plm_rsh_agent="")
    res = procs.run(["mpirun", "--oversubscribe", "-n", "4", PYTHON, str(ROOT / "examples" / "allgather.py")], env,
                    timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("[[0.], [1.], [2.], [3.]]") == 4  # every rank gathered the same list


def test_worker_killed_at_a_random_step_stops_the_job(procs, tmp_path):
    for attempt in range(2):
        logs = tmp_path / f"run{attempt}"
        launcher = procs.start(autopar_cmd("launch", "-n", "3", "--log-dir", str(logs), JOB),
                               procs.env(JOB_STEPS="100000", JOB_SLEEP="0.01"))
        wait_for(logs / "worker_2.log", "RANK 2 OF 3")
        time.sleep(random.uniform(0.2, 1.5))
        victim = random.choice([0, 1, 2])
        for proc in procs.leftovers():
            env = proc.environ()
            if env.get("MS_ROLE") == "MS_WORKER" and env.get("AUTOPAR_RANK") == str(victim):
                proc.send_signal(signal.SIGKILL)
        start = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        assert time.monotonic() - start < 30 and launcher.returncode != 0
        assert f"rank {victim} failed: killed by signal SIGKILL" in err.decode()
        assert not procs.wait_no_leftovers()


def test_scheduler_killed_workers_exit_with_a_clear_error(procs, tmp_path):
    for attempt in range(2):
        port = free_port()
        ms = dict(MS_WORKER_NUM="2", MS_SCHED_HOST="127.0.0.1", MS_SCHED_PORT=str(port), JOB_STEPS="100000",
                  JOB_SLEEP="0.01")
        sched = procs.start([PYTHON, JOB], procs.env(MS_ROLE="MS_SCHED", **ms), log=tmp_path / f"s{attempt}.log")
        workers = [procs.start([PYTHON, JOB], procs.env(MS_ROLE="MS_WORKER", **ms), log=tmp_path / f"w{attempt}{i}.log")
                   for i in range(2)]
        wait_for(tmp_path / f"s{attempt}.log", "all 2 workers joined")
        time.sleep(random.uniform(0.2, 1.5))
        sched.send_signal(signal.SIGKILL)
        start = time.monotonic()
        assert all(w.wait(timeout=60) != 0 for w in workers)
        assert time.monotonic() - start < 20
        for i in range(2):
            assert "autopar: error: lost the scheduler" in (tmp_path / f"w{attempt}{i}.log").read_text()
        assert not procs.wait_no_leftovers()


def test_a_collective_that_cannot_complete_times_out_naming_it(procs, tmp_path):
    env = procs.env(JOB_FAIL_RANK="1", JOB_FAIL_MODE="hang", JOB_STEPS="50", AUTOPAR_COMM_TIMEOUT="4")
    start = time.monotonic()
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path), JOB), env, timeout=120)
    assert res.returncode != 0 and time.monotonic() - start < 60
    log = (tmp_path / "worker_0.log").read_text()
    # the message names the operation, the tensor (dtype, shape) and the group
    assert re.search(r"autopar: error: \[rank 0\] all_reduce of a float32 tensor of shape \(2,\) on the world group "
                     r"failed: .*[Tt]imed out", log), log
    assert not procs.wait_no_leftovers()


def test_max_restarts_resumes_and_matches_an_uninterrupted_run(procs, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(ref / "logs"), str(SCRIPTS / "restart_job.py"),
                                str(ref)), timeout=240)
    assert res.returncode == 0, res.stderr
    res = procs.run(autopar_cmd("launch", "-n", "2", "--max-restarts", "1", "--log-dir", str(run / "logs"),
                                str(SCRIPTS / "restart_job.py"), str(run)), procs.env(CRASH="1"), timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "restart 1 of 1" in res.stderr and "rank 1 failed: exited with code 9" in res.stderr
    assert json.loads((run / "steps_1.json").read_text()) == [5, 6, 7, 8]  # resumed after step 4
    assert json.loads((ref / "steps_0.json").read_text()) == list(range(1, 9))
    final, expected = torch.load(run / "final.pt"), torch.load(ref / "final.pt")
    assert all(torch.equal(final[k], v) for k, v in expected.items())


def test_wrong_token_joiner_is_refused_while_the_job_completes(procs, tmp_path):
    port = free_port()
    launcher = procs.start(autopar_cmd("launch", "-n", "2", "--port", str(port), "--log-dir", str(tmp_path), JOB),
                           procs.env(JOB_STEPS="3000", JOB_SLEEP="0.02", JOB_UNTIL_FILE=str(tmp_path / "finish")))
    wait_for(tmp_path / "scheduler.log", "all 2 workers joined")
    joiners = []
    for token in ("wrong", ""):
        env = procs.env(MS_ROLE="MS_WORKER", MS_WORKER_NUM="2", MS_SCHED_HOST="127.0.0.1", MS_SCHED_PORT=str(port),
                        AUTOPAR_JOB_TOKEN=token)
        joiners.append(procs.start([PYTHON, JOB], env, log=tmp_path / f"joiner{len(joiners)}.log"))
    for i, joiner in enumerate(joiners):
        assert joiner.wait(timeout=60) != 0
        out = (tmp_path / f"joiner{i}.log").read_text()
        assert "autopar: error: refused: this process does not carry the job's token" in out, out
        assert "RANK" not in out
    (tmp_path / "finish").touch()
    assert launcher.wait(timeout=120) == 0
    assert "job succeeded" in (tmp_path / "scheduler.log").read_text()
