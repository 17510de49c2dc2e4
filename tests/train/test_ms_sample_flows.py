"""MindSpore's distributed sample flows, in our own adaptations (tests/scripts/ms_jobs.py: the samples' MindSpore
names, used the way the samples use them), on 2 ranks with ``autopar launch``: each equals one process training on
the same global batches. One launched job runs every case."""
import json
import re

import pytest

from autopar.dataset.mnist import write_synthetic_mnist
from procutil import SCRIPTS, autopar_cmd

CASES = ["dp_functional", "recompute", "operator", "autoparallel", "quickstart", "model_generator"]
TOL = 1e-5


@pytest.mark.timeout(600)
def test_sample_flows_equal_one_process_on_two_ranks(procs, tmp_path):
    data = write_synthetic_mnist(tmp_path / "mnist", train=64, test=16)
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"), str(SCRIPTS / "ms_jobs.py"),
                                str(tmp_path / "out"), str(data), json.dumps(CASES)), timeout=540)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for rank in range(2):
        results = json.load(open(tmp_path / f"out.{rank}"))
        assert sorted(results) == sorted(CASES)
        bad = {k: v for k, v in results.items() if "error" in v or v["param"] > TOL}
        assert not bad, json.dumps(bad, indent=1)
        assert results["autoparallel"]["device_inside_block"] == "meta"
        assert results["operator"]["local_shapes"] == [[392, 32], [16, 32]]  # the weights live as slices
        for case in ("quickstart", "model_generator"):  # LossMonitor prints as MindSpore does
            # LossMonitor's lines (AUTO also prints where its plan is, Model.train where its metrics are)
            lines = [ln for ln in results[case]["lines"] if "loss is" in ln]
            assert len(lines) == 3 and all(re.fullmatch(r"epoch: 1 step: [123], loss is \d+\.\d+(e-?\d+)?", ln)
                                           for ln in lines), lines
    assert not procs.wait_no_leftovers()
