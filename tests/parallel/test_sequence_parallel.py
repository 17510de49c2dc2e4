"""Sequence parallelism with tensor parallelism (Korthikanti et al. 2022) on a nanoGPT-style GPT in float64, 2 and 4
ranks, one launch each (tests/scripts/sequence_parallel.py): torchtitan's plan with torch's own style objects, the
same in autopar's strings, MindSpore's tuples with data x model parallel (``Cell.shard`` on a norm), with ZeRO-1 and
ZeRO-3, and Megatron's data contract (every rank the whole batch of one) -- each equal to one process after 3 AdamW
steps with clipping. nanoGPT's fused ``c_attn`` split by columns runs attention split by heads. The norms' outputs are split on the sequence; where tensor parallelism alone all-reduces a
row-parallel layer's partial sums, sequence parallelism reduce-scatters them. What a user gets wrong is one line."""
import json

import pytest

from procutil import SCRIPTS, autopar_cmd

TRAINED = ["torch_styles", "strings", "ms_tuples", "ms_tuples_zero1", "ms_tuples_zero3", "full_batch",
           "full_batch_no_sp"]
MISTAKES = {
    "no_tensor_parallel": "module 'transformer.drop' is split on the sequence but no layer of the network is split by "
                          "tensor parallelism",
    "sequence_indivisible": "module 'transformer.drop' (Dropout) split (1, {n}, 1) over {n} ranks: its sequence (7) "
                            "cannot be split into {n} parts",
    "features_split": "module 'transformer.h.0.ln_1' (LayerNorm) split (1, 1, {n}) over {n} ranks: its last "
                      "dimension (the features it normalises) stays whole",
}
TOL = 1e-9
SEQ = 8  # the script's GPT block size


@pytest.mark.parametrize("n", [2, 4])
def test_sequence_parallel_trains_exactly_through_both_doors(procs, tmp_path, n):
    res = procs.run(autopar_cmd("launch", "-n", str(n), "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "sequence_parallel.py"), str(tmp_path / "out"),
                                json.dumps(TRAINED + list(MISTAKES))), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs" / "worker_0.log").read_text()
    for rank in range(n):
        out = json.load(open(tmp_path / f"out.{rank}"))
        for case in TRAINED:
            r = out[case]
            assert "error" not in r, (rank, case, r.get("error"), r.get("trace"))
            assert r["loss"] <= TOL and r["param"] <= TOL, (rank, case, r)
            # the styles split over every rank; MindSpore's tuples over mp = 2 (on 4 ranks dp 2 x mp 2)
            split = 1 if case.endswith("no_sp") else (2 if case.startswith("ms_") else n)
            # nanoGPT's fused c_attn split by columns: q, k and v each split by heads, attention too (one all-to-all,
            # not a gather of the whole projection and attention whole on every rank)
            heads = 2 if case.startswith("ms_") else n
            assert r["attended"]["local"][-1] == 16 // heads and "Shard(dim=2)" in r["attended"]["placements"], r
            assert r["ln_2"]["local"][1] == SEQ // split, (rank, case, r["ln_2"])
            if split > 1:
                assert "Shard(dim=1)" in r["ln_2"]["placements"], (rank, case, r["ln_2"])
        # what the backward keeps whole (every token, every feature): tensor parallelism alone keeps each layer's
        # norms' inputs and the column-parallel projections' inputs (4 a layer), the last norm's and the head's;
        # sequence parallelism only the head's (its vocabulary is not split here) -- the projections' inputs,
        # gathered from the sequence split, are kept split and gathered again in the backward, as Megatron-LM does
        # (counted by shape on 2 ranks: on 4 the MLP's 4 x hidden features split 4 ways look like a whole one)
        layers = 2
        saved = {case: out[case]["saved_whole"] for case in ("full_batch", "full_batch_no_sp")}
        assert n != 2 or saved == {"full_batch": 1, "full_batch_no_sp": 4 * layers + 2}, saved
        # Megatron's contract: the row-parallel layers' all-reduces become reduce-scatters
        assert "all_reduce" not in out["full_batch"]["comms"], out["full_batch"]["comms"]
        assert out["full_batch"]["comms"]["reduce_scatter_tensor"] == out["full_batch_no_sp"]["comms"]["all_reduce"]
        for case, message in MISTAKES.items():
            r = out[case]
            assert r["raised"] == "StrategyError" and message.format(n=n) in r["message"], (rank, case, r)
            assert "\n" not in r["message"]
