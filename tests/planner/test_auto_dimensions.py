"""AUTO_PARALLEL weighs context and expert parallelism (autopar.planner.dimensions) beside data parallel, ZeRO and
the layouts: each variant is predicted and listed in the plan, measured by the round, and -- chosen -- runs exactly
as one process would (float64, 3 AdamW steps with clipping) on 2 and 4 ranks, one launch each
(tests/scripts/auto_dimensions.py): the sequence split when a long sequence is the whole batch (full_batch, one
sequence), the experts split on a mixture-of-experts block whose data-parallel loading is left as the user wrote it.
In one process: which networks get which variant, and that the measured round's runners-up include them."""
import json

import pytest
import torch

from autopar.models import LlamaBlock, MoEBlock, resnet50
from autopar.planner.alternatives import alternatives, describe
from autopar.planner.machine import MachineModel
from autopar.planner.plan import plan_network
from procutil import SCRIPTS, autopar_cmd

CASES = ["cp_plan", "ep_plan", "cp_module_loss", "cp_auto", "ep_auto", "cp_ring_plan"]
TOL = 1e-9


@pytest.mark.parametrize("n", [2, 4])
def test_auto_weighs_and_runs_context_and_expert_parallelism_exactly(procs, tmp_path, n):
    # (the suite's minutes: the loss module and the user's path on 2, the ring on 4)
    cases = CASES[:-1] if n == 2 else CASES[:2] + CASES[-1:]
    res = procs.run(autopar_cmd("launch", "-n", str(n), "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "auto_dimensions.py"), str(tmp_path / "out"), json.dumps(cases)),
                    env=procs.env(AUTOPAR_CACHE_DIR=str(tmp_path / "cache")), timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs" / "worker_0.log").read_text()
    for rank in range(n):
        out = json.load(open(tmp_path / f"out.{rank}"))
        for case in cases:
            r = out[case]
            assert "error" not in r, (rank, case, r.get("error"), r.get("trace"))
            assert r["param"] <= TOL and (r["loss"] <= TOL or r["plain"]), (rank, case, r["loss"], r["param"])
            # (the ring's case gives its algorithm: one variant a degree; the others leave AUTO to weigh each)
            variant = f"context parallel {n}" + ("" if case == "cp_ring_plan" else " (all_gather)") \
                if case.startswith("cp") else f"data parallel + expert parallel {n}"
            assert variant in r["variants"], (case, r["variants"])
            assert variant in r["explain"], r["explain"]
            if case == "cp_ring_plan":
                assert r["ran_algo"] == "ring" and not any("(" in v for v in r["variants"]), r
            elif case.startswith("cp"):  # the GPT's 4 heads: Ulysses on 2 and 4, the ring (CPU kernel) too
                assert {f"context parallel {n} ({a})" for a in ("ulysses", "ring")} <= set(r["variants"]), r
            if case == "cp_auto" and r["context_parallel"] > 1:  # the algorithm it ran is the one it chose
                assert r["ran_algo"] == r["algo"], r
            if case == "cp_plan":  # the norms ran on this rank's slice of the one sequence
                assert r["context_parallel"] == n and r["ln_1"]["local"] == [1, 32 // n, 16], r
            if case == "ep_plan":
                assert r["expert_parallel"], r
            if case.endswith("auto") and r["trials"]:  # a variant the round measured: beside data parallel
                assert "data parallel" in r["trials"], (case, r["trials"])


def _plan(network, sample, n=2):
    return plan_network(network, torch.nn.MSELoss(), sample, n, MachineModel(device_num=n))


@pytest.mark.parametrize("n", [2, 4])
def test_a_causal_sdpa_network_is_weighed_split_on_its_sequence(n):
    sample = (torch.randn(4, 64, 64), torch.randn(4, 64, 64))
    plan = _plan(LlamaBlock(64, 4, 2, 128, 64, causal=True), sample, n)
    assert plan.graph.attention and plan.graph.sequence == 64
    # every algorithm at each degree: 4 heads (the key/value heads repeated to them before attention) that 2 and 4
    # divide, and a sequence of 64 that holds two chunks a rank for the ring
    expected = {f"context parallel {cp}" + (f" x data parallel {n // cp}" if n // cp > 1 else "") + f" ({algo})"
                for cp in (2, 4) if cp <= n for algo in ("all_gather", "ring", "ulysses")}
    assert set(plan.variants) == expected, plan.variants
    round_ = alternatives(plan, within=1e9)
    assert {describe(c) for c in round_ if c.context_parallel > 1} == expected
    assert "data parallel" in [describe(c) for c in round_]
    for c in round_:  # the runners-up divide the batch as data parallel does unless they are the variant
        assert (c.context_parallel > 1) == describe(c).startswith("context parallel")
        if c.context_parallel > 1:  # each runner-up runs the algorithm it was weighed with
            assert describe(c).endswith(f"({c.context_parallel_algo})"), describe(c)


def test_auto_chooses_the_context_parallel_algorithm_unless_the_user_gave_one():
    """Left open, ``context_parallel_algo`` is AUTO's to choose: each algorithm that runs is weighed and the fastest
    split is the plan's, the algorithm with it. A value the user gave -- even the default's -- is the only one
    weighed."""
    import autopar

    sample = (torch.randn(1, 256, 64), torch.randn(1, 256, 64))
    block = LlamaBlock(64, 4, 4, 128, 256, causal=True)
    plan = _plan(block, sample, 2)
    algos = {v.algo for v in plan.variants.values()}
    assert algos == {"all_gather", "ulysses", "ring"}, plan.variants
    best = min(plan.variants.values(), key=lambda v: v.totals.step)
    if plan.context_parallel > 1:  # (one sequence: data parallel cannot split it, so the split is chosen)
        assert (plan.context_parallel, plan.context_parallel_algo) == (best.cp, best.algo), plan.reason
        assert f"({best.algo})" in plan.reason
    try:
        autopar.set_auto_parallel_context(context_parallel_algo="all_gather")
        given = _plan(block, sample, 2)
    finally:
        autopar.reset_auto_parallel_context()
    assert {v.algo for v in given.variants.values()} == {"all_gather"} and list(given.variants) == [
        "context parallel 2"], given.variants
    assert not autopar.context.given_by_user("context_parallel_algo")  # (a reset forgets it)


def test_each_context_parallel_algorithm_is_costed_as_it_runs():
    """The variant AUTO weighs runs with the user's ``context_parallel_algo``: the ring keeps two key-value blocks
    where the all-gather keeps the whole sequence's, and it balances the causal work the all-gather leaves to the
    last rank; Ulysses needs heads the group divides."""
    import autopar

    sample = (torch.randn(4, 256, 64), torch.randn(4, 256, 64))
    block = LlamaBlock(64, 4, 4, 128, 256, causal=True)
    totals = {}
    try:
        for algo in ("all_gather", "ring", "ulysses"):
            autopar.set_auto_parallel_context(context_parallel_algo=algo)
            totals[algo] = _plan(block, sample, 4).variants["context parallel 4"][2]
        heads = _plan(LlamaBlock(64, 2, 2, 128, 256, causal=True), sample, 4).variants  # (still ulysses)
    finally:
        autopar.reset_auto_parallel_context()
    assert totals["ring"].memory < totals["all_gather"].memory
    assert totals["ulysses"].memory < totals["all_gather"].memory
    assert totals["ring"].compute < totals["all_gather"].compute  # the last rank's extra causal blocks
    assert "context parallel 2 x data parallel 2" in heads and "context parallel 4" not in heads


def test_experts_are_weighed_split_and_networks_that_cannot_split_are_not():
    plan = _plan(MoEBlock(32, 4, 48, 2), (torch.randn(8, 4, 32), torch.randn(8, 4, 32)))
    assert list(plan.variants) == ["data parallel + expert parallel 2"]
    ep = [c for c in alternatives(plan, within=1e9) if c.expert_parallel]
    assert len(ep) == 1 and [t for t, s in ep[0].strategies()] == [plan.graph.experts[0][0]]
    assert plan.variants["data parallel + expert parallel 2"][2].memory < plan.dp_totals.memory
    # no SDPA (the explicit score matrix), a convolution: no sequence split; 3 experts over 2 ranks: no expert split
    assert not _plan(LlamaBlock(64, 4, 2, 128, 64), (torch.randn(4, 64, 64), torch.randn(4, 64, 64))).variants
    assert not plan_network(resnet50(num_classes=10), torch.nn.CrossEntropyLoss(),
                            (torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))), 2,
                            MachineModel(device_num=2)).variants
    assert not _plan(MoEBlock(32, 3, 48, 2), (torch.randn(8, 4, 32), torch.randn(8, 4, 32))).variants


class _OwnRotary(torch.nn.Module):
    """A leaf of the user's own that numbers the positions itself: on a slice of the sequence it would start again at
    0, so AUTO must not split the sequence around it."""

    def forward(self, x):
        return x + torch.arange(x.shape[1], dtype=x.dtype)[None, :, None]


def test_a_sequence_split_is_not_weighed_around_modules_it_could_get_wrong():
    sample = (torch.randn(4, 64, 64), torch.randn(4, 64, 64))
    plain = LlamaBlock(64, 4, 2, 128, 64, causal=True)
    assert "context parallel 2 (all_gather)" in _plan(plain, sample).variants
    own = torch.nn.Sequential(_OwnRotary(), LlamaBlock(64, 4, 2, 128, 64, causal=True))
    assert not _plan(own, sample).variants  # a leaf not known to be token-wise
    plain.attn_dropout = 0.1  # attention dropout: a sequence split refuses it (its draws are not one process's)
    assert not _plan(plain, sample).variants


def test_hugging_face_mixtral_experts_are_weighed_split():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32))
    ids = torch.randint(0, 64, (4, 16))
    plan = plan_network(model, None, (), 2, MachineModel(device_num=2), sample_kwargs={"input_ids": ids, "labels": ids})
    assert len(plan.graph.experts) == 1 and "data parallel + expert parallel 2" in plan.variants, plan.variants
