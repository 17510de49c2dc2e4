"""Tensor parallelism inside pipeline stages (Megatron's composition; the PyTorch door's ``PipelineParallel(...,
tp=2, tensor_parallel={name: "colwise" | "rowwise" | "sequence"})``) on 2 stages x 2 tensor-parallel gloo ranks:
a 4-Linear network and a nanoGPT (heads split, the head tied to the embedding across the stages; and with Megatron's
sequence parallelism, its norms and residual stream on half the sequence) equal one process on the global batch in float64 after several AdamW steps; each split weight holds its half; the integrated checkpoint holds
the whole trained network; bad input is one line. And the nanoGPT on 2 stages x 2 replicas x 2 tensor-parallel
ranks with ZeRO-1 inside the stages (Megatron-LM's usual plan): exact, each weight a quarter or a half a rank."""
import json

from procutil import SCRIPTS, autopar_cmd


def _run(procs, tmp_path, n, *extra):
    out = tmp_path / f"w{n}"
    out.mkdir()
    res = procs.run(autopar_cmd("launch", "-n", str(n), "--log-dir", str(out / "logs"),
                                str(SCRIPTS / "pipeline_tensor_train.py"), str(out / "out"), str(out), *extra),
                    timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr + (out / "logs" / "worker_0.log").read_text()
    return [json.load(open(out / f"out.{rank}")) for rank in range(n)]


def test_tensor_parallel_inside_pipeline_stages_is_exact(procs, tmp_path):
    for rank, r in enumerate(_run(procs, tmp_path, 4)):
        errors = r.pop("errors")
        for case, text in (("no_plan", "needs tensor_parallel={module name"), ("no_tp", "give tp > 1 too"),
                           ("full", "needs grads='stage'"), ("indivisible", "tp=3 does not divide the 2 rank(s)"),
                           ("unknown", "names 'l9', which is not a module"), ("style", "expected 'colwise', 'rowwise' or 'sequence'"),
                           ("sequence_alone", "'sequence' in a piece that splits no module")):
            assert text in errors[case] and "\n" not in errors[case], (case, errors[case])
        for key, case in r.items():
            assert "error" not in case, (rank, key, case.get("error"), case.get("trace"))
            assert case["stage"] == rank // 2, (rank, key, case)
            assert case["loss_diff"] <= 1e-6, (rank, key, case)  # (the step's loss is reported in float32)
            assert case["param_diff"] <= 1e-12 and case["whole_diff"] <= 1e-12, (rank, key, case)
            assert case["halves"], (rank, key, case)
            for name, (local, whole) in case["halves"].items():
                assert sum(a != b for a, b in zip(local, whole)) == 1 and sum(local) < sum(whole), (name, local, whole)
            assert "split over tensor groups of 2" in case["sync"], case["sync"]
        assert r["gpt"]["ckpt_diff"] <= 1e-12, r["gpt"]
        # sequence parallelism inside the stages: the norms and the residual stream on half the sequence
        placed = r["gpt_sp"]["placed"]
        assert len(placed) == (3 if rank < 2 else 4), placed
        for name, (placements, local, whole) in placed.items():
            assert placements == "(Shard(dim=1),)" and local[1] * 2 == whole[1], (name, placements, local, whole)
        assert "transformer.h.1.attn.c_attn.weight" in r["gpt"]["halves"] or rank < 2, r["gpt"]["halves"]


def test_zero_and_tensor_parallelism_together_inside_pipeline_stages_are_exact(procs, tmp_path):
    for rank, r in enumerate(_run(procs, tmp_path, 8, "zero")):
        assert r.pop("errors") == {}
        case = r["gpt"]
        assert "error" not in case, (rank, case.get("error"), case.get("trace"))
        assert case["stage"] == rank // 4 and case["loss_diff"] <= 1e-6, (rank, case)
        assert case["param_diff"] <= 1e-12 and case["whole_diff"] <= 1e-12, (rank, case)
        # split over the tensor group and sharded over the replicas: a Linear's weight a quarter on each rank
        local, whole = case["halves"][f"transformer.h.{rank // 4}.attn.c_proj.weight"]
        assert local[0] * local[1] * 4 == whole[0] * whole[1], (local, whole)
        assert "reduce-scattered into ZeRO's shards" in case["sync"] and "tensor groups of 2" in case["sync"], case
