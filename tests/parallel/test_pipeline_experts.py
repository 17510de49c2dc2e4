"""A mixture of experts inside pipeline stages: torch's pipelines trace each stage, and a module of stacked experts
picks its tokens with shapes a trace cannot follow -- each such module is one opaque operator of the trace
(``autopar/parallel/pipeline/opaque_experts.py``), run eagerly on the stage's rank. Float64, 3 AdamW steps, against
one process on the global batch. On 4 gloo ranks (2 stages x 2 ranks a stage): ZeRO-1 and ZeRO-3 over a stage's
replicas; the experts spread over them (expert parallelism, ``ep=2``: each rank 2 of the 4, each token sent to its
experts' rank), also with one rank's experts chosen by no token and beside ZeRO-1 and ZeRO-3; a tensor split of the
projections around the experts, with Megatron's sequence parallelism of the MoEs' norms or without; a context split of the sequence; routing uneven; sliced checkpoints reloaded onto
one process; MindSpore's ``nn.transformer.MoE`` with ``expert_parallel`` through ``pipeline_stages``. On 8 ranks:
the experts spread over groups of a stage's replicas, and beside a tensor split (sequence-parallel too) or a context
split of the stage. One line each for a tensor plan naming the experts, an ``ep`` that does not divide a stage's
replicas, or ``grads="full"``;
the layout modes' expert parallelism marked on a pipelined network is said. (Hugging Face's ``MixtralForCausalLM``
pipelined: tests/models/test_hf_transformers.py.)"""
import json

from procutil import SCRIPTS, autopar_cmd

TOL = 1e-12


def test_a_mixture_of_experts_trains_exactly_inside_pipeline_stages(procs, tmp_path):
    res = procs.run(autopar_cmd("launch", "-n", "4", "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "pipeline_moe_train.py"), str(tmp_path / "out"), str(tmp_path)),
                    timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs" / "worker_0.log").read_text()
    for rank in range(4):
        r = json.load(open(tmp_path / f"out.{rank}"))
        assert min(r["routed"]) < 0.6 * max(r["routed"]), r["routed"]  # the router's choices uneven
        assert max(r["routed_idle"][2:]) == 0, r["routed_idle"]  # ep_idle: the second rank's experts take none
        for case in ("zero1", "zero3", "tp", "tp_seq", "cp", "ep", "ep_idle", "ep_zero1", "ep_zero3"):
            c = r[case]
            assert "error" not in c, (rank, case, c.get("error"), c.get("trace"))
            assert c["stage"] == rank // 2 and c["param_diff"] <= TOL, (rank, case, c)
            assert c["loss_diff"] is None or c["loss_diff"] <= 1e-6, (rank, case, c)  # (reported in float32)
            if case not in ("tp", "tp_seq", "cp"):  # (whose weights are DTensors over the inner group)
                assert (c["shards"] > 0) == ("zero" in case), (rank, case, c)  # ZeRO shards the rest of the stage
            if case.startswith("ep"):  # each rank 2 of its stage's 4 experts
                assert c["experts"] and all(shape[0] == 2 for shape in c["experts"].values()), (rank, case, c)
                assert "experts spread over its 2 replicas" in c["sync"], c["sync"]
            else:
                assert not c["experts"], (rank, case, c)
        assert all(r[case]["sliced_diff"] <= TOL for case in ("zero1", "ep", "ep_zero1")), r
        for case, text in (("split_experts", "a module of stacked experts"), ("ep_uneven", "give an ep that divides 2"),
                           ("ep_full", "needs grads='stage'")):
            assert text in r[case] and "\n" not in r[case], (case, r[case])
        assert len(r["marked"]) == 1 and "PipelineParallel(..., grads='stage', ep=N)" in r["marked"][0], r["marked"]


def test_mindspores_mixture_of_experts_trains_exactly_in_pipeline_stages_through_its_door(procs, tmp_path):
    """MindSpore's door: ``nn.transformer.MoE`` with ``MoEParallelConfig(expert_parallel=E)`` in cells marked
    ``pipeline_stage``, ``Model(nn.PipelineCell(...))`` with ``pipeline_stages=2`` on 4 ranks: E = 1 runs the experts
    whole, E = 2 (the stage's replicas) spreads them -- alone and beside ``enable_parallel_optimizer`` -- and E = 4
    is said and runs whole; each against one process in float64 (``tests/scripts/pipeline_moe_mindspore.py``)."""
    res = procs.run(autopar_cmd("launch", "-n", "4", "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "pipeline_moe_mindspore.py"), str(tmp_path / "out")), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs" / "worker_0.log").read_text()
    for rank in range(4):
        r = json.load(open(tmp_path / f"out.{rank}"))
        for case, ep, zero in (("whole", 1, None), ("spread", 2, None), ("spread_zero", 2, "level1"),
                               ("other", 1, None)):
            c = r[case]
            assert "error" not in c, (rank, case, c.get("error"), c.get("trace"))
            assert c["param_diff"] <= TOL and c["loss_diff"] <= 1e-6, (rank, case, c)  # (losses reported in float32)
            assert (c["ep"], c["zero"]) == (ep, zero), (rank, case, c)
            assert bool(c["experts"]) == (ep == 2) and all(s[0] == 2 for s in c["experts"].values()), (rank, case, c)
        assert any("MoE.dropped is not counted inside pipeline stages" in w for w in r["whole"]["warnings"]), r
        assert any("expert_parallel=4 is not applied inside pipeline_stages=2" in w and "dividing 2" in w
                   for w in r["other"]["warnings"]), r["other"]["warnings"]
        assert not any("expert" in w for w in r["spread"]["warnings"] + r["spread_zero"]["warnings"]), r


def test_experts_spread_over_groups_of_replicas_or_beside_a_tensor_or_context_split_train_exactly(procs, tmp_path):
    """8 ranks, 2 stages. ``ep=2`` over 4 replicas a stage: each group of 2 replicas holds every expert once (each
    rank 2 of the 4), a copy on each group, an expert's gradients summed over the copies -- alone, and beside ZeRO-1
and ZeRO-3, where the copies are ZeRO's shards too (each rank half of its group's copy, AdamW's state the same half,
as Megatron's distributed optimizer shards experts over their expert-data-parallel ranks).
    ``ep=2`` over 2 replicas of 2 ranks a stage: beside a tensor split of the projections around the experts (each
    rank of a tensor group exchanging its tokens with its peer of the other replica), the same with the MoEs' norms
    sequence-parallel (each rank of the tensor group its half of the sequence: its own tokens), and beside a context
    split of the sequence (each rank its own slice of the tokens; the experts' gradients summed over the slices). Each exact
    against one process; the sliced checkpoints of the first and of the tensor split reloaded onto one process."""
    res = procs.run(autopar_cmd("launch", "-n", "8", "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "pipeline_moe_train.py"), str(tmp_path / "out"), str(tmp_path),
                                "ep_groups,ep_groups_zero1,ep_groups_zero3,ep_tp,ep_cp,ep_seq"), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs" / "worker_0.log").read_text()
    for rank in range(8):
        r = json.load(open(tmp_path / f"out.{rank}"))
        for case in ("ep_groups", "ep_groups_zero1", "ep_groups_zero3", "ep_tp", "ep_cp", "ep_seq"):
            c = r[case]
            assert "error" not in c, (rank, case, c.get("error"), c.get("trace"))
            assert c["stage"] == rank // 4 and c["param_diff"] <= TOL, (rank, case, c)
            assert c["experts"] and all(shape[0] == 2 for shape in c["experts"].values()), (rank, case, c)
            # each rank's 2 experts: gate_up (2, 48, 16) and down (2, 16, 24) -- under ZeRO, half of its group's copy
            halved = "zero" in case
            assert sorted(c["experts"].values()) == sorted(
                [[2, 24 if halved else 48, 16], [2, 8 if halved else 16, 24]]), (rank, case, c)
            assert c["expert_states"] == c["experts"], (rank, case, c)  # AdamW's state the same share
            if case.startswith("ep_groups"):
                assert (c["shards"] > 0) == halved, (rank, case, c)
                assert "spread over groups of 2 of its 4 replicas" in c["sync"], c["sync"]
                assert ("reduce-scattered into ZeRO's shards of them" in c["sync"]) == halved, c["sync"]
            else:
                assert "experts spread over its 2 replicas" in c["sync"], c["sync"]
        assert all(r[case]["sliced_diff"] <= TOL for case in ("ep_groups", "ep_groups_zero1", "ep_tp")), r
