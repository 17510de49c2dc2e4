"""A mixture of experts on a cluster you do not have (planner/cluster/experts.py): the published models' sizes, the
all-to-all on a topology, DeepEP's once-a-node dispatch, the experts' parameters and state split by expert
parallelism, the search weighing it where autopar runs it, and one line for each pin that cannot hold (fixed
figures, deterministic, no job)."""
import dataclasses
import json
import math

import pytest

from autopar.cli.main import main as cli
from autopar.errors import ConfigError
from autopar.planner.cluster import load_cluster, plan_gpt
from autopar.planner.cluster.collectives import all_to_all_seconds
from autopar.planner.cluster.experts import destination_odds, dispatch_bytes
from autopar.planner.gpt import PRESETS, GPTConfig

H100 = load_cluster("h100-ib")
QWEN = PRESETS["qwen3-30b-a3b"]
PINS = {"tp": 1, "pp": 1, "cp": 1, "micro_batch": 1, "zero": 1, "recompute": False}


def test_the_mixture_presets_have_their_published_sizes():
    # the model cards: Qwen3-30B-A3B "30.5B in total and 3.3B activated", Qwen3-235B-A22B "235B ... 22B activated",
    # Mixtral 8x7B 46.7B of which 12.9B a token (Mistral AI's announcement), 8x22B 141B / 39B
    for name, total, active in (("qwen3-30b-a3b", 30.5, 3.3), ("qwen3-235b-a22b", 235, 22), ("mixtral-8x7b", 46.7, 12.9),
                                ("mixtral-8x22b", 141, 39)):
        c = PRESETS[name]
        assert c.moe and c.parameters / 1e9 == pytest.approx(total, rel=0.01), name
        assert c.active_parameters / 1e9 == pytest.approx(active, rel=0.03), name
        assert f"{c.experts} experts of {c.expert_ffn_size} (top {c.experts_chosen}" in c.describe()


def test_a_mixture_counts_the_flops_of_the_experts_a_token_runs():
    moe = GPTConfig(4, 512, 8, seq=256, vocab=1000, family="llama", experts=8, top_k=2, expert_ffn=384)
    dense = GPTConfig(4, 512, 8, seq=256, vocab=1000, family="llama", ffn=2 * 384)  # two experts' width
    router = 6 * 16 * 256 * 4 * 512 * 8  # 2 h E a token and layer, x3, for 16 sequences
    assert moe.model_flops(16) == pytest.approx(dense.model_flops(16) + router, rel=1e-12)
    assert moe.parameters - dense.parameters == 4 * (6 * 3 * 512 * 384 + 512 * 8)  # six experts more, the router


def test_an_all_to_all_is_bound_by_the_senders_own_nic_across_nodes():
    nic = H100.nic_per_device  # 8 NICs of 400 Gb/s for 8 GPUs: one each
    assert nic == pytest.approx(50e9 * 0.94)
    one_node = all_to_all_seconds(H100, 0.0, 100e6, 8)
    assert one_node == pytest.approx(8.4e-6 + H100.intra.latency + 100e6 / H100.intra.effective)
    two_nodes = all_to_all_seconds(H100, 100e6, 100e6, 16)
    assert two_nodes == pytest.approx(8.4e-6 + H100.inter.latency + 100e6 / nic)  # the network's share sets it
    assert all_to_all_seconds(H100, 0.0, 0.0, 16) == 0.0 == all_to_all_seconds(H100, 1e6, 1e6, 1)


def test_deepep_sends_a_token_once_to_each_node_and_rank_nccl_once_an_expert():
    assert destination_odds(128, 8, 128) == 1.0
    assert destination_odds(128, 1, 16) == pytest.approx(16 / 128)
    assert destination_odds(128, 2, 64) == pytest.approx(1 - (64 * 63) / (128 * 127))
    tokens, row = 4096, QWEN.hidden * 2
    off, on = dispatch_bytes(QWEN, H100, tokens, 16, "alltoall", 2)  # 2 nodes of 8: half the copies leave
    assert off == pytest.approx(tokens * 8 * row * 8 / 16) and on == pytest.approx(tokens * 8 * row * 7 / 16)
    d_off, d_on = dispatch_bytes(QWEN, H100, tokens, 16, "deepep", 2)
    assert d_off == pytest.approx(tokens * destination_odds(128, 8, 64) * row)  # once to the other node
    assert 4.0 < off / d_off < 4.1  # the ~4 copies a remote node of top-8 over 2 nodes: one
    # more over NVLink (what crossed the network is forwarded to its ranks there), far less time
    assert d_on > on and all_to_all_seconds(H100, d_off, d_on, 16) < 0.3 * all_to_all_seconds(H100, off, on, 16)
    assert dispatch_bytes(QWEN, H100, tokens, 8, "deepep", 2)[0] == 0.0  # one node: nothing crosses the network


def test_expert_parallelism_splits_the_experts_their_state_and_sends_the_tokens():
    short = dataclasses.replace(QWEN, layers=8)  # every expert on every rank fits with ZeRO-1
    whole = plan_gpt(short, H100, 16, 64, fixed={**PINS, "ep": 1})
    split = plan_gpt(short, H100, 16, 64, fixed={**PINS, "ep": 16})
    lw, ls = (p.planner.layer(p.best.t, 1, 1, False, p.best.ep) for p in (whole, split))
    per_expert = 3 * QWEN.hidden * QWEN.expert_ffn_size
    assert lw.expert_param_count == 128 * per_expert and ls.expert_param_count == 8 * per_expert
    assert lw.dispatch == 0.0 < ls.dispatch  # one rank holds every expert: no all-to-all
    assert split.best.expert_replicas == 1 and whole.best.expert_replicas == 16
    assert split.best.memory_parts["weights+grads+optimizer"] < whole.best.memory_parts["weights+grads+optimizer"]
    text = split.explain()
    assert "mesh: dp 16 x tp 1 x pp 1, ep 16" in text and "experts: 8 of the 128 a rank" in text
    assert "experts.fc1" in text and "all-to-all" in text
    d = split.to_dict()
    assert d["configuration"]["ep"] == 16 and d["configuration"]["moe_dispatcher"] == "alltoall"
    assert d["not_run_by_autopar"] == []
    # hidden behind another micro-batch's compute, the all-to-alls cost less; DeepEP's fewer bytes cost less
    overlap = plan_gpt(short, H100, 16, 64, fixed={**PINS, "ep": 16, "ep_overlap": True})
    deepep = plan_gpt(short, H100, 16, 64, fixed={**PINS, "ep": 16, "dispatcher": "deepep"})
    assert overlap.best.step < split.best.step and deepep.best.step < split.best.step
    assert "all-to-alls overlapped with another micro-batch's compute" in overlap.to_dict()["not_run_by_autopar"]
    assert any("deepep dispatcher" in line for line in deepep.to_dict()["not_run_by_autopar"])


def test_the_search_weighs_expert_parallelism_where_autopar_runs_it():
    plan = plan_gpt(QWEN, H100, 16, 256)
    degrees = {c.ep for c in plan.ranked}
    assert len(degrees) > 2 and 16 in degrees  # every divisor of the experts and the ranks
    for c in plan.ranked:
        assert plan.not_run(c) == [], (c.mesh(), plan.not_run(c))
        assert c.ep == 1 or (c.p == 1 and c.cp == 1 and c.t == 1), c.mesh()
    # pinned as Megatron runs it -- experts over a stage's ranks, sequence-parallel tensor groups -- it plans and says
    # what autopar does not run
    staged = plan_gpt(PRESETS["qwen3-235b-a22b"], H100, 256, 512,
                      fixed={"tp": 2, "pp": 8, "vpp": 4, "ep": 32, "cp": 1, "micro_batch": 1})
    assert staged.best.sp and staged.best.ep == 32 and staged.best.expert_replicas == 1
    assert {"expert parallelism inside pipeline stages", "sequence parallelism beside expert parallelism"} <= set(
        staged.to_dict()["not_run_by_autopar"])


@pytest.mark.parametrize("config, pins, message", [
    (PRESETS["llama3-8b"], {"ep": 2}, "--ep describes how a mixture of experts runs, and Llama 8.0B has none"),
    (QWEN, {"ep": 3}, "--ep 3 does not divide the 128 experts"),
    (QWEN, {"ep": 0}, "--ep must be a positive expert-parallel degree"),
    (QWEN, {"dispatcher": "nvshmem"}, "--moe-dispatcher must be alltoall or deepep"),
])
def test_a_mixture_pin_that_cannot_hold_is_one_line(config, pins, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
        plan_gpt(config, H100, 16, 64, fixed=pins)
    assert "\n" not in str(e.value)


def test_a_mixture_on_the_wrong_shape_is_one_line():
    for kwargs, message in (({"family": "gpt", "experts": 8}, "a mixture of experts is planned on the Llama shape"),
                            ({"family": "llama", "experts": 8, "top_k": 9}, "top_k (9) routes each token to more"),
                            ({"family": "llama", "top_k": 2}, "give experts too"),
                            ({"family": "llama", "experts": 1}, "needs 2 experts or more")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            GPTConfig(2, 256, 4, **kwargs)


def test_autopar_plan_takes_a_mixture_from_the_command_line(capsys):
    assert cli(["plan", "llama", "--size", "qwen3-30b-a3b", "-n", "16", "--machine", "h100-ib", "--global-batch", "64",
                "--ep", "8", "--tp", "1", "--pp", "1", "--moe-dispatcher", "deepep", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    c = out["configuration"]
    assert c["ep"] == 8 and c["moe_dispatcher"] == "deepep" and c["dp"] == 16 and "128 experts of 768" in c["model"]
    assert math.isclose(out["tokens_per_s_per_device"] * out["step_s"] * 16, 64 * 4096)
    # a mixture built from flags; flags of a mixture on another model are one line
    assert cli(["plan", "llama", "--layers", "4", "--hidden", "1024", "--experts", "8", "--top-k", "2",
                "--expert-ffn", "512", "-n", "8", "--machine", "h100-ib", "--global-batch", "16", "--json"]) == 0
    assert "8 experts of 512 (top 2" in json.loads(capsys.readouterr().out)["configuration"]["model"]
    assert cli(["plan", "mlp", "-n", "2", "--ep", "2"]) == 2
    assert "--ep pins the cluster plan" in capsys.readouterr().err
    assert cli(["plan", "gpt", "--size", "1.3b", "-n", "8", "--machine", "h100-ib", "--experts", "8"]) == 2
    assert "use model llama" in capsys.readouterr().err


def test_a_mixture_plans_its_layer_as_the_attention_half_and_the_experts():
    planner = plan_gpt(QWEN, H100, 16, 64, fixed={**PINS, "ep": 16}).planner
    dense_half = planner._layers[(1, 1, 1, False)]
    layer = planner.layer(1, 1, 1, False, 16)
    names = [n.name.split(".")[-1] for n in dense_half.graph.nodes]
    assert "gate" not in names and "q" in names  # the captured half: attention, no MLP
    assert layer.time > dense_half.time and layer.activation_bytes > dense_half.activation_bytes
    assert layer.param_count == dense_half.param_count + QWEN.hidden * QWEN.experts  # the router on every rank
    rows = [r[0] for r in layer.rows()]
    assert rows[-4:] == ["router", "experts.fc1", "experts.fc2", "experts.dispatch"]
    assert dataclasses.replace(QWEN, experts=0, top_k=0, expert_ffn=0).moe is False
