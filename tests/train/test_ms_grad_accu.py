"""MindSpore's gradient-accumulation sample (``cell_wrapper.py`` of docs/sample_code/distributed_training r1.5-r2.1,
imports swapped: tests/scripts/ms_samples/cell_wrapper.py) on 2 ranks, driven as its ``Model_ACCU`` drives it: the
parameters stay still for k-1 mini-steps and the k-th update equals one process stepping on the sum of the k
micro-batches' gradients -- in DATA_PARALLEL, SEMI_AUTO, AUTO (the planner's choice, and sharding propagation so the
weights are DTensor slices), with and without the loss-scale cell. One launched job runs every case."""
import json

import pytest

from procutil import SCRIPTS, autopar_cmd

CASES = ["data_parallel", "semi_auto_parallel", "auto_parallel", "auto_parallel/sp",
         "data_parallel+ls", "semi_auto_parallel+ls", "auto_parallel/sp+ls"]
TOL = 1e-6  # float32 (the sample casts gradients to float32): ranks' all-reduce vs one process's sums


@pytest.mark.timeout(400)
def test_cell_wrapper_accumulates_as_mindspore_on_two_ranks(procs, tmp_path):
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "ms_grad_accu.py"), str(tmp_path / "out"), json.dumps(CASES)),
                    timeout=360)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for rank in range(2):
        results = json.load(open(tmp_path / f"out.{rank}"))
        assert sorted(results) == sorted(CASES)
        bad = {k: v for k, v in results.items() if "error" in v or not v["still"] or v["update"] > TOL}
        assert not bad, json.dumps(bad, indent=1)
        for case in ("semi_auto_parallel", "auto_parallel/sp"):  # the accumulation buffers followed the slices
            assert results[case]["kinds"] == ["DTensor"]
        for case in ("data_parallel", "data_parallel+ls"):  # the k micro-batches' sum is all-reduced once
            assert results[case]["reduced"]["accumulating"] == 0 and results[case]["reduced"]["updating"] > 0
    assert not procs.wait_no_leftovers()
