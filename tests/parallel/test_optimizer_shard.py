"""Optimizer sharding (enable_parallel_optimizer, ZeRO levels 1-3 on FSDP2) trains exactly as one process on the
global batch -- plain torch loops with the optimizer made before or after the first forward, and Model.train --
holds about 1/N of the optimizer state per rank, and its sliced checkpoint reloads into one process and, optimizer
state included, onto plain data-parallel ranks."""
import json
import sys

import pytest
import torch

import autopar
from autopar.errors import ConfigError
from autopar.parallel.zero.fsdp import level_of, shard_size_of, storage_placements
from procutil import SCRIPTS, autopar_cmd


@pytest.mark.parametrize("config, level, warns", [
    ({}, "level1", None), ({"optimizer_level": "level3"}, "level3", None),
    ({"optimizer_weight_shard_size": 2}, "level1", None),
    ({"parallel_optimizer_threshold": 64}, "level1", "parallel_optimizer_threshold is not applied"),
    ({"gradient_accumulation_shard": True}, "level1", "gradient_accumulation_shard=True is not applied")])
def test_the_context_picks_a_level_and_warns_about_what_it_cannot_do(config, level, warns, recwarn):
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(enable_parallel_optimizer=True, parallel_optimizer_config=config)
    assert level_of(autopar.context.auto_parallel_context()) == level
    messages = [str(w.message) for w in recwarn]
    assert (any(warns in m for m in messages) if warns else not messages), messages
    autopar.reset_auto_parallel_context()


@pytest.mark.parametrize("config, error", [({"optimizer_level": "level4"}, "optimizer_level='level4'"),
                                           ({"optimizer_levels": "level1"}, "unknown keys ['optimizer_levels']")])
def test_bad_sharding_config_is_one_line(config, error):
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(enable_parallel_optimizer=True, parallel_optimizer_config=config)
    with pytest.raises(ConfigError, match=error.replace("[", r"\[").replace("]", r"\]")):
        level_of(autopar.context.auto_parallel_context())
    autopar.reset_auto_parallel_context()
    assert level_of(autopar.context.auto_parallel_context()) is None  # off by default


@pytest.mark.parametrize("key, value, world, size", [
    (None, None, 4, 4), ("optimizer_weight_shard_size", -1, 4, 4), ("optimizer_weight_shard_size", 2, 4, 2),
    ("optimizer_weight_shard_size", 3, 4, "must divide the 4 data-parallel ranks"),
    ("optimizer_weight_shard_size", 8, 4, "must divide"), ("optimizer_weight_shard_size", "2", 4, "positive integer")])
def test_hybrid_shard_size_from_config_or_context(key, value, world, size):
    for where in ("config", "context"):
        autopar.reset_auto_parallel_context()
        if key and where == "config":
            autopar.set_auto_parallel_context(enable_parallel_optimizer=True, parallel_optimizer_config={key: value})
        elif key:
            autopar.set_auto_parallel_context(enable_parallel_optimizer=True, **{key: value})
        ctx = autopar.context.auto_parallel_context()
        if isinstance(size, int):
            assert shard_size_of(ctx, world) == size
        else:
            with pytest.raises(ConfigError, match=size):
                shard_size_of(ctx, world)
    autopar.reset_auto_parallel_context()


def test_zero_storage_splits_the_axes_a_layout_replicates():
    from torch.distributed.tensor import Replicate, Shard

    R, S = Replicate(), Shard
    # a column-split weight (dim 0 over mesh axis 1) on a (2, 2) mesh: ZeRO splits dim 1 over axis 0
    assert storage_placements((R, S(0)), (8, 6), (2, 2)) == (S(1), S(0))
    # replicated everywhere: one dimension over both axes (nested, in mesh order); the largest that divides
    assert storage_placements((R, R), (3, 8), (2, 2)) == (S(1), S(1))
    # hybrid: only the innermost axes covering the shard size
    assert storage_placements((R, R, R), (16,), (2, 2, 2), shard_size=4) == (R, S(0), S(0))
    # uneven when nothing divides; a bias split by its layout has no dimension left; a scalar stays whole
    assert storage_placements((R,), (5, 3), (2,)) == (S(0),)
    assert storage_placements((R, S(0)), (16,), (2, 2)) == (R, S(0))
    assert storage_placements((R,), (), (2,)) == (R,)


@pytest.mark.parametrize("n", [2, 4])
def test_zero_with_layouts_and_hybrid_sharding_train_exactly(procs, tmp_path, n):
    """Optimizer sharding in SEMI_AUTO (strategies on torch and MindSpore-style operators, an unannotated module)
    and AUTO, and hybrid sharding (optimizer_weight_shard_size=2) in SEMI_AUTO and DATA_PARALLEL: parameters after
    5 steps equal one process, every parameter stored split, the optimizer state ~1/N (1/2 for hybrid), and the
    sliced checkpoint loads into one process. Level 3 keeps no gathered weight from the forward to the backward."""
    res = procs.run(autopar_cmd("launch", "-n", str(n), "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "zero_layouts.py"), str(tmp_path / "out"), str(tmp_path / "ckpt")),
                    timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs" / "worker_0.log").read_text()
    for rank in range(n):
        results = json.load(open(tmp_path / f"out.{rank}"))
        assert len(results) == 2 * 3 * 3 + 7 + 1, sorted(results)
        bad = {k: v for k, v in results.items() if "error" in v}
        assert not bad, json.dumps(bad, indent=1)
        kept = results.pop("forward_keeps_mib")  # level 3 gathers the two 64 MiB weights again for the backward
        # (bytes the allocator has handed out; the forward may also free up to ~1 MiB of earlier tensors, so the
        # two whole weights read 127-129 -- a CI run read 127.88)
        assert kept["level1"] >= 124 and kept["level1"] - kept["level3"] >= 120, kept
        for key, r in results.items():
            assert r["diff"] <= 1e-5 and r["names"], (key, r)
            assert all(local < whole for local, whole in r["stored"].values()), (key, r["stored"])
            share = 1 / 2 if "shard2" in key else 1 / n
            if r["state_whole"]:
                assert r["state_held"] <= r["state_whole"] * share * 1.5, (key, r)
    saved = json.load(open(tmp_path / "out.0"))["semi_auto_parallel/level3/AdamW/plain_before/shard-1"]["saved"]
    from autopar.checkpoint.api import merge_sliced_checkpoints

    merged = merge_sliced_checkpoints([tmp_path / "ckpt" / f"rank_{r}.ckpt" for r in range(n)], tmp_path / "merged.ckpt")
    params = autopar.load_checkpoint(merged)
    assert sorted(params) == sorted(saved)
    for name, value in params.items():
        assert torch.equal(value.detach(), torch.tensor(saved[name])), name


@pytest.mark.parametrize("n", [2, 4])
def test_zero_levels_train_exactly_and_shard_the_state(procs, tmp_path, n):
    res = procs.run(autopar_cmd("launch", "-n", str(n), "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "zero_train.py"), str(tmp_path / "out"), str(tmp_path / "ckpt")),
                    timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs" / "worker_0.log").read_text()
    for rank in range(n):
        results = json.load(open(tmp_path / f"out.{rank}"))
        assert len(results) == 3 * 3 * 3 + 3, sorted(results)
        bad = {k: v for k, v in results.items() if "error" in v}
        assert not bad, json.dumps(bad, indent=1)
        for key, r in results.items():
            if key == "warns":
                assert any("hybrid_parallel trains with the whole optimizer state" in m for m in r["messages"]), r
                continue
            assert r["diff"] <= 1e-5 and r["sharded"], (key, r)
            if r["state_whole"]:  # SGD without momentum has no state
                assert r["state_held"] <= r["state_share"] < r["state_whole"] / n * 1.25, (key, r)  # ~1/N
    # the sliced checkpoint of 2 or 4 ZeRO-3 ranks -> one process, full tensors equal to what the ranks held
    saved = json.load(open(tmp_path / "out.0"))["level3/AdamW/plain_before"]["saved"]
    from autopar.checkpoint.api import merge_sliced_checkpoints

    merged = merge_sliced_checkpoints([tmp_path / "ckpt" / f"rank_{r}.ckpt" for r in range(n)], tmp_path / "merged.ckpt")
    params = autopar.load_checkpoint(merged)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    autopar.load_param_into_net(net, params)
    for name, p in net.named_parameters():
        assert torch.allclose(p, torch.tensor(saved[name]), atol=0, rtol=0), name
    if n != 4:
        return
    # 4 ZeRO-3 ranks -> 2 plain data-parallel ranks -> 1 process, the optimizer state travelling along: each resumed
    # run continues exactly as one process that never stopped
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs2"),
                                str(SCRIPTS / "zero_reload.py"), str(tmp_path / "ckpt"), str(tmp_path / "dp_ckpt"),
                                str(tmp_path / "reload")), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs2" / "worker_0.log").read_text()
    for rank in range(2):
        r = json.load(open(tmp_path / f"reload.{rank}"))
        assert r["diff"] <= 1e-5 and r["steps"] == 6, r
    res = procs.run([sys.executable, str(SCRIPTS / "zero_reload.py"), str(tmp_path / "ckpt"),
                     str(tmp_path / "dp_ckpt"), str(tmp_path / "single.json"), "single"], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.load(open(tmp_path / "single.json"))["diff"] <= 1e-5
