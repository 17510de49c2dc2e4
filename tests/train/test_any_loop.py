"""Every loop a user writes trains exactly, in every parallel mode, with nothing from autopar in the loop.

One launch per world size runs the whole matrix (tests/scripts/any_loop.py): modes {DATA, SEMI_AUTO Megatron MLP,
SEMI_AUTO with a redistribution between operators, AUTO, HYBRID} x loops {plain torch, TrainOneStepCell,
value_and_grad, Model.train} x optimizers {SGD, Momentum, AdamW with a cosine schedule, SGD with clip_grad_norm_;
in the plain loop also torch's GradScaler: unscale_ + clipping + SGD, and fused AdamW},
the loss as a function, a lambda, a Module and a Cell. Parameters after 5 steps must equal one process on the global
batch; per mode also no_grad evaluation, the state_dict round trip and a bit-identical resume from a checkpoint.
"""
import json

import pytest

from procutil import SCRIPTS, autopar_cmd, worker_logs

TOL = 1e-5
MODES = ["data", "semi_megatron", "semi_redistribute", "auto", "hybrid"]


@pytest.mark.parametrize("n", [2, 4])
def test_every_loop_trains_exactly_in_every_mode(procs, tmp_path, n):
    res = procs.run(autopar_cmd("launch", "-n", str(n), "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "any_loop.py"), str(tmp_path / "out"), json.dumps(MODES)), timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr + worker_logs(tmp_path / "logs")
    for rank in range(n):
        results = json.load(open(tmp_path / f"out.{rank}"))
        errors = results.pop("errors")
        assert "none of the weights took part" in errors["unused_weights"], errors
        assert "got 1 gradients for 4 parameters" in errors["gradient_count"], errors
        assert "layerwise_parallel parameters ['fc2.bias'] need parallel_mode=hybrid_parallel" in \
            errors["layerwise_in_semi_auto"], errors
        cases = {k: v for k, v in results.items() if not k.endswith("/extras")}
        assert len(cases) == len(MODES) * 15 - 2, sorted(cases)  # hybrid has no clipping cases
        bad = {k: v for k, v in cases.items() if "error" in v or v["param"] > TOL}
        assert not bad, json.dumps(bad, indent=1)
        for mode in MODES:
            extra = results[f"{mode}/extras"]
            assert "error" not in extra, (mode, extra)
            assert extra["no_grad_eval"] <= TOL, (mode, extra)
            if mode != "hybrid":
                assert extra["state_dict_full"], (mode, extra)  # full tensors, as a module gives
                assert max(extra["state_dict_vs_ref"], extra["state_dict_reload"]) <= TOL, (mode, extra)
                assert extra["resume_bitwise"] == 0.0, (mode, extra)
