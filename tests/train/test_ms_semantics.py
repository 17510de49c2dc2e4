"""The MindSpore door behaves as MindSpore (issue 32), each case against one process on the same global batch:
sharding propagation, GradAccumulationCell's sum, value_and_grad with optimizer sharding, full_batch in a plain
loop, and distributed inference from a strategy file and sliced checkpoints (trained on 4 ranks, predicted on 4
and on 2). Pipelines (PipelineCell's sum, inside value_and_grad) are in tests/parallel/test_pipeline.py, sink mode
and GRAPH_MODE on the CPU in tests/train/test_model.py and test_speed_and_precision.py."""
import json

from procutil import SCRIPTS, autopar_cmd

TOL = 1e-5
CASES = ["propagation", "accumulation", "value_and_grad_zero", "full_batch", "inference"]


def _launch(procs, tmp_path, n, cases, tag, env=None):
    res = procs.run(autopar_cmd("launch", "-n", str(n), "--log-dir", str(tmp_path / f"logs_{tag}"),
                                str(SCRIPTS / "ms_semantics.py"), str(tmp_path / f"out_{tag}"), str(tmp_path / "work"),
                                json.dumps(cases)), env=env, timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / f"logs_{tag}" / "worker_0.log").read_text()
    return [json.load(open(tmp_path / f"out_{tag}.{r}")) for r in range(n)]


def test_mindspore_semantics_on_four_ranks_and_inference_on_two(procs, tmp_path):
    (tmp_path / "work").mkdir()
    for rank, r in enumerate(_launch(procs, tmp_path, 4, CASES, "train")):
        for case, v in r.items():
            assert "error" not in v, (rank, case, v.get("error"), v.get("trace"))
        assert r["propagation"]["param"] <= TOL, r["propagation"]
        assert r["propagation"]["matmul2"] == [[2, 2], [2, 1]], r["propagation"]  # consumes dense1's output layout
        assert r["accumulation"]["param"] <= TOL and len(r["accumulation"]["losses"]) == 3, r["accumulation"]
        assert max(r["value_and_grad_zero"].values()) <= TOL, r["value_and_grad_zero"]
        assert r["full_batch"]["param"] <= TOL and r["full_batch"]["shapes"] == [[16, 6]] * 3, r["full_batch"]
        inference = r["inference"]
        assert inference["pred"] <= TOL and inference["shape"] == [16, 6], inference
        assert inference["strategy"] == [[2, 1], [1, 2]], inference  # the MatMul's strategy, from the file
        assert inference["strategy_files"] == [f"device{k}/train_strategy.json" for k in range(4)], inference
    env = procs.env(INFER_WORLD="2")  # the same files, predicted by a job of 2
    for r in _launch(procs, tmp_path, 2, ["inference"], "infer2", env):
        inference = r["inference"]
        assert "error" not in inference, inference
        assert inference["pred"] <= TOL and inference["trained_on"] == 4 and inference["strategy"] == [], inference
