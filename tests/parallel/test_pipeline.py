"""Pipeline parallelism (pipeline_stages=2 with nn.PipelineCell and cell.pipeline_stage -- through Model, and inside
value_and_grad -- and the PyTorch door's PipelineParallel with split points) on torch.distributed.pipelining:
per-step losses and parameters after 5 steps equal one process on the global batch -- also built under
``no_init_parameters``, each stage making only its own layers (MindSpore's door: the
micro-batches' losses summed, as its PipelineCell; the PyTorch door: their mean), on 2 stages x 1 and 2 stages x 2 ranks, 1F1B and GPipe, and interleaved (two
pieces per rank: MindSpore's pipeline_segment, or virtual_stages=2); ZeRO levels 1 and 3 inside the stages
(enable_parallel_optimizer; the PyTorch door's zero=), the optimizer state halved over 2 replicas; a 2-stage checkpoint
loads into one process (integrated) and onto 4 ranks (sliced); bad input is one line."""
import json

import torch

import autopar
from procutil import SCRIPTS, autopar_cmd


def _run(procs, tmp_path, n, *extra):
    out = tmp_path / f"w{n}"
    out.mkdir()
    res = procs.run(autopar_cmd("launch", "-n", str(n), "--log-dir", str(out / "logs"),
                                str(SCRIPTS / "pipeline_train.py"),
                                str(out / "out"), str(out), *map(str, extra)), timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr + (out / "logs" / "worker_0.log").read_text()
    return out, [json.load(open(out / f"out.{r}")) for r in range(n)]


def _check(results, n):
    for rank, r in enumerate(results):
        errors = r.pop("errors")
        assert "cell 'l1' has parameters but no pipeline_stage" in errors["no_stage"], errors
        assert f"pipeline_stages=3 does not divide the {n} ranks" in errors["bad_stages"], errors
        assert "splits the sequence (context parallelism), which pipeline_stages=2 does not run through this door" \
            in errors["sequence_split"] and "cp=N" in errors["sequence_split"], errors
        assert "bubble (S-1)/(M+S-1)" in errors["bubble"], errors
        assert "needs grads='stage'" in errors["zero_full"] and "\n" not in errors["zero_full"], errors
        reload = r.pop("reload", None)
        assert reload is not None or n == 2, sorted(r)
        assert len(r) == 13, sorted(r)
        for key in ("zero/level1/AdamW/1f1b", "zero/level3/SGD/gpipe"):
            case = r[key]
            assert "error" not in case, (rank, key, case.get("error"), case.get("trace"))
            if n == 2:  # one rank a stage: nothing to shard, and said (once)
                assert ("shards nothing here" in case["warned"]) == key.startswith("zero/level1"), case
                assert case["state_share"] == 1.0, case
                assert "no ZeRO" in case["banner"], case
            else:  # the stage's optimizer state halved over its 2 replicas (dimension 0 split unevenly: ~1/2)
                assert case["warned"] == "" and 0.45 <= case["state_share"] <= 0.55, case
                assert f"ZeRO-{key[10]} " in case["banner"] and "inside each pipeline stage" in case["banner"], case
        assert r["zero/level1/AdamW/1f1b"]["ckpt_diff"] <= 1e-5, r["zero/level1/AdamW/1f1b"]
        assert r["torch/zero/AdamW"].get("sharded", 0) == (0 if n == 2 else 4), r["torch/zero/AdamW"]
        # built under no_init_parameters: at the end of a step this rank had never made the other stage's layers
        other = ("l3", "l4") if rank // (n // 2) == 0 else ("l1", "l2")
        assert r["model/1f1b/AdamW/no_init"].get("never_made") == [f"{m}.{w}" for m in other
                                                                    for w in ("bias", "weight")], r

        for key, case in r.items():
            assert "error" not in case, (rank, key, case.get("error"), case.get("trace"))
            assert case["loss_diff"] <= 1e-5 and case["param_diff"] <= 1e-5, (rank, key, case)
            assert case["stage"] == rank // (n // 2), (rank, key, case)
            assert case.get("pieces", 1) == (2 if key.startswith("interleaved") else 1), (rank, key, case)
            assert case.get("print_warned", True), (rank, key, "ops.Print in the pipelined network was not warned about")
        if reload is not None:
            assert reload["files"] == 2 and reload["diff"] == 0.0, reload


def test_pipeline_two_stages_exact_and_its_checkpoints_reload(procs, tmp_path):
    two, results = _run(procs, tmp_path, 2)
    _check(results, 2)
    # integrated: one file holding every stage's parameters, read by one process
    saved = json.load(open(two / "saved.json"))
    params = autopar.load_checkpoint(two / "integrated.ckpt")
    assert sorted(params) == sorted(saved)
    for name, value in saved.items():
        assert torch.equal(params[name].detach(), torch.tensor(value)), name
    # sliced: the 2 ranks' files onto 4 ranks (plain DATA_PARALLEL there), and 2 stages x 2 replicas trains exactly
    _, results = _run(procs, tmp_path, 4, two)
    _check(results, 4)
