"""The PyTorch door on a well-known model's loop: a nanoGPT-style GPT (tied embeddings, position embeddings, SDPA,
AdamW weight-decay groups, warm-up + cosine lr, clipping, 2 micro-steps of accumulation; tests/scripts/gpt.py) trains
in every mode with only the context call added -- equal to one process on the same global batches, the tie intact,
``state_dict()`` full tensors that load into a plain one-process GPT. One launch per world size runs every mode."""
import json

import pytest

from procutil import SCRIPTS, autopar_cmd

MODES = ["data", "semi_megatron", "auto", "zero1", "zero3", "pipeline", "pipeline_logits"]
TOL = 1e-5


@pytest.mark.parametrize("n", [2, 4])
def test_a_nanogpt_loop_trains_exactly_in_every_mode(procs, tmp_path, n):
    res = procs.run(autopar_cmd("launch", "-n", str(n), "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "gpt_train.py"), str(tmp_path / "out"), json.dumps(MODES)), timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs" / "worker_0.log").read_text()
    for rank in range(n):
        results = json.load(open(tmp_path / f"out.{rank}"))
        assert sorted(results) == sorted(MODES)
        for mode, r in results.items():
            assert "error" not in r, (rank, mode, r.get("error"), r.get("trace"))
            assert r["param"] <= TOL and r["state_dict_reload"] <= TOL, (rank, mode, r)
            assert r["tie"] and r["tie_after_reload"] and r["state_dict_plain"], (rank, mode, r)
