"""The shared-memory all-reduce of ranks on one host: exact sums, the reducer's gradients, ranks that die or stall."""
import os
import time

import pytest

from autopar.cluster.netutil import free_port
from procutil import PYTHON, SCRIPTS, autopar_cmd


def _segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("autopar-")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("world", [2, 4])
def test_sums_and_gradients_equal_gloo_and_leave_nothing_behind(procs, tmp_path, world):
    before = _segments()
    res = procs.run(autopar_cmd("launch", "-n", str(world), "--log-dir", str(tmp_path),
                                str(SCRIPTS / "host_memory_check.py"), "check"), timeout=180)
    logs = "".join((tmp_path / f"worker_{r}.log").read_text() for r in range(world))
    assert res.returncode == 0, res.stdout + res.stderr + logs
    for rank in range(world):
        assert f"HOST_MEMORY_OK {rank}" in logs
    assert _segments() <= before  # unlinked once mapped: nothing in /dev/shm however the job ends
    assert not procs.wait_no_leftovers()


@pytest.mark.parametrize("mode, within", [("die", 10.0), ("stall", 15.0)])
def test_a_rank_that_dies_or_stalls_fails_the_others(procs, mode, within):
    port = str(free_port())
    env = procs.env(AUTOPAR_COMM_TIMEOUT="3")
    start = time.monotonic()
    ranks = [procs.start([PYTHON, str(SCRIPTS / "host_memory_check.py"), mode, str(r), "2", port], env)
             for r in range(2)]
    out, _ = ranks[0].communicate(timeout=60)
    elapsed = time.monotonic() - start
    text = out.decode()
    assert ranks[0].returncode == 3, text
    expected = "exited while rank 0 waited" if mode == "die" else "timed out after 3 s: rank 1"
    assert "COMM_ERROR" in text and expected in text, text
    assert elapsed < within, f"rank 0 needed {elapsed:.1f}s to fail"
