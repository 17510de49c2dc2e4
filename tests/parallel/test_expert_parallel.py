"""Expert parallelism on a mixture-of-experts network as its users write one (top-2 router, experts stacked in
Hugging Face's form, the load-balancing loss inside ``forward``), float64, 2 and 4 ranks, one launch each
(tests/scripts/expert_parallel.py): 8 experts spread over the ranks, with routing skewed so that one expert takes
a third of the tokens and two take none, each token sent only to its experts' ranks (all-to-all) -- alone, with ZeRO-3, and with tensor parallelism beside it, with sequence parallelism around the experts, and MindSpore's ``nn.transformer.MoE`` with ``MoEConfig`` and
``expert_parallel`` (tokens over capacity dropped as one process drops them); each equal to
one process after 3 AdamW steps with clipping, and the sliced checkpoint read back whole into one process. Experts the ranks do not divide, and ``"expert"`` on a module not
stacked by expert, are one line. (Hugging Face's Mixtral: tests/models/test_hf_transformers.py.)"""
import json

import pytest

from procutil import SCRIPTS, autopar_cmd

TRAINED = ["ep", "ep_zero3", "ep_tp", "ep_seq", "ms_moe"]
GROUPS = ["ep_ep2", "ep_zero3_ep2", "ms_moe_ep2"]  # 4 ranks: the experts over groups of 2, the groups replicas
MISTAKES = {
    "indivisible": "expert parallelism over {n} ranks: module 'experts' has {e} experts, which the ranks do not divide",
    "not_stacked": "autopar.shard: 'expert' splits a module of stacked expert weights",
}
TOL = 1e-9


@pytest.mark.parametrize("n", [2, 4])
def test_expert_parallelism_trains_exactly(procs, tmp_path, n):
    trained = TRAINED + (GROUPS if n == 4 else [])
    res = procs.run(autopar_cmd("launch", "-n", str(n), "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "expert_parallel.py"), str(tmp_path / "out"),
                                json.dumps(trained + list(MISTAKES))), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs" / "worker_0.log").read_text()
    for rank in range(n):
        out = json.load(open(tmp_path / f"out.{rank}"))
        routed = out["routed"]
        assert routed[0] == 0 and routed.count(0) >= 1 and max(routed) >= 2 * sum(routed) / len(routed), routed
        for case in trained:
            r = out[case]
            assert "error" not in r, (rank, case, r.get("error"), r.get("trace"))
            ep = 2 if case.endswith("_ep2") else n
            assert r["param"] <= TOL and r["local_experts"] == 8 // ep, (rank, case, r)
        assert out["ep"]["reload"] <= TOL, out["ep"]  # the sliced checkpoint, whole in one process
        # the experts took the flattened slices of the sequence: a strided split of the tokens (on 4 ranks over
        # both axes of the 2 x 2 world mesh, which torch's view rule could not unflatten: handlers._view)
        assert out["ep_seq"]["tokens"] == ["_StridedShard"], out["ep_seq"]
        ms = out["ms_moe"]  # MindSpore's MoE: the same tokens dropped for want of capacity as in one process
        assert ms["dropped"] == ms["dropped_one"] > 0, ms
        for case, message in MISTAKES.items():
            r = out[case]
            assert r["raised"] == "StrategyError" and message.format(n=n, e=2 * n + 1) in r["message"], (rank, case, r)
            assert "\n" not in r["message"]
    # the all-to-all dispatcher: a token goes only to the ranks of the experts it chose (top-2: at most two of
    # them), where gathering would give every rank all GLOBAL x SEQ = 32 of them (on 4 ranks, 128 in all)
    received = [json.load(open(tmp_path / f"out.{rank}"))["ep"]["received"] for rank in range(n)]
    assert sum(received) <= 2 * 32, received
