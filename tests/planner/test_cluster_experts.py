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
from autopar.planner.cluster.experts import destination_odds, dispatch_bytes, expert_block
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
        assert c.not_run_by_autopar() == [], (c.mesh(), plan.not_run(c))  # (Megatron's tensor overlap aside)
        assert c.ep == 1 or (c.p > 1 and c.d % c.ep == 0) or (not c.sp and c.cp == 1 and c.t == 1), c.mesh()
    # pinned as Megatron runs it -- experts over a stage's ranks, sequence-parallel tensor groups -- it plans and says
    # what autopar does not run: experts over more than a stage's replicas (sequence parallelism beside them inside
    # pipeline stages it runs: PipelineParallel(ep=..., tensor_parallel={...: "sequence"}))
    staged = plan_gpt(PRESETS["qwen3-235b-a22b"], H100, 256, 512,
                      fixed={"tp": 2, "pp": 8, "vpp": 4, "ep": 32, "cp": 1, "micro_batch": 1})
    assert staged.best.sp and staged.best.ep == 32 and staged.best.expert_replicas == 1
    assert not any("sequence parallelism beside" in line for line in staged.to_dict()["not_run_by_autopar"])
    assert any(line.startswith("expert parallelism inside pipeline stages over other than a stage's")
               for line in staged.to_dict()["not_run_by_autopar"])
    flat = plan_gpt(QWEN, H100, 16, 64, fixed={**PINS, "tp": 2, "ep": 2, "sp": True, "zero": 3})  # (outside pipelines)
    assert "sequence parallelism beside expert parallelism outside pipeline stages" in \
        flat.to_dict()["not_run_by_autopar"]
    # inside pipeline stages autopar runs a mixture's experts whole on each rank, or spread over a stage's replicas
    # or groups of them, beside ZeRO over them or not (PipelineParallel(ep=..., zero=...)): the search weighs each
    free = plan_gpt(PRESETS["qwen3-235b-a22b"], H100, 256, 512).ranked
    assert any(c.p > 1 and c.ep == 1 for c in free) and any(c.p > 1 and c.ep > 1 for c in free)
    assert any(c.p > 1 and c.ep > 1 and c.zero for c in free) and any(c.p > 1 and c.ep > 1 and not c.zero for c in free)
    assert all(c.d % c.ep == 0 for c in free if c.p > 1)
    assert any(c.p > 1 and 1 < c.ep < c.d for c in free)
    assert any(c.p > 1 and c.ep > 1 and c.sp for c in free)  # beside sequence-parallel tensor groups too


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
    dense_half = planner._layers[("layer", 1, 1, 1, False)]
    layer = planner.layer(1, 1, 1, False, 16)
    names = [n.name.split(".")[-1] for n in dense_half.graph.nodes]
    assert "gate" not in names and "q" in names  # the captured half: attention, no MLP
    assert layer.time > dense_half.time and layer.activation_bytes > dense_half.activation_bytes
    assert layer.param_count == dense_half.param_count + QWEN.hidden * QWEN.experts  # the router on every rank
    rows = [r[0] for r in layer.rows()]
    assert rows[-4:] == ["router", "experts.fc1", "experts.fc2", "experts.dispatch"]
    assert dataclasses.replace(QWEN, experts=0, top_k=0, expert_ffn=0).moe is False


def test_fp8_experts_wait_for_their_casts_as_the_projections_do():
    """Under fp8 each grouped linear's token copies, weights and output gradients are cast first (delayed scaling:
    4 bytes an element of the copies and gradients, a weight cast once a step)."""
    machine = H100.group_machine(1, 1, "fp8")
    tokens, ep = 4096.0, 8
    bare = expert_block(QWEN, H100, machine, tokens, ep, "alltoall", 2)
    cast = expert_block(QWEN, H100, machine, tokens, ep, "alltoall", 2, "delayed")
    copies, h, f = tokens * QWEN.experts_chosen, QWEN.hidden, QWEN.expert_ffn_size
    extra = 4 * copies * ((h + 2 * f) + (f + h)) / H100.memory_bandwidth
    assert cast.time - bare.time == pytest.approx(extra)
    assert cast.forward - bare.forward == pytest.approx(4 * copies * (h + f) / H100.memory_bandwidth)
    assert cast.rows[-1][0] == "experts.fp8 casts" and bare.rows[-1][0] != "experts.fp8 casts"


def test_latent_attention_shared_experts_and_windows_have_their_published_sizes():
    # DeepSeek-V3: "671B total parameters with 37B activated" (its report, excluding the multi-token-prediction
    # module); Kimi K2: 1.04 trillion, 32 billion activated; Moonlight-16B-A3B; GPT-OSS: 116.8B / 20.9B, 5.1B / 3.6B
    # active (its model card counts no embedding: 0.58B each of the input and output ones)
    for name, total, active in (("deepseek-v3", 671, 37), ("kimi-k2", 1040, 32.5), ("moonlight-16b-a3b", 16, 2.9),
                                ("gpt-oss-120b", 116.8, 5.13 + 0.58), ("gpt-oss-20b", 20.9, 3.61 + 0.58)):
        c = PRESETS[name]
        assert c.parameters / 1e9 == pytest.approx(total, rel=0.015), name
        assert c.active_parameters / 1e9 == pytest.approx(active, rel=0.03), name
    d = PRESETS["deepseek-v3"]
    assert (d.qk_head, d.v_head, d.expert_layers) == (192, 128, 58)
    assert "latent attention (kv rank 512, q rank 1536)" in d.describe()
    assert "the first 3 layers dense" in d.describe() and "shared 2048" in d.describe()
    assert "a sliding window of 128 in 18 layers" in PRESETS["gpt-oss-120b"].describe()


def test_a_sliding_window_computes_its_band_of_the_causal_pairs():
    from autopar.ops.math import FusedAttention

    assert FusedAttention(3).window_share(8) == pytest.approx((3 * 8 - 3) / 36)
    assert FusedAttention(0).window_share(8) == 1.0 == FusedAttention(16).window_share(8)
    oss = PRESETS["gpt-oss-120b"]
    full = dataclasses.replace(oss, sliding_window=0, sliding_layers=0)
    core = 2 * oss.seq * oss.heads * 2 * oss.head_size * 3 * oss.seq * 64  # q k^T and p v, x3, 64 sequences
    saved = oss.layers / 2 * core * (1 - oss.window_share())
    assert full.model_flops(64) - oss.model_flops(64) == pytest.approx(saved, rel=1e-9)
    short = dataclasses.replace(oss, layers=4, sliding_layers=2)  # fits 16 GPUs with ZeRO-1
    planner = plan_gpt(short, H100, 16, 64, fixed={**PINS, "ep": 16}).planner
    whole, window = (planner._layers[(which, 1, 1, 1, False)] for which in ("layer", "window"))
    attention = [n for n in window.graph.nodes if n.kind == "attention"][0]
    assert attention.flops == pytest.approx(oss.window_share() * [n for n in whole.graph.nodes
                                                                   if n.kind == "attention"][0].flops)
    mixed = planner.layer(1, 1, 1, False, 16)
    assert whole.time > window.time and mixed.time == pytest.approx(
        (planner._with_experts(whole, 1, 1, False, 16).time + planner._with_experts(window, 1, 1, False, 16).time) / 2)


def test_latent_attention_splits_its_up_projections_by_heads_and_keeps_the_latents_whole():
    d = PRESETS["deepseek-v3"]
    plan = plan_gpt(d, H100, 1024, 8192, fixed={"tp": 2, "pp": 8, "vpp": 4, "ep": 64, "cp": 1, "micro_batch": 1,
                                                "dispatcher": "deepep"})
    layer = plan.planner.layer(2, 1, 1, True, 64)
    strategies = {r[0]: r[3] for r in layer.rows()}
    assert strategies["q_down"] == strategies["kv_down"] == "((1, 1, 1), (1, 1))"  # whole on both ranks
    assert strategies["q_up"] == strategies["kv_up"] == "((1, 1, 1), (2, 1))"  # the heads split
    assert strategies["o"] == "((1, 1, 2), (1, 2))" and "gate" in strategies  # the shared expert, as a dense MLP
    attention = [n for n in plan.planner._layers[("layer", 2, 1, 1, True)].graph.nodes if n.kind == "attention"][0]
    assert attention.shapes[0][-1] == 192 and attention.shapes[2][-1] == 128 and attention.out_shape[-1] == 128
    # the dense first layers averaged in: 3 of 61 layers with an MLP of 18,432 and no experts
    moe_only = plan.planner._with_experts(plan.planner._layers[("layer", 2, 1, 1, True)], 1, 1, True, 64)
    assert layer.expert_param_count == pytest.approx(moe_only.expert_param_count * 58 / 61)
    assert plan.to_dict()["configuration"]["moe_dispatcher"] == "deepep"


def test_a_latent_or_windowed_shape_that_cannot_hold_is_one_line():
    for kwargs, message in (({"family": "llama", "q_lora_rank": 64}, "give kv_lora_rank too"),
                            ({"family": "gpt", "kv_lora_rank": 64}, "latent attention is planned on the Llama"),
                            ({"family": "llama", "kv_lora_rank": 64, "kv_heads": 2}, "kv_heads must be 4"),
                            ({"family": "llama", "sliding_layers": 1}, "give sliding_window too"),
                            ({"family": "llama", "sliding_window": 8, "sliding_layers": 3}, "more than the 2 layers"),
                            ({"family": "llama", "experts": 4, "dense_layers": 2}, "leaves none of the 2 layers"),
                            ({"family": "llama", "shared_expert_ffn": 64}, "give experts too")):
        with pytest.raises(ConfigError, match=message):
            GPTConfig(2, 256, 4, **kwargs)
