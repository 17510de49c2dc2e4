"""Ranks started as ``pytest -s -v script.py`` (MindSpore's r1.x/r2.1 run scripts) under the dynamic-cluster
contract, the scheduler too: it ends with the job's status (no pytest INTERNALERROR), a rank's failed test fails
the job."""
import pytest

from autopar.cluster.netutil import free_port
from procutil import PYTHON, SCRIPTS


@pytest.mark.timeout(200)
@pytest.mark.parametrize("fail_rank", ["", "1"])
def test_scheduler_and_workers_under_pytest_end_with_the_jobs_status(procs, tmp_path, fail_rank):
    port = free_port()

    def start(role: str, name: str):
        env = procs.env(MS_ROLE=role, MS_WORKER_NUM="2", MS_SCHED_HOST="127.0.0.1", MS_SCHED_PORT=str(port),
                        FAIL_RANK=fail_rank)
        return procs.start([PYTHON, "-m", "pytest", "-s", "-v", "-p", "no:cacheprovider", "pytest_rank.py"], env,
                           log=tmp_path / f"{name}.log", cwd=SCRIPTS)

    sched = start("MS_SCHED", "sched")
    workers = [start("MS_WORKER", f"w{i}") for i in range(2)]
    codes = [w.wait(timeout=150) for w in workers]
    status = sched.wait(timeout=60)
    log = (tmp_path / "sched.log").read_text()
    assert "INTERNALERROR" not in log, log[-2000:]
    if fail_rank:
        assert status != 0 and "job failed" in log and any(codes), log[-2000:]
    else:
        assert status == 0 and codes == [0, 0] and "job succeeded" in log, log[-2000:]
    assert not procs.wait_no_leftovers()
