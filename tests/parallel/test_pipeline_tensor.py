"""Tensor and context parallelism inside pipeline stages (Megatron's compositions; the PyTorch door's
``PipelineParallel(..., tp=2, tensor_parallel={name: "colwise" | "rowwise" | "sequence"})`` and ``cp=2,
cp_algo=...``) on gloo ranks, each against one process on the global batch in float64 after several AdamW steps:
on 2 stages x 2 ranks, a 4-Linear network and a nanoGPT with its weights split (heads split, the head tied to the
embedding across the stages; and with Megatron's sequence parallelism, its norms and residual stream on half the
sequence), and the nanoGPT with its sequence split (each attention algorithm); each split weight holds its half, the
integrated checkpoint holds the whole trained network, each rank's sliced checkpoint reloads onto one process's
layout, and bad input is one line. On 8 ranks, with ZeRO-1 inside the stages beside the tensor or the context split
(Megatron-LM's usual plans), and the context and tensor splits together."""
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


def _check_splits(key: str, case: dict) -> None:
    """A tensor-split case's split weights hold their part (a context-only case splits none), and the run's summary
    says how the stage's group is used."""
    if "_cp" in key and key != "gpt_cp_tp":
        assert not case["halves"] and "context groups of 2" in case["sync"], (key, case)
        return
    assert case["halves"], (key, case)
    for name, (local, whole) in case["halves"].items():
        assert sum(a != b for a, b in zip(local, whole)) == 1 and sum(local) < sum(whole), (name, local, whole)
    assert "split over tensor groups of 2" in case["sync"], case["sync"]


def test_tensor_parallel_inside_pipeline_stages_is_exact(procs, tmp_path):
    for rank, r in enumerate(_run(procs, tmp_path, 4)):
        errors = r.pop("errors")
        for case, text in (("no_plan", "needs tensor_parallel={module name"), ("no_tp", "give tp > 1 too"),
                           ("full", "needs grads='stage'"), ("indivisible", "tp=3 does not divide the 2 rank(s)"),
                           ("unknown", "names 'l9', which is not a module"), ("style", "expected 'colwise', 'rowwise' or 'sequence'"),
                           ("placement", "a parameter takes Shard(d) for one of its 2 dimensions, or Replicate()"),
                           ("module_placement", "a module takes a style, 'colwise', 'rowwise' or 'sequence'"),
                           ("sequence_alone", "'sequence' in a piece that splits no module"),
                           ("cp_full", "cp=2 splits a stage's sequence over its context group, which needs grads='stage'"),
                           ("cp_algo", "cp_algo='zigzag'; expected one of all_gather, ring, ulysses"),
                           ("cp_with_sp", "sequence parallelism beside context parallelism is not run yet"),
                           ("cp_uneven", "a micro-batch of shape (8, 7) does not split into 2 equal slices")):
            assert text in errors[case] and "\n" not in errors[case], (case, errors[case])
        for key, case in r.items():
            assert "error" not in case, (rank, key, case.get("error"), case.get("trace"))
            assert case["stage"] == rank // 2, (rank, key, case)
            assert case["loss_diff"] <= 1e-6, (rank, key, case)  # (the step's loss is reported in float32)
            assert case["param_diff"] <= 1e-12 and case["whole_diff"] <= 1e-12, (rank, key, case)
            if key == "ms_tp_one_replica":  # (each rank says it: one warning)
                warned = case.pop("warned")
                assert len(warned) == 1 and "enable_parallel_optimizer shards nothing here" in warned[0], warned
            assert not case.get("warned"), (key, case["warned"])
            if key != "ms_dp":  # (the MindSpore door's batch-only strategies: data parallel, nothing split)
                _check_splits(key, case)
        # the MindSpore door: the strategies' weight splits run over a tensor group of the stage's 2 ranks (each
        # block's two weights, and the head's weight and bias on the last stage); batch-only ones are data parallel
        halves = r["ms_tp"]["halves"]
        block = f"block{rank // 2 + 1}"
        assert halves[f"{block}.w1"] == [[8, 8], [8, 16]] and halves[f"{block}.w2"] == [[8, 8], [16, 8]], halves
        assert ("head.weight" in halves and halves["head.bias"] == [[3], [6]]) == (rank >= 2), halves
        assert not r["ms_dp"]["halves"] and "all-reduced over its 2 replicas" in r["ms_dp"]["sync"], r["ms_dp"]
        assert r["ms_tp"]["sliced_diff"] <= 1e-12, r["ms_tp"]  # its sliced checkpoint, reloaded onto one process
        # MindFormers' sequence parallelism (norm.shard(((dp, mp, 1),))): the stage's norm on half the sequence
        (name, (placements, local, whole)), = r["ms_sp"]["placed"].items()
        assert name == f"block{rank // 2 + 1}.norm" and placements == "(Shard(dim=1),)", r["ms_sp"]["placed"]
        assert local[1] * 2 == whole[1] and f"block{rank // 2 + 1}.down.weight" in r["ms_sp"]["halves"], r["ms_sp"]
        assert r["net_params"]["halves"] == r["net"]["halves"], (r["net_params"]["halves"], r["net"]["halves"])
        assert r["gpt"]["ckpt_diff"] <= 1e-12, r["gpt"]
        # each rank's slices (its stage's, split over its group), reloaded whole onto one process's layout
        assert r["gpt"]["sliced_diff"] <= 1e-12 and r["gpt_cp"]["sliced_diff"] <= 1e-12, r
        # sequence parallelism, and context parallelism, inside the stages: the norms and the residual stream on
        # half the sequence
        for key in ("gpt_sp", "gpt_cp", "gpt_cp_ring", "gpt_cp_ulysses"):
            placed = r[key]["placed"]
            assert len(placed) == (3 if rank < 2 else 4), (key, placed)
            for name, (placements, local, whole) in placed.items():
                assert placements == "(Shard(dim=1),)" and local[1] * 2 == whole[1], (key, name, placements, local,
                                                                                      whole)
        # context parallelism's attention ran (2 layers, one a stage, over 4 steps x 2 micro-batches, and the
        # stage's shape probe)
        assert r["gpt_cp"]["attended"].get("attention", 0) >= 8 and not r["gpt_cp"]["attended"].get("ring"), r
        assert r["gpt_cp_ring"]["attended"].get("ring", 0) >= 8, r["gpt_cp_ring"]["attended"]
        assert r["gpt_cp_ulysses"]["attended"].get("ulysses", 0) >= 8, r["gpt_cp_ulysses"]["attended"]
        assert "transformer.h.1.attn.c_attn.weight" in r["gpt"]["halves"] or rank < 2, r["gpt"]["halves"]


def test_zero_and_tensor_parallelism_together_inside_pipeline_stages_are_exact(procs, tmp_path):
    for rank, r in enumerate(_run(procs, tmp_path, 8, "zero")):
        assert r.pop("errors") == {}
        assert set(r) == {"gpt", "gpt_cp_zero", "gpt_cp_tp", "ms_tp_zero"}, sorted(r)
        ms = r.pop("ms_tp_zero")  # the MindSpore door: strategies split over 2, enable_parallel_optimizer over 2
        assert "error" not in ms, (rank, ms.get("error"), ms.get("trace"))
        assert ms["stage"] == rank // 4 and ms["loss_diff"] <= 1e-6 and not ms["warned"], (rank, ms)
        assert ms["param_diff"] <= 1e-12 and ms["whole_diff"] <= 1e-12 and ms["sliced_diff"] <= 1e-12, (rank, ms)
        assert "tensor groups of 2" in ms["sync"] and "reduce-scattered into ZeRO's shards" in ms["sync"], ms
        local, whole = ms["halves"][f"block{rank // 4 + 1}.w1"]
        assert local[0] * local[1] * 4 == whole[0] * whole[1], (local, whole)
        for key, case in r.items():
            assert "error" not in case, (rank, key, case.get("error"), case.get("trace"))
            assert case["stage"] == rank // 4 and case["loss_diff"] <= 1e-6, (rank, key, case)
            assert case["param_diff"] <= 1e-12 and case["whole_diff"] <= 1e-12, (rank, key, case)
            assert case["sliced_diff"] <= 1e-12, (rank, key, case)  # its slices reloaded onto one process's layout
        # split over the tensor group and sharded over the replicas: a Linear's weight a quarter on each rank
        case = r["gpt"]
        local, whole = case["halves"][f"transformer.h.{rank // 4}.attn.c_proj.weight"]
        assert local[0] * local[1] * 4 == whole[0] * whole[1], (local, whole)
        assert "reduce-scattered into ZeRO's shards" in case["sync"] and "tensor groups of 2" in case["sync"], case
        # context parallelism with ZeRO (2 replicas of 2 context ranks a stage): every weight half a rank
        case = r["gpt_cp_zero"]
        assert "reduce-scattered into ZeRO's shards" in case["sync"] and "context groups of 2" in case["sync"], case
        local, whole = case["halves"][f"transformer.h.{rank // 4}.attn.c_proj.weight"]
        assert local[0] * 2 == whole[0] and local[1] == whole[1], (local, whole)
        # and beside the tensor split (2 context x 2 tensor ranks a stage): the split weights' halves
        case = r["gpt_cp_tp"]
        assert "tensor groups of 2" in case["sync"] and "context groups of 2" in case["sync"], case
        local, whole = case["halves"][f"transformer.h.{rank // 4}.attn.c_attn.weight"]
        assert local[0] * 2 == whole[0] and local[1] == whole[1], (local, whole)
