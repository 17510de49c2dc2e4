"""timm's ``VisionTransformer`` (a cls token and a position-embedding parameter concatenated/added inside
``forward``) as its users train it, in every mode of the PyTorch door (Megatron: the MLP and the attention's output
projection; timm's fused qkv is left whole -- its columns are (3, heads, head_dim) and a plain column split would
cut across q, k and v): tiny config, float64, AdamW + 2 micro-steps + ``clip_grad_norm_(1.0)`` -- equal to one process on the same global batches, and ``state_dict()`` loading into a
fresh one-process model. One launch runs every case (tests/scripts/hf_train.py)."""
import json

import pytest

from procutil import SCRIPTS, autopar_cmd

pytest.importorskip("timm")

MODES = ["data", "zero1", "zero3", "semi", "megatron", "names", "auto", "auto_explicit", "auto_megatron", "pipe"]
TOL = 1e-9  # float64: exact math shows as ~1e-14


def test_timm_vit_trains_exactly_in_every_mode(procs, tmp_path):
    cases = [["vit", mode] for mode in MODES]
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "hf_train.py"), str(tmp_path / "out"), json.dumps(cases)), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs" / "worker_0.log").read_text()
    for rank in range(2):
        results = json.load(open(tmp_path / f"out.{rank}"))
        assert sorted(results) == sorted(f"{m}/{mode}" for m, mode in cases)
        for case, r in results.items():
            assert "error" not in r, (rank, case, r.get("error"), r.get("trace"))
            assert r["param"] <= TOL and r["state_dict_reload"] <= TOL, (rank, case, r)
            if case.endswith(("/megatron", "/names", "/auto_megatron")):  # the MLP and the attention's output projection
                assert {"blocks.0.mlp.fc1.weight", "blocks.1.attn.proj.weight"} <= set(r["split"]), (case, r)
