"""A mixture of experts inside pipeline stages: torch's pipelines trace each stage, and a module of stacked experts
picks its tokens with shapes a trace cannot follow -- each such module is one opaque operator of the trace
(``autopar/parallel/pipeline/opaque_experts.py``), run eagerly on the stage's rank. On 4 gloo ranks (2 stages x 2
ranks a stage), float64, 3 AdamW steps, against one process on the global batch: with ZeRO-1 and ZeRO-3 over a
stage's replicas (ZeRO-1's sliced checkpoint reloaded onto one process), beside a tensor split of the projections
around the experts, and beside a context split of the sequence; routing uneven. A tensor plan naming the experts is
one line, and expert parallelism marked for the layout modes is said not to run there. (Hugging Face's
``MixtralForCausalLM`` pipelined: tests/models/test_hf_transformers.py.)"""
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
        for case in ("zero1", "zero3", "tp", "cp"):
            c = r[case]
            assert "error" not in c, (rank, case, c.get("error"), c.get("trace"))
            assert c["stage"] == rank // 2 and c["param_diff"] <= TOL, (rank, case, c)
            assert c["loss_diff"] is None or c["loss_diff"] <= 1e-6, (rank, case, c)  # (reported in float32)
        assert r["zero1"]["sliced_diff"] <= TOL, r["zero1"]
        assert "a module of stacked experts" in r["split_experts"] and "\n" not in r["split_experts"]
        assert len(r["marked"]) == 1 and "is not run inside pipeline stages yet" in r["marked"][0], r["marked"]
