"""``autopar launch``: exit codes, per-rank logs, failure reports, interruption, and no process left behind."""
import os
import re
import signal
import time

from autopar.cluster.netutil import bind_listener, free_port
from procutil import PYTHON, SCRIPTS, autopar_cmd, find_worker, wait_for

JOB = str(SCRIPTS / "job.py")


def launch(procs, tmp_path, n, env=None, timeout=120, extra=()):
    return procs.run(autopar_cmd("launch", "-n", str(n), "--log-dir", str(tmp_path), *extra, JOB), env, timeout=timeout)






def test_success_logs_and_streaming(procs, tmp_path):
    res = launch(procs, tmp_path, 3)
    assert res.returncode == 0, res.stderr
    for rank in range(3):  # every rank is streamed to the console, each line prefixed with its rank
        assert f"[rank {rank}] RANK {rank} OF 3 local {rank}/3 contract mindspore\n" in res.stdout, res.stdout
    for rank in range(3):
        assert f"RANK {rank} DONE" in (tmp_path / f"worker_{rank}.log").read_text()
        env = (tmp_path / f"env_{rank}.log").read_text()
        assert f"AUTOPAR_RANK={rank}\n" in env and "MS_ROLE=MS_WORKER\n" in env and "MS_WORKER_NUM=3\n" in env
    assert "job succeeded" in (tmp_path / "scheduler.log").read_text()
    assert not procs.wait_no_leftovers()


def test_worker_sigkilled_mid_run(procs, tmp_path):
    launcher = procs.start(autopar_cmd("launch", "-n", "3", "--log-dir", str(tmp_path), JOB),
                           procs.env(JOB_STEPS="100000", JOB_SLEEP="0.01"))
    wait_for(tmp_path / "worker_1.log", "RANK 1 OF 3")
    time.sleep(1.0)
    find_worker(procs, 1).kill()
    t0 = time.monotonic()
    out, err = launcher.communicate(timeout=60)
    assert time.monotonic() - t0 < 30
    assert launcher.returncode != 0
    assert "autopar: error: rank 1 failed: killed by signal SIGKILL" in err.decode(), err.decode()
    assert not procs.wait_no_leftovers()


def test_worker_exception_reports_rank_and_log_tail(procs, tmp_path):
    res = launch(procs, tmp_path, 2, procs.env(JOB_FAIL_RANK="1", JOB_STEPS="1000"))
    assert res.returncode == 1
    assert "autopar: error: rank 1 failed: exited with code 1" in res.stderr, res.stderr
    assert "ValueError: injected failure at step 3" in res.stderr  # the tail of worker_1.log
    assert "rank 0 failed" not in res.stderr  # rank 0 only stopped because of rank 1
    assert not procs.wait_no_leftovers()


def test_ctrl_c_stops_everything(procs, tmp_path):
    launcher = procs.start(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path), JOB),
                           procs.env(JOB_STEPS="100000"))
    wait_for(tmp_path / "worker_0.log", "RANK 0 OF 2")
    launcher.send_signal(signal.SIGINT)
    launcher.communicate(timeout=60)
    assert launcher.returncode == 130
    assert not procs.wait_no_leftovers()


def test_launcher_killed_takes_workers_with_it(procs, tmp_path):
    launcher = procs.start(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path), JOB),
                           procs.env(JOB_STEPS="100000"))
    wait_for(tmp_path / "worker_1.log", "RANK 1 OF 2")
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=10)
    assert not procs.wait_no_leftovers(timeout=15)


def test_bad_launch_arguments(procs, tmp_path):
    res = procs.run(autopar_cmd("launch", "-n", "2", str(tmp_path / "missing.py")), timeout=60)
    assert res.returncode == 2 and "autopar: error: script not found" in res.stderr
    with bind_listener("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        res = procs.run(autopar_cmd("launch", "-n", "2", "--port", str(port), "--log-dir", str(tmp_path), JOB),
                        timeout=60)
    assert res.returncode == 2 and f"autopar: error: port {port} on 127.0.0.1 is already in use" in res.stderr


def test_torchrun_contract(procs, tmp_path):
    res = procs.run([PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                     str(free_port()), JOB], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"RANK 0 OF 2 local 0/2 contract torchrun", res.stdout)
    assert re.search(r"RANK 1 OF 2 local 1/2 contract torchrun", res.stdout)


def test_openmpi_environment(procs, tmp_path):
    """The variables mpirun exports (here set by hand: mpirun itself is exercised where it is installed)."""
    port = str(free_port())
    ps = [procs.start([PYTHON, JOB], procs.env(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2",
                                               OMPI_COMM_WORLD_LOCAL_RANK=str(r), OMPI_COMM_WORLD_LOCAL_SIZE="2",
                                               MASTER_PORT=port), log=tmp_path / f"mpi{r}.log") for r in range(2)]
    assert [p.wait(timeout=120) for p in ps] == [0, 0]
    for r in range(2):
        assert f"RANK {r} OF 2 local {r}/2 contract openmpi" in (tmp_path / f"mpi{r}.log").read_text()
