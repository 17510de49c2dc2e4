"""Collectives on real processes (gloo over loopback): values and gradients on 4 ranks, and stand-alone."""
from procutil import PYTHON, SCRIPTS, autopar_cmd


def test_four_ranks_values_and_gradients(procs, tmp_path):
    res = procs.run(autopar_cmd("launch", "-n", "4", "--log-dir", str(tmp_path), str(SCRIPTS / "collectives_check.py"),
                                "4"), timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    for rank in range(4):
        assert f"rank {rank}: CHECKS PASSED" in (tmp_path / f"worker_{rank}.log").read_text()
    assert not procs.wait_no_leftovers()


def test_standalone_world_of_one(procs):
    """No launch contract at all: a world of one in which every collective is the identity."""
    res = procs.run([PYTHON, str(SCRIPTS / "collectives_check.py"), "1"], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rank 0: CHECKS PASSED" in res.stdout
