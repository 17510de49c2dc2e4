"""Context parallelism on a nanoGPT-style GPT in float64, 2 and 4 ranks, one launch each
(tests/scripts/context_parallel.py): the inputs' sequence split by ``dataset_strategy``, every token-wise module on
its slice, attention over the gathered keys and values -- over every rank, dp x cp (4 ranks), with ZeRO-1 and
ZeRO-3, the optimizer made after the first forward, DeepSpeed-Ulysses' all-to-all, ring attention with the causal work balanced (dp x cp, ZeRO-1/3), cp x Megatron's tensor parallelism (4 ranks,
both algorithms; and with sequence parallelism), and a per-sample mask made
inside the network; each equal to one process after 3 AdamW steps with
clipping. What a user gets wrong is one line. (Hugging Face's Llama and GPT-2: tests/models/test_hf_transformers.py.)"""
import json

import pytest

from procutil import SCRIPTS, autopar_cmd

TRAINED = {2: ["cp", "cp_zero1", "cp_optimizer_after", "cp_ulysses", "cp_mask", "cp_ring", "cp_ring_zero3", "cp_gqa",
               "cp_ring_gqa"],
           4: ["cp", "dp_cp", "cp_zero3", "dp_cp_zero1", "cp_ulysses", "dp_cp_ulysses", "dp_cp_mask",
               "dp_cp_ulysses_mask", "cp_ring", "dp_cp_ring_zero1", "cp_tp", "cp_ring_tp", "cp_sp_tp"]}
MISTAKES = {
    "sequence_indivisible": ("StrategyError", "context parallelism: the ranks loaded slices of"),
    "attention_dropout": ("StrategyError", "context parallelism: attention dropout differs from one process's draws"),
    "ulysses_heads": ("StrategyError", "context_parallel_algo='ulysses' splits the heads over the"),
    "data_parallel_split": ("ConfigError", "splits the sequence (context parallelism), which runs in "
                                           "parallel_mode='semi_auto_parallel' (now data_parallel)"),
    "ring_odd_chunks": ("StrategyError", "context_parallel_algo='ring' balances the causal work by giving each of"),
}
TOL = 1e-9
SEQ = 16  # the script's GPT block size


@pytest.mark.parametrize("n", [2, 4])
def test_context_parallelism_trains_exactly(procs, tmp_path, n):
    res = procs.run(autopar_cmd("launch", "-n", str(n), "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "context_parallel.py"), str(tmp_path / "out"),
                                json.dumps(TRAINED[n] + list(MISTAKES))), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs" / "worker_0.log").read_text()
    for rank in range(n):
        out = json.load(open(tmp_path / f"out.{rank}"))
        for case in TRAINED[n]:
            r = out[case]
            assert "error" not in r, (rank, case, r.get("error"), r.get("trace"))
            assert r["loss"] <= TOL and r["param"] <= TOL, (rank, case, r)
            parts = 4 if "_sp_" in case else 2 if case.startswith("dp_cp") or case.endswith("_tp") else n
            assert r["ln_1"]["local"][1] == SEQ // parts, (rank, case, r["ln_1"])  # the norms hold a slice
            if case.endswith("_tp"):  # the fused qkv projection's 48 output features split over the pair
                assert r["c_attn"][0] == 24, (rank, case, r["c_attn"])
        for case, (kind, message) in MISTAKES.items():
            r = out[case]
            assert r["raised"] == kind and message in r["message"], (rank, case, r)
            assert "\n" not in r["message"]
