"""Planning for clusters you do not have: machine files, hierarchical collectives, a GPT on the meta device, and the
data x tensor x pipeline x ZeRO search (all on fixed figures, deterministic, no job)."""
import dataclasses
import json
import math
import re
import resource
import subprocess
import sys
import time

import pytest
import torch

from autopar.cli.main import main as cli
from autopar.errors import ConfigError
from autopar.planner.cluster import load_cluster, parse_cluster, plan_gpt, presets
from autopar.planner.cluster.layers import LayerPlanner
from autopar.planner.cluster.search import FP8_NOT_RUN, TP_OVERLAP_NOT_RUN, context_options
from autopar.planner.gpt import GPT, PRESETS, GPTConfig, GPTLayer, LlamaLayer, make_layer
from autopar.planner.graph import capture

A100 = load_cluster("a100-ib")


def machine_dict():
    return json.loads((load_cluster.__globals__["resources"].files("autopar.planner")
                       .joinpath("machines", "a100-ib.json").read_text()))


# ------------------------------------------------------------------------------------------------ machine files
def test_presets_load_and_every_figure_has_a_source():
    assert {"a100-ib", "h100-ib"} <= set(presets())
    for name in presets():
        spec = load_cluster(name)
        assert spec.devices_per_node == 8 and spec.peak("bf16") > 1e14
        sources = json.loads((load_cluster.__globals__["resources"].files("autopar.planner")
                              .joinpath("machines", name + ".json").read_text()))["sources"]
        for field in ("device.flops", "device.memory_bytes", "device.memory_bandwidth", "intra_node.bandwidth",
                      "inter_node.nic_bandwidth", "inter_node.nics_per_node", "device.matmul_efficiency"):
            assert sources.get(field), f"{name}: no source for {field}"


@pytest.mark.parametrize("path, value, message", [
    ("device.memory_bytes", None, "missing field 'device.memory_bytes'"),
    ("inter_node.nic_bandwidth", -25e9, "field 'inter_node.nic_bandwidth' must be a positive number, got -2"),
    ("devices_per_node", 0, "field 'devices_per_node' must be a positive number"),
    ("devices_per_node", 7.5, "field 'devices_per_node' must be a whole number"),
    ("device.flops", {"bf16": "fast"}, "field 'device.flops.bf16' must be a positive number"),
    ("intra_node.efficiency", 1.5, "field 'intra_node.efficiency' is a fraction of peak and must be <= 1"),
])
def test_bad_machine_field_is_named(path, value, message):
    data = machine_dict()
    node, *_ = data, None
    parts = path.split(".")
    for part in parts[:-1]:
        node = node[part]
    if value is None:
        del node[parts[-1]]
    else:
        node[parts[-1]] = value
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_cluster(data, "cluster.json")


def test_machine_file_errors_are_one_line_on_the_command_line(tmp_path, capsys):
    bad = tmp_path / "cluster.json"
    data = machine_dict()
    del data["inter_node"]["latency"]
    bad.write_text(json.dumps(data))
    assert cli(["plan", "gpt", "--size", "1.3b", "-n", "8", "--machine", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"autopar: error: {bad}: missing field 'inter_node.latency'"
    (tmp_path / "broken.json").write_text("{ not json")
    assert cli(["plan", "gpt", "--size", "1.3b", "-n", "8", "--machine", str(tmp_path / "broken.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert cli(["plan", "gpt", "--size", "1.3b", "-n", "8", "--machine", "a100-nvl"]) == 2
    assert "unknown machine 'a100-nvl'" in capsys.readouterr().err


def test_a_machine_file_of_another_version_loads_and_names_what_it_ignores():
    """A field this version does not know (one dropped since the file was written, or misspelt) is named in one
    warning; the file still loads with what it does know."""
    data = machine_dict()
    data["device"]["matmul_eficiency"] = 0.7  # misspelt
    data["inter_node"]["sharp"] = True
    with pytest.warns(UserWarning) as got:
        spec = parse_cluster(data, "cluster.json")
    assert spec.matmul_efficiency == A100.matmul_efficiency
    said = [str(w.message) for w in got]
    assert len(said) == 1 and said[0].startswith("autopar: cluster.json: fields 'device.matmul_eficiency', "
                                                 "'inter_node.sharp' are not known to this version and ignored")
    assert got[0].filename == __file__  # at the caller's line, not the planner's


def test_the_cluster_plan_as_one_json_object(capsys):
    """``autopar plan llama --json``: the published units (step, tokens/s per device, MFU, TFLOP/s with and without
    recomputation, memory per device), the configuration pinned, and the breakdowns; runners-up alike."""
    assert cli(["plan", "llama", "--size", "llama3-8b", "-n", "64", "--machine", "a100-ib", "--global-batch", "512",
                "--tp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("step_s", "tokens_per_s_per_device", "mfu", "model_tflops_per_device", "hardware_tflops_per_device",
                "memory_gib"):
        assert out[key] > 0, key
    c = out["configuration"]
    assert c["tp"] == 2 and c["dp"] * c["cp"] * c["tp"] * c["pp"] == 64 and c["machine"] == "a100-ib"
    assert out["tokens_per_s_per_device"] == pytest.approx(512 * 8192 / out["step_s"] / 64)
    assert out["hardware_tflops_per_device"] >= out["model_tflops_per_device"]
    assert sum(out["breakdown_s"].values()) == pytest.approx(out["step_s"], rel=1e-6)
    assert sum(out["memory_breakdown_gib"].values()) == pytest.approx(out["memory_gib"], rel=1e-6)
    assert out["runners_up"] and all(r["configuration"]["tp"] == 2 for r in out["runners_up"])
    assert cli(["plan", "mlp", "-n", "2", "--json", "--no-calibrate"]) == 2
    assert "--json is the cluster plan's" in capsys.readouterr().err


def test_a_published_configuration_pinned_from_the_command_line(capsys):
    """dgxc-benchmarking's Llama 3.1 70B fp8 (tp 4, pp 4, cp 2, VP5, sequence parallel, micro-batch 1) as a user pins
    it: every pin kept, and the JSON names what autopar's runtime does not run."""
    assert cli(["plan", "llama", "--size", "llama3-70b", "-n", "64", "--machine", "h100-ib", "--global-batch", "128",
                "--tp", "4", "--pp", "4", "--cp", "2", "--vpp", "5", "--sp", "--micro-batch", "1", "--zero", "1",
                "--recompute-layers", "2", "--dtype", "fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    c = out["configuration"]
    assert (c["dp"], c["cp"], c["tp"], c["pp"], c["vpp"], c["sp"]) == (2, 2, 4, 4, 5, True)
    assert (c["micro_batch"], c["zero"], c["recompute"], c["recompute_layers"], c["dtype"]) == (1, 1, "block 2", 2,
                                                                                             "fp8")
    assert out["not_run_by_autopar"] == ["sequence parallelism with context parallelism",
                                         "ZeRO-1 over the context group inside pipeline stages (autopar shards over "
                                         "the 2 data-parallel replicas)", TP_OVERLAP_NOT_RUN, FP8_NOT_RUN]
    # sequence parallelism: weighed unpinned (and taken for this tensor group), off with --no-sp (the sequence
    # whole: a context split would leave it off)
    for flag, want in (([], True), (["--no-sp"], False)):
        assert cli(["plan", "llama", "--size", "llama3-70b", "-n", "64", "--machine", "h100-ib", "--global-batch",
                    "128", "--tp", "4", "--pp", "4", "--cp", "1", "--json", *flag]) == 0
        assert json.loads(capsys.readouterr().out)["configuration"]["sp"] is want, flag
    assert cli(["plan", "mlp", "-n", "2", "--no-sp"]) == 2
    assert "--no-sp pins the cluster plan" in capsys.readouterr().err
    assert cli(["plan", "llama", "--size", "llama3-70b", "-n", "64", "--machine", "h100-ib", "--cp", "3"]) == 2
    assert "--cp 3 needs the sequence (8192) divisible by 2 x cp = 6" in capsys.readouterr().err


@pytest.mark.slow
def test_a_user_machine_file_is_used(tmp_path, capsys):
    data = machine_dict()
    data["name"], data["nodes"] = "my-cluster", 2
    (tmp_path / "mine.json").write_text(json.dumps(data))
    assert cli(["plan", "gpt", "--size", "1.3b", "-n", "16", "--machine", str(tmp_path / "mine.json")]) == 0
    assert "(my-cluster: 8 per node, 2 nodes)" in capsys.readouterr().out
    assert cli(["plan", "gpt", "--size", "1.3b", "-n", "24", "--machine", str(tmp_path / "mine.json")]) == 2
    assert "24 devices need 3 nodes of 8, but machine 'my-cluster' has nodes = 2 (16 devices)" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- hierarchical costs
def test_collectives_inside_a_node_follow_the_ring_formula_in_nccls_faster_protocol():
    """NCCL's ring: LL128 (the links' hop latencies, 120 data bytes a 128-byte line) or Simple (full bandwidth, its
    own base and hop latencies from tuning.cc), whichever is faster at the size."""
    from autopar.planner.cluster.collectives import NCCL_BASE_LATENCY, NCCL_SIMPLE_HOP

    n, bus = 8, A100.intra.bandwidth * A100.intra.efficiency
    for s in (1e3, 1e9):
        t, algo = A100.collective("all_reduce", s, n, 1)
        ll128 = NCCL_BASE_LATENCY["LL128"] + 2 * (n - 1) * A100.intra.latency + 2 * (n - 1) / n * s / bus * 128 / 120
        simple = NCCL_BASE_LATENCY["Simple"] + 2 * (n - 1) * NCCL_SIMPLE_HOP["intra"] + 2 * (n - 1) / n * s / bus
        assert algo == "ring" and t == pytest.approx(min(ll128, simple))
    assert A100.collective("all_reduce", 1e3, n, 1)[0] < NCCL_BASE_LATENCY["Simple"] + 14 * NCCL_SIMPLE_HOP["intra"]
    assert A100.collective("all_reduce", 1e9, n, 1)[0] < 2 * 7 / 8 * 1e9 / bus * 128 / 120  # big: Simple's bandwidth
    ag, _ = A100.collective("all_gather", 1e9, n, 1)
    assert ag == pytest.approx(A100.collective("all_reduce", 1e9, n, 1)[0] / 2, rel=2e-3)  # half the bytes and hops


def test_collectives_across_nodes_are_bound_by_the_network_and_pick_tree_or_ring():
    inside, _ = A100.collective("all_reduce", 1e9, 8, 1)
    across, _ = A100.collective("all_reduce", 1e9, 8, 8)  # one member per node: one NIC each
    assert across > 5 * inside
    nic = A100.inter.bandwidth * A100.inter.efficiency
    assert across == pytest.approx(2 * 7 / 8 * 1e9 / nic, rel=0.01)
    # 4 members per node share the node's network on their own NICs: 4x the bandwidth of one
    four, _ = A100.collective("all_reduce", 1e9, 32, 2)
    assert four == pytest.approx(2 * 31 / 32 * 1e9 / (4 * nic), rel=0.05)
    small_many, algo = A100.collective("all_reduce", 1e4, 1024, 1)
    assert algo == "tree"  # latency-bound across 128 nodes: log2 hops instead of a ring's 2 x 128
    assert A100.collective("all_reduce", 1e10, 16, 1)[1] == "ring"
    assert A100.collective("all_reduce", 1e9, 1, 1) == (0.0, "none")


def test_a_gemm_pays_for_its_partial_tiles_and_waves():
    """Tile and wave quantization (NVIDIA's Matrix Multiplication Background User's Guide): 132 tiles of 256 x 128
    fill an H100's 132 SMs exactly; 12 tiles more need a second wave -- the kernel then takes 128 x 128 tiles, 288 of
    them in 3 waves; without an SM count every shape runs at the measured ceiling."""
    h100 = load_cluster("h100-ib")
    assert h100.sms == 132 and h100.gemm_efficiency(1, 3072, 1408) == 1.0
    assert h100.gemm_efficiency(1, 3072, 1536) == pytest.approx(288 / 396)
    assert h100.gemm_efficiency(8, 3072, 1408) == 1.0  # a batch of GEMMs fills the waves together
    assert dataclasses.replace(h100, sms=None).gemm_efficiency(1, 3072, 1536) == 1.0
    # a GEMM's time: forward and both gradients, each at its own output shape's rate
    machine = h100.group_machine(1, 1, "bf16")
    rate = h100.peak("bf16") * h100.matmul_efficiency
    assert machine.gemm_seconds(1, 3072, 1536, 4096) == pytest.approx(2 * 3072 * 1536 * 4096 / (rate * 288 / 396))


def test_fp8_runs_the_projections_at_the_fp8_rate_and_the_rest_in_bf16():
    """Transformer Engine's fp8: the Linears' GEMMs at the fp8 ceiling (its own kernel benchmark in the preset),
    attention and everything else as in bf16; a device without fp8 says so in one line."""
    h100 = load_cluster("h100-ib")
    fp8, bf16 = h100.group_machine(4, 1, "fp8"), h100.group_machine(4, 1, "bf16")
    assert fp8.flops["matmul"] == pytest.approx(h100.peak("fp8") * h100.matmul_efficiency_fp8)
    assert fp8.flops["attention"] == bf16.flops["attention"]
    one, eight = LayerPlanner(PRESETS["llama3-8b"], h100, "bf16").layer(1, 1), LayerPlanner(PRESETS["llama3-8b"], h100,
                                                                                        "fp8").layer(1, 1)
    by_name = lambda plan: {r[0]: r[5] for r in plan.rows()}  # noqa: E731
    assert by_name(eight)["gate"] < 0.6 * by_name(one)["gate"]
    assert by_name(eight)["attention.fused"] == pytest.approx(by_name(one)["attention.fused"])
    assert eight.activation_bytes == one.activation_bytes
    with pytest.raises(ConfigError, match="machine 'a100-ib' gives no FLOP/s for dtype 'fp8'"):
        plan_gpt(PRESETS["1.3b"], A100, 8, 64, "fp8")


# ----------------------------------------------------------------------------------------------- GPT on meta
def test_gpt_parameter_count_matches_megatron_formula():
    for cfg in (c for c in PRESETS.values() if not c.llama):
        l, h, v, s = cfg.layers, cfg.hidden, cfg.vocab, cfg.seq
        # the formula leaves out the final layer norm (2h)
        assert cfg.parameters - 2 * h == pytest.approx(12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h)))
    with torch.device("meta"):
        model = GPT(GPTConfig(2, 64, 4, seq=16, vocab=100))
    assert sum(p.numel() for p in model.parameters()) == GPTConfig(2, 64, 4, seq=16, vocab=100).parameters


def test_gpt_runs_for_real_and_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(GPTConfig(2, 32, 4, seq=8, vocab=50))
    tokens = torch.randint(0, 50, (2, 8))
    out = model(tokens)
    assert out.shape == (2, 8, 50)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 50
    assert torch.allclose(model(changed)[:, :-1], out[:, :-1], atol=1e-6)  # the future does not leak back


def test_attention_matmuls_and_softmax_are_graph_nodes_with_head_splits_followed_through_views():
    with torch.device("meta"):
        layer = GPTLayer(256, 4, 1024, fused=False)
        graph = capture(layer, None, (torch.empty(2, 16, 256),))
    assert [(n.name, n.kind) for n in graph.nodes] == [
        ("qkv", "linear"), ("attention.scores", "matmul"), ("attention.softmax", "softmax"),
        ("attention.context", "matmul"), ("proj", "linear"), ("fc1", "linear"), ("fc2", "linear")]
    # qkv [b, s, 3h] -> [b, s, heads, 3d] -> q [b, heads, s, d]: the heads continue qkv's output dimension
    assert graph.edge_dims[(0, 1, 0)] == (0, 2, 1, None)
    assert graph.edge_dims[(3, 4, 0)] == (0, 2, 1)  # context [b, heads, s, d] -> [b, s, h]


def test_llama_shape_counts_flops_and_attends_by_key_value_group():
    """Llama 3 8B's published parameter count, the GPT FLOPs formula unchanged, and grouped-query attention as graph
    nodes whose split of the projections continues into the key/value groups (so tensor parallelism <= kv heads)."""
    assert PRESETS["llama3-8b"].parameters == 8_030_261_248  # Meta's model card: 8.03B
    with torch.device("meta"):
        model = GPT(PRESETS["llama3-8b"])
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    gpt = PRESETS["1.3b"]
    b, s, l, h, v = 8, gpt.seq, gpt.layers, gpt.hidden, gpt.vocab
    assert gpt.model_flops(b) == pytest.approx(72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)))
    assert gpt.model_flops(b, True) == pytest.approx(96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)))
    with torch.device("meta"):
        graph = capture(LlamaLayer(256, 8, 2, 512, fused=False), None, (torch.empty(2, 16, 256),))
    assert [(n.name, n.kind) for n in graph.nodes] == [
        ("q", "linear"), ("kv", "linear"), ("attention.scores", "matmul"), ("attention.softmax", "softmax"),
        ("attention.context", "matmul"), ("o", "linear"), ("gate", "linear"), ("up", "linear"), ("down", "linear")]
    assert graph.nodes[2].shapes[0] == (2, 2, 4 * 16, 32)  # queries [b, kv groups, group x s, d]
    assert graph.edge_dims[(0, 2, 0)][1] == 2  # the groups continue q's output dimension
    torch.manual_seed(0)
    tiny = GPT(GPTConfig(2, 32, 4, seq=8, vocab=50, ffn=48, kv_heads=2, family="llama"))
    tokens = torch.randint(0, 50, (2, 8))
    out = tiny(tokens)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 50
    assert torch.allclose(tiny(changed)[:, :-1], out[:, :-1], atol=1e-6)  # causal across the query groups too
    with pytest.raises(ConfigError, match="kv_heads must be a positive divisor of the 32 heads, got 5"):
        GPTConfig(2, 4096, 32, kv_heads=5, family="llama")


@pytest.mark.parametrize("family, heads, kv", [("gpt", 4, 0), ("llama", 4, 2)])
def test_fused_attention_is_the_materialized_attention_exactly(family, heads, kv):
    """The fused operator (SDPA, causal) against the two batched matmuls and the masked softmax, in float64: the
    same outputs and gradients, for multi-head and for grouped-query attention (query groups stacked on the rows)."""
    torch.manual_seed(0)
    cfg = GPTConfig(2, 32, heads, seq=8, vocab=50, ffn=48, kv_heads=kv, family=family)
    fused = GPT(cfg).double()
    materialized = GPT(dataclasses.replace(cfg, attention="materialized")).double()
    materialized.load_state_dict(fused.state_dict())
    tokens = torch.randint(0, 50, (3, 8))
    outs = [m(tokens) for m in (fused, materialized)]
    for out in outs:
        out.square().mean().backward()
    assert (outs[0] - outs[1]).abs().max() < 1e-12
    for (name, p), q in zip(fused.named_parameters(), materialized.parameters()):
        assert (p.grad - q.grad).abs().max() < 1e-12, name
    with torch.device("meta"):
        graph = capture(make_layer(cfg), None, (torch.empty(2, 8, 32),))
    node = next(n for n in graph.nodes if n.kind == "attention")
    g = heads // (kv or heads)
    assert node.name == "attention.fused" and node.flops == 2.0 * 2 * (kv or heads) * g * 8 * 8 * (32 // heads)


def test_llama3_8b_fsdp_at_sequence_8192_fits_with_fused_attention_and_not_with_the_scores_stored():
    """FSDP (ZeRO-3, no tensor or pipeline split) at sequence 8192 on 64 A100s without recomputation: the s x s
    scores of 32 heads (4 GiB a layer in bf16) fit nowhere; the fused kernel keeps q, k, v, its output and one
    log-sum-exp per row, and the plan fits."""
    pin = {"tp": 1, "pp": 1, "cp": 1, "zero": 3, "micro_batch": 1, "recompute": False}
    with pytest.raises(ConfigError, match="materialized attention fits nowhere on 64 x A100") as info:
        plan_gpt(dataclasses.replace(PRESETS["llama3-8b"], attention="materialized"), A100, 64, 64, fixed=pin)
    # and the line says what would make it fit: selective recomputation (the scores dropped and recomputed), or the
    # fused kernel -- which keep the same activations but for the fused kernel's log-sum-exp
    said = str(info.value)
    selective = re.search(r"; without --recompute off it fits \(dp 64 x tp 1 x pp 1, micro-batch 1, ZeRO 3, "
                          r"recompute selective: ([\d.]+) GiB\)", said)
    fused = re.search(r"; with --attention fused it fits \(dp 64 x tp 1 x pp 1, micro-batch 1, ZeRO 3, recompute "
                      r"off: ([\d.]+) GiB\)", said)
    assert selective and fused and abs(float(selective[1]) - float(fused[1])) < 0.5, said
    plan = plan_gpt(PRESETS["llama3-8b"], A100, 64, 64, fixed=pin)
    assert plan.best.memory <= plan.memory_limit
    scores = 32 * 8192 * 8192 * 2 * PRESETS["llama3-8b"].layers  # what the materialized plan would keep
    layers = plan.best.memory_parts["activations"] - plan.planner.head(1, 1).activation_bytes  # the loss's aside
    assert layers < scores / 3


def test_selective_recomputation_drops_the_stored_scores_and_recomputes_the_attention_core():
    """GPT-3 175B on 64 A100s as Korthikanti et al. 2022 ran it (tp 8 with sequence parallelism, pp 8, micro-batch
    1), scores stored: without recomputation it does not fit 72 GiB (the search's 90 % of the device; it needs all
    but the last 0.4 GiB of the 80, a plan it calls tight); selective recomputation (the scores and softmax dropped, the attention core's
    forward run again) fits and is faster than full recomputation; its hardware FLOPs count the core once more."""
    cfg = GPTConfig(96, 12288, 96, attention="materialized")
    pin = {"tp": 8, "pp": 8, "micro_batch": 1, "zero": 0, "sp": True}
    with pytest.raises(ConfigError, match="recompute off.* needs .*; without --recompute off it fits .*recompute "
                                          "selective"):
        plan_gpt(cfg, A100, 64, 64, fixed={**pin, "recompute": False}, memory_limit=72 * 2**30)
    assert plan_gpt(cfg, A100, 64, 64, fixed={**pin, "recompute": False}).tight
    sel = plan_gpt(cfg, A100, 64, 64, fixed={**pin, "recompute": "selective"})
    full = plan_gpt(cfg, A100, 64, 64, fixed={**pin, "recompute": True})
    assert sel.best.recompute_name == "selective" and sel.best.memory <= sel.memory_limit
    assert sel.best.step < full.best.step and sel.best.memory > full.best.memory
    layer = sel.planner.layer(8, 1)
    assert layer.core_activation_bytes == 2 * 12 * 2048 * 2048 * 2  # scores and softmax: 12 heads a rank, bf16
    s, h, b = 2048, 12288, 64
    extra = cfg.model_flops(b, "selective") - cfg.model_flops(b)
    assert extra == pytest.approx(b * s * 96 * 4 * s * h)
    assert sel.to_dict()["configuration"]["recompute"] == "selective"
    # the free search weighs it too; with fused attention it is Megatron-Core's --recompute-modules core_attn: the
    # fused kernel's forward runs again in the backward, its log-sum-exp not kept (its output is: the projection
    # after it keeps it as its input)
    assert any(c.recompute == "selective" for c in plan_gpt(cfg, A100, 64, 64, fixed=pin).ranked)
    fused = dataclasses.replace(cfg, attention="fused")
    one = plan_gpt(fused, A100, 64, 64, fixed={**pin, "recompute": "selective"})
    off = plan_gpt(fused, A100, 64, 64, fixed={**pin, "recompute": False}).best
    assert one.best.step > off.step and one.best.memory < off.memory
    core = one.planner.layer(8, 1, 1, True)
    assert core.core_activation_bytes == 12 * 2048 * 4  # 12 heads a rank, one fp32 log-sum-exp a row
    assert one.tflops_per_device(with_recompute=True) > one.tflops_per_device()


def test_an_input_two_projections_share_is_kept_once():
    """q and kv take one norm's output, gate and up another's: autograd keeps each tensor once. Llama 3 70B's layer
    then keeps 30.5 s b h bytes, against Megatron-LM's (18 + 4 ffn/h) s b h = 32 (theoretical_memory_usage.py), not
    34.5 as when every projection counted its own copy."""
    cfg = PRESETS["llama3-70b"]
    layer = LayerPlanner(cfg, load_cluster("h100-ib"), "bf16").layer(1, 1)
    nodes = {n.name: n for n in layer.graph.nodes}
    assert nodes["kv"].same_input == {0: (nodes["q"].index, 0)}
    assert nodes["up"].same_input == {0: (nodes["gate"].index, 0)}
    assert not nodes["q"].same_input and not nodes["o"].same_input
    per_token = layer.activation_bytes / (cfg.seq * cfg.hidden)
    assert per_token == pytest.approx(30.53, abs=0.01)
    assert per_token == pytest.approx(18 + 4 * cfg.ffn_size / cfg.hidden, rel=0.1)


def test_block_recomputation_recomputes_the_fewest_layers_that_fit():
    """Megatron-LM's --recompute-method block: n layers of a device recompute their forward whole, the rest keep their
    activations. Llama 3 70B on 64 H100s (tp 4, pp 8, VP5, micro-batch 2): without recomputation a stage is too big;
    the search recomputes the fewest layers that fit, cheaper than recomputing all ten."""
    h100 = load_cluster("h100-ib")
    pin = {"tp": 4, "pp": 8, "vpp": 5, "micro_batch": 2, "zero": 1, "sp": True}
    cfg = PRESETS["llama3-70b"]
    with pytest.raises(ConfigError, match="fits nowhere"):
        plan_gpt(cfg, h100, 64, 128, fixed={**pin, "recompute": False})
    plan = plan_gpt(cfg, h100, 64, 128, fixed=pin)
    k, limit = plan.best, plan.memory_limit
    assert k.recompute == "block" and 1 <= k.recompute_layers < 10 and k.memory <= limit
    fewer = plan_gpt(cfg, h100, 64, 128, fixed={**pin, "recompute_layers": k.recompute_layers - 1},
                     memory_limit=10 * limit).best
    assert fewer.memory > limit  # one layer fewer would not fit
    full = plan_gpt(cfg, h100, 64, 128, fixed={**pin, "recompute": True}).best
    assert k.step < full.step and k.memory > full.memory
    assert f"activation recomputation: block ({k.recompute_layers} of a device's 10 layers" in plan.explain()
    assert plan.to_dict()["configuration"]["recompute_layers"] == k.recompute_layers
    # its hardware FLOPs count the recomputed share of the forward passes
    extra = plan.tflops_per_device(with_recompute=True) / plan.tflops_per_device() - 1
    assert extra == pytest.approx(k.recompute_layers / 10 / 3, rel=0.05)
    with pytest.raises(ConfigError, match="--recompute-layers 3 .* is --recompute block, not --recompute full"):
        plan_gpt(cfg, h100, 64, 128, fixed={**pin, "recompute": True, "recompute_layers": 3})
    with pytest.raises(ConfigError, match="--recompute-layers must be a positive number"):
        plan_gpt(cfg, h100, 64, 128, fixed={**pin, "recompute_layers": 0})


def test_interleaved_1f1b_shrinks_the_bubble_by_its_virtual_stages_for_more_messages_and_memory():
    """NeMo's GPT-3 175B on 1,024 H100s (tp 4 with sequence parallelism, pp 8, VP12, micro-batch 1): 12 chunks of one layer a device cut the
    bubble from (p-1)/(m+p-1) to (p-1)/(v m+p-1), send v times the point-to-point messages and keep Megatron-LM's
    interleaved_schedule_memory_penalty, 1 + (p-1)/(p v), more micro-batches in flight."""
    h100 = load_cluster("h100-ib")
    pin = {"tp": 4, "sp": True, "pp": 8, "micro_batch": 1, "recompute": False, "zero": 1}
    plain = plan_gpt(PRESETS["175b"], h100, 1024, 2048, fixed={**pin, "vpp": 1}).best
    inter = plan_gpt(PRESETS["175b"], h100, 1024, 2048, fixed={**pin, "vpp": 12}).best
    m, p = 64, 8
    assert plain.m == inter.m == m and inter.v == 12 and inter.mesh() == "dp 32 x tp 4 (sp) x pp 8 (vpp 12)"
    assert plain.bubble == pytest.approx((p - 1) / (m + p - 1)) and inter.bubble == pytest.approx((p - 1) / (12 * m + p - 1))
    assert inter.step < plain.step and inter.memory > plain.memory
    acts = inter.memory_parts["activations"] / plain.memory_parts["activations"]
    assert acts == pytest.approx(math.ceil((1 + (p - 1) / (p * 12)) * p) / p, rel=0.02)
    # the free search weighs it; a degree the layers or micro-batches do not allow is one line
    assert any(c.v > 1 for c in plan_gpt(PRESETS["175b"], h100, 1024, 2048, fixed=pin).ranked)
    with pytest.raises(ConfigError, match="interleaving \\(vpp\\) needs the micro-batches divisible by pp and at least "
                       "pp x vpp layers"):
        plan_gpt(PRESETS["175b"], h100, 1024, 2048, fixed={**pin, "vpp": 13})
    with pytest.raises(ConfigError, match="--vpp must be a positive number"):
        plan_gpt(PRESETS["175b"], h100, 1024, 2048, fixed={**pin, "vpp": 0})


def test_interleaving_pinned_over_layers_that_do_not_divide_takes_uneven_chunks():
    """126 layers (Llama 3 405B's) over 16 stages: plain 1F1B puts 7-8 layers a stage; 2 virtual stages make chunks of
    3-4 layers, and the warm-up waits on the longest chunk, not on half a stage."""
    h100 = load_cluster("h100-ib")
    cfg = GPTConfig(126, 2048, 16, family="llama", kv_heads=8)
    pin = {"tp": 8, "pp": 16, "micro_batch": 1, "recompute": False, "zero": 1}
    plain = plan_gpt(cfg, h100, 256, 64, fixed={**pin, "vpp": 1})
    inter = plan_gpt(cfg, h100, 256, 64, fixed={**pin, "vpp": 2})
    assert "16 stage(s) of 7-8 layers, interleaved 1F1B (2 chunks of 3-4 layers a device)" in inter.explain()
    k, c = inter.best, plain.best
    micro = c.parts["pipeline"] / (c.m + c.p - 1)  # plain 1F1B: (m + p - 1) x (a stage's micro-batch + its messages)
    assert k.parts["pipeline"] < c.parts["pipeline"]
    # the warm-up and drain: (p - 1) chunks of 4 layers of a stage of 8, plus the point-to-point messages
    assert k.parts["pipeline"] == pytest.approx(k.m * micro + (k.p - 1) * micro * 4 / 8, rel=0.02)


def test_the_embedding_and_the_loss_take_a_layers_place_in_the_pipeline_split_where_pinned(capsys):
    """BLOOM's 70 layers over 72 stages (DeepSpeed's --pp-partition-method 'type:transformer|embedding') and a
    30-layer Llama over 4 stages x 8 virtual ones (Megatron-LM's account-for-embedding/loss flags) plan only when
    the embedding and the loss count as layers: the first and last stages hold a layer fewer, and the slowest
    stage -- here the head's -- sets the pace; where both splits exist the totals agree on the layers."""
    a100, h100 = load_cluster("a100-ib"), load_cluster("h100-ib")
    bloom = GPTConfig(70, 14336, 112, vocab=250880, attention="materialized")
    pin = {"tp": 1, "pp": 72, "micro_batch": 1, "zero": 1, "recompute": True, "vpp": 1}
    with pytest.raises(ConfigError, match="with --split-embedding-and-loss the embedding and the loss count as two"):
        plan_gpt(bloom, a100, 288, 2048, fixed=pin)
    plan = plan_gpt(bloom, a100, 288, 2048, fixed={**pin, "split_embedding": True})
    best = plan.best
    assert best.split_embedding and best.stage_layers(70) == (0, 1, 0)
    assert "the embedding and the loss each in a layer's place" in plan.explain()
    assert plan.to_dict()["configuration"]["split_embedding"] is True
    head, layer = plan.planner.head(1, 1, 1, False), plan.planner.layer(1, 1, 1, False)
    assert head.time > layer.time + layer.forward  # the head's stage is the slowest: it sets the pace
    proxy = GPTConfig(30, 16384, 128, seq=8192, vocab=128256, ffn=53248, kv_heads=8, family="llama")
    fixed = {"tp": 8, "pp": 4, "cp": 2, "micro_batch": 1, "vpp": 8, "sp": True}
    with pytest.raises(ConfigError):
        plan_gpt(proxy, h100, 64, 64, fixed=fixed)
    split = plan_gpt(proxy, h100, 64, 64, fixed={**fixed, "split_embedding": True}).best
    assert split.v == 8 and split.stage_layers(30) == (7, 8, 7)
    layers = sum(split.stage_layers(30)) + 8 * (split.p - 3)  # the first, the last and p - 2 middle stages
    assert layers == 30
    # the command line's spelling, and a 1-stage plan ignores it (nothing to split)
    assert cli(["plan", "llama", "--layers", "30", "--hidden", "16384", "--heads", "128", "--kv-heads", "8",
                "--ffn", "53248", "--vocab", "128256", "--seq", "8192", "-n", "64", "--machine", "h100-ib",
                "--global-batch", "64", "--tp", "8", "--pp", "4", "--cp", "2", "--vpp", "8", "--sp",
                "--micro-batch", "1", "--split-embedding-and-loss", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["configuration"]["split_embedding"] is True and out["configuration"]["vpp"] == 8
    one = plan_gpt(proxy, h100, 64, 64, fixed={"tp": 8, "pp": 1, "cp": 2, "split_embedding": True}).best
    assert not one.split_embedding and one.stage_layers(30) == (30, 0, 30)


def test_zero_inside_pipeline_stages_is_planned_where_pinned_and_said():
    """torchtitan runs FSDP inside pipeline stages; the search keeps pipelines to ZeRO 0/1 (Megatron's distributed
    optimizer), a pin plans the others, and the plan says what autopar's runtime does not run: ZeRO inside the
    stages it runs (over each stage's replicas), with tensor parallelism there too, not yet ZeRO over smaller
    groups."""
    h100 = load_cluster("h100-ib")
    pin = {"tp": 8, "pp": 4, "micro_batch": 1, "recompute": True}
    searched = plan_gpt(PRESETS["llama3-70b"], h100, 128, 64, fixed=pin)
    assert {c.zero for c in searched.ranked} <= {0, 1}
    three = plan_gpt(PRESETS["llama3-70b"], h100, 128, 64, fixed={**pin, "zero": 3})
    assert three.best.zero == 3
    assert three.to_dict()["not_run_by_autopar"] == ([TP_OVERLAP_NOT_RUN] if three.best.t > 1 else [])
    alone = plan_gpt(PRESETS["llama3-8b"], h100, 128, 64, fixed={**pin, "tp": 1, "zero": 1})
    assert alone.best.zero == 1 and alone.to_dict()["not_run_by_autopar"] == [], alone.to_dict()["not_run_by_autopar"]
    grouped = plan_gpt(PRESETS["llama3-8b"], h100, 128, 64, fixed={**pin, "tp": 1, "zero": 1, "zero_shard": 2})
    assert grouped.to_dict()["not_run_by_autopar"] == ["ZeRO-1 over shard groups of 2 inside pipeline stages"]


def test_fsdp_inside_pipeline_stages_keeps_the_stage_whole_for_the_step_as_torchtitan_runs_it():
    """Under pipelines torchtitan does not reshard after the forward and torch's schedules turn gradient sync off
    until the last backward: a stage's weights stay whole in bf16 and its gradients whole in fp32 for the step, beside
    the shards (16 bytes a parameter over the replicas) -- more than Megatron's distributed optimizer keeps -- and
    each layer is gathered and scattered once a step, not once a micro-batch."""
    h100 = load_cluster("h100-ib")
    cfg = PRESETS["llama3-70b"]
    pin = {"tp": 8, "pp": 4, "micro_batch": 1, "recompute": True}
    three = plan_gpt(cfg, h100, 128, 64, fixed={**pin, "zero": 3})
    one = plan_gpt(cfg, h100, 128, 64, fixed={**pin, "zero": 1})
    c = three.best
    layer = three.planner.layer(8, 1)
    stage = cfg.layers // 4 * layer.param_count + cfg.vocab * cfg.hidden / 8  # 20 layers and the embedding's slice
    assert c.memory_parts["weights+grads+optimizer"] == pytest.approx(stage * (16 / 4 + 2 + 4), rel=0.01)
    assert c.memory_parts["weights+grads+optimizer"] > one.best.memory_parts["weights+grads+optimizer"]
    # once a step: as many micro-batches again, the same collectives (a plain ZeRO-3 pays them a micro-batch)
    more = plan_gpt(cfg, h100, 128, 128, fixed={**pin, "zero": 3}).best
    assert more.parts["data-parallel sync"] == pytest.approx(c.parts["data-parallel sync"], rel=0.01)
    flat = {"tp": 8, "pp": 1, "micro_batch": 1, "recompute": True, "zero": 3}
    assert plan_gpt(cfg, h100, 128, 128, fixed=flat).best.parts["data-parallel sync"] > 1.5 * plan_gpt(
        cfg, h100, 128, 64, fixed=flat).best.parts["data-parallel sync"]


def test_a_pinned_run_above_the_search_headroom_but_within_the_device_is_planned_and_called_tight():
    """NVIDIA ran Llama 3.1 8B with context parallelism 2 on 8 H100s without recomputation (dgxc-benchmarking): 77.5
    GiB by Megatron's own memory formula -- above the 90 % the search keeps free, within the 80 GiB device. Pinned, it
    is planned and said to be tight; an explicit --memory-limit stays a limit."""
    h100 = load_cluster("h100-ib")
    pin = {"tp": 1, "pp": 1, "cp": 2, "micro_batch": 1, "zero": 1, "recompute": False}
    plan = plan_gpt(PRESETS["llama3-8b"], h100, 8, 128, fixed=pin)
    assert plan.tight and plan.memory_limit < plan.best.memory <= h100.memory
    assert "may not run" in plan.explain() and plan.to_dict()["memory_tight"] is True
    assert not plan_gpt(PRESETS["llama3-8b"], h100, 8, 128).tight  # the free search finds room
    with pytest.raises(ConfigError, match="fits nowhere"):
        plan_gpt(PRESETS["llama3-8b"], h100, 8, 128, memory_limit=72 * 2**30, fixed=pin)


def test_stages_over_layers_that_do_not_divide_make_the_first_and_last_a_layer_lighter():
    """126 layers over 16 stages as Llama 3 split them: 7, fourteen stages of 8, 7 -- the first stage, which holds
    the most micro-batches in flight, a layer lighter. Against 128 layers (8 a stage): the largest stage holds 8
    layers without the embedding (18 bytes a parameter under Megatron's data parallelism), the step is the same, and
    the activations are the second stage's 15 micro-batches of 8 layers instead of the first's 16."""
    h100 = load_cluster("h100-ib")
    pin = {"tp": 1, "pp": 16, "vpp": 1, "micro_batch": 1, "zero": 0, "recompute": False}
    plans = {n: plan_gpt(GPTConfig(n, 1024, 8, seq=1024, vocab=1024), h100, 16, 64, fixed=pin).best for n in (126, 128)}
    uneven, even = plans[126], plans[128]
    embedding = 2 * 1024 * 1024 * 18  # tokens and positions, on the 128-layer model's first stage
    assert uneven.memory_parts["weights+grads+optimizer"] == pytest.approx(
        even.memory_parts["weights+grads+optimizer"] - embedding)
    assert uneven.parts["pipeline"] == pytest.approx(even.parts["pipeline"], rel=0.02)  # (less its embedding)
    assert uneven.memory_parts["activations"] == pytest.approx(even.memory_parts["activations"] * 15 / 16, rel=0.01)


def test_the_loss_peaks_in_fp32_at_the_head():
    """Every stack computes the cross entropy in fp32 (autocast's fp32 list, torchtitan's ``pred.float()``,
    Megatron-core's vocab-parallel upcast); its backward holds the kept probabilities, their gradient and the logits'
    at once, 12 bytes a logit on the device's share of the vocabulary -- Llama 3 8B at sequence 65,536 split over 2
    context-parallel ranks holds 47 GiB there."""
    planner = LayerPlanner(PRESETS["llama3-8b"], load_cluster("h100-ib"), "bf16")
    for t in (1, 8):  # 8: Megatron's layout, the vocabulary split over the tensor group
        head = planner.head(t, 2, sp=t > 1)
        logits, inputs = 2 * 8192 * 128256 / t, 2 * (2 * 8192 * 4096 * 2) / t  # the norm's and the projection's
        assert 12 * logits <= head.activation_bytes <= 12 * logits + inputs + 1024
    long = dataclasses.replace(PRESETS["llama3-8b"], seq=65536)
    assert LayerPlanner(long, load_cluster("h100-ib"), "bf16").head(1, 1, cp=2).activation_bytes / 2**30 > 47


def test_fsdp_on_thousands_of_ranks_pays_a_ring_of_hops_for_every_layer():
    """ZeRO-3 gathers each layer's weights for its forward and backward and scatters its gradients: one collective
    a layer each, whose ring crosses every rank -- 2,048 ranks are ~2,300 hops each time. A small GPT there is
    latency-bound under ZeRO-3 over all of them (hybrid sharding over a node's 8 ranks keeps the rings short); the
    search keeps its weights whole instead."""
    cfg = GPTConfig(24, 1024, 16, seq=1024)
    pin = {"tp": 1, "pp": 1, "micro_batch": 1, "recompute": False}
    three = plan_gpt(cfg, A100, 2048, 2048, fixed={**pin, "zero": 3, "zero_shard": 2048}).best
    hybrid = plan_gpt(cfg, A100, 2048, 2048, fixed={**pin, "zero": 3}).best
    assert hybrid.shard_group == 8 and hybrid.parts["data-parallel sync"] < three.parts["data-parallel sync"]
    one = plan_gpt(cfg, A100, 2048, 2048, fixed={**pin, "zero": 1}).best
    nodes = 2048 // 8
    hops = nodes * A100.inter.latency + (2048 - nodes) * A100.intra.latency  # LL128: the links' own latencies
    assert three.parts["data-parallel sync"] > 3 * cfg.layers * hops
    assert three.step > 5 * one.step
    assert plan_gpt(cfg, A100, 2048, 2048).best.zero < 3


def test_sequence_parallelism_keeps_what_the_tensor_group_held_whole_split_on_the_sequence():
    """Korthikanti et al. 2022 (arXiv 2205.05198, sec. 4.2.2): with tensor parallelism alone a layer keeps
    (10 + 24/t) s b h bytes -- the norms' inputs and the projections' whole inputs and outputs on every device;
    sequence parallelism splits those too, 34/t (no dropout here: 32/t, fused attention: no scores)."""
    h100 = load_cluster("h100-ib")
    planner = LayerPlanner(PRESETS["175b"], h100, "bf16")
    whole = planner.layer(1, 1).activation_bytes
    for t in (2, 4, 8):
        tp, sp = planner.layer(t, 1).activation_bytes, planner.layer(t, 1, sp=True).activation_bytes
        assert sp == pytest.approx(whole / t, rel=0.01) and tp > 1.25 * sp
        # on Megatron's layout, which sequence parallelism is defined on: columns in, rows out
        layouts = {r[0]: r[4] for r in planner.layer(t, 1, sp=True).rows()}
        assert layouts == {"qkv": f"out {t}", "attention.fused": f"out-ch {t}", "proj": f"contract {t}",
                           "fc1": f"out {t}", "fc2": f"contract {t}"}
    # NeMo's GPT-3 175B on 128 H100s (tp 4, pp 8, VP12, micro-batch 1): without sequence parallelism it needs full
    # recomputation to fit; with it, none -- and the step is shorter
    pin = {"tp": 4, "pp": 8, "vpp": 12, "micro_batch": 1, "zero": 1}
    with pytest.raises(ConfigError, match="fits nowhere.*; with --sp it fits \\(dp 4 x tp 4 \\(sp\\) x pp 8 "):
        plan_gpt(PRESETS["175b"], h100, 128, 256, fixed={**pin, "recompute": False, "sp": False})
    tp_only = plan_gpt(PRESETS["175b"], h100, 128, 256, fixed={**pin, "sp": False}).best
    # unpinned, the search weighs it (autopar's runtime runs it with the tensor split) and takes it: no recomputation
    searched = plan_gpt(PRESETS["175b"], h100, 128, 256, fixed={**pin, "recompute": False}).best
    assert searched.sp and searched.recompute is False
    with_sp = plan_gpt(PRESETS["175b"], h100, 128, 256, fixed={**pin, "sp": True})
    assert tp_only.recompute in (True, "block") and with_sp.best.recompute is False
    full = plan_gpt(PRESETS["175b"], h100, 128, 256, fixed={**pin, "recompute": True}).best
    assert with_sp.best.step < 0.85 * full.step
    assert with_sp.best.mesh() == "dp 4 x tp 4 (sp) x pp 8 (vpp 12)"
    assert with_sp.to_dict()["configuration"]["sp"] is True
    assert with_sp.to_dict()["not_run_by_autopar"] == [TP_OVERLAP_NOT_RUN]  # (Megatron's overlap costed)


def test_context_parallelism_splits_the_sequence_and_passes_keys_and_values_round_a_ring():
    """Llama-3-8B at sequence 32,768: each of cp ranks holds 1/cp of every sequence (two mirrored chunks), its
    activations 1/cp; its attention meets every key, so the work is conserved; the key/value ring shows only
    where the network is slower than the attention; the weights' replicas are dp x cp."""
    h100 = load_cluster("h100-ib")
    cfg = dataclasses.replace(PRESETS["llama3-8b"], seq=32768)
    planner = LayerPlanner(cfg, h100, "bf16")
    one, four = planner.layer(1, 1), planner.layer(1, 1, 4)
    assert four.activation_bytes == pytest.approx(one.activation_bytes / 4, rel=0.01)
    # the ring hides behind the attention: it shows only as the attention it slows (collectives.behind)
    assert four.time == pytest.approx(one.time / 4, rel=0.05) and 0.0 < four.context_ring < 0.01 * four.time
    slow = dataclasses.replace(h100, inter=dataclasses.replace(h100.inter, bandwidth=h100.inter.bandwidth / 1000))
    # a ring across nodes (tp 8 fills a node) on a network 1,000x slower shows
    hidden = planner.layer(8, 1, 4)
    assert LayerPlanner(cfg, slow, "bf16").layer(8, 1, 4).context_ring > 100 * hidden.context_ring > 0.0
    plan = plan_gpt(cfg, h100, 64, 16, fixed={"cp": 4, "tp": 2, "pp": 1, "zero": 3, "micro_batch": 1})
    k = plan.best
    assert (k.d, k.cp, k.t) == (8, 4, 2) and k.mesh() == "dp 8 x cp 4 x tp 2 x pp 1"
    assert "context parallelism: ring attention over 4 ranks, 8192 tokens each" in plan.explain()
    # (context parallelism with tensor parallelism runs: tests/parallel/test_context_parallel.py, cp 2 x tp 2)
    assert plan.to_dict()["configuration"]["cp"] == 4 and plan.to_dict()["not_run_by_autopar"] == [TP_OVERLAP_NOT_RUN]
    # ZeRO-3 shards over the 32 replicas, not the 8 data-parallel ones
    assert k.memory_parts["weights+grads+optimizer"] < 16 * cfg.parameters / 16 / 2
    # --cp 1 keeps the sequence whole; sequence parallelism the search weighs: for the tensor group of 8 it ties
    # with the whole sequence on time (within 1 %) and holds 30 % less
    ranked = plan_gpt(cfg, h100, 64, 16, fixed={"tp": 8, "cp": 1}).ranked
    with_sp = next(c for c in ranked if c.sp)
    assert all(c.cp == 1 for c in ranked) and any(not c.sp for c in ranked)
    assert with_sp.step < 1.01 * ranked[0].step and with_sp.memory < 0.75 * ranked[0].memory


def test_the_search_weighs_context_parallelism_for_long_sequences_as_autopar_runs_it():
    """Unpinned, the context split is searched for sequences of 8K tokens and more under fused attention (Megatron
    Core's guidance), each rank keeping 2,048 tokens or more; never beside pinned sequence parallelism nor for a
    materialized attention. What it weighs autopar runs: no sequence parallelism beside it, and inside pipeline
    stages ZeRO over the data-parallel replicas (replicated across the context group), as
    ``PipelineParallel(cp=..., zero=...)`` shards; a pinned ``--cp`` predicting Megatron shards over dp x cp."""
    h100 = load_cluster("h100-ib")
    long = dataclasses.replace(PRESETS["llama3-8b"], seq=32768)
    assert context_options(long, 64, None) == [1, 2, 4, 8, 16]
    assert context_options(PRESETS["llama3-8b"], 64, None) == [1, 2, 4]  # 8,192 tokens
    assert context_options(long, 24, None) == [1, 2, 4, 8]  # the degree divides the devices
    assert context_options(dataclasses.replace(long, seq=4096), 64, None) == [1]
    assert context_options(long, 64, True) == [1]
    assert context_options(dataclasses.replace(long, attention="materialized"), 64, None) == [1]
    plan = plan_gpt(long, h100, 64, 16, fixed={"tp": 2})
    ranked = plan.ranked
    assert {c.cp for c in ranked} == {1, 2, 4, 8, 16}
    assert plan.best.step <= plan_gpt(long, h100, 64, 16, fixed={"tp": 2, "cp": 1}).best.step
    assert not any(c.cp > 1 and c.sp for c in ranked)
    staged = [c for c in ranked if c.p > 1 and c.cp > 1 and c.zero]
    assert staged and all(c.shard_group == c.d for c in staged)
    assert all(c.not_run_by_autopar() == [] for c in ranked)
    megatron = plan_gpt(long, h100, 64, 16, fixed={"tp": 2, "pp": 2, "cp": 2, "zero": 1, "micro_batch": 1})
    assert megatron.best.shard_group == 2 * megatron.best.d
    assert megatron.to_dict()["not_run_by_autopar"] == [
        f"ZeRO-1 over the context group inside pipeline stages (autopar shards over the {megatron.best.d} "
        "data-parallel replicas)", TP_OVERLAP_NOT_RUN]
    # a sequence that fits only split: --cp 1 is the pin to give up, and the error says so
    with pytest.raises(ConfigError, match=r"fits nowhere .*; without --cp 1 it fits \(dp 1 x cp 8 x tp 2 x pp 1"):
        plan_gpt(dataclasses.replace(long, seq=262144), h100, 16, 8,
                 fixed={"cp": 1, "tp": 2, "pp": 1, "zero": 3, "recompute": True})


@pytest.mark.parametrize("pins, message", [
    ({"cp": 3}, "--cp 3 needs the sequence \\(8192\\) divisible by 2 x cp = 6"),
    ({"cp": 2, "attention": "materialized"}, "--cp 2 needs a fused attention"),
    ({"cp": 128}, "--cp 128 does not divide the 64 devices"),
    ({"sp": True, "tp": 1}, "--sp \\(sequence parallelism\\) .* needs --tp 2 or more"),
    ({"cp": 0}, "--cp must be a positive context-parallel degree"),
])
def test_context_and_sequence_parallel_pins_that_cannot_run_are_one_line(pins, message):
    pins = dict(pins)
    cfg = dataclasses.replace(PRESETS["llama3-8b"], attention=pins.pop("attention", "fused"))
    with pytest.raises(ConfigError, match=message):
        plan_gpt(cfg, load_cluster("h100-ib"), 64, 16, fixed=pins)


@pytest.mark.parametrize("pins, message", [
    ({"micro_batch": 0}, "--micro-batch must be a positive whole number, got 0"),
    ({"zero": 4}, "--zero must be 0, 1, 2 or 3, got 4"),
    ({"tp": True}, "--tp must be a positive whole number, got True"),
    ({"recompute": "full"}, "--recompute must be full, selective, block or none, got 'full'"),
])
def test_pins_given_through_the_api_are_checked_as_the_command_line_checks_them(pins, message):
    with pytest.raises(ConfigError, match=message):
        plan_gpt(PRESETS["1.3b"], A100, 8, 64, fixed=pins)


def test_fp8_leaves_the_attention_matmuls_in_bf16_and_selective_on_fused_attention_counts_its_forward():
    h100 = load_cluster("h100-ib")
    cfg = dataclasses.replace(PRESETS["1.3b"], attention="materialized")
    by_name = lambda plan: {r[0]: r[5] for r in plan.rows()}  # noqa: E731
    fp8, bf16 = by_name(LayerPlanner(cfg, h100, "fp8").layer(1, 1)), by_name(LayerPlanner(cfg, h100, "bf16").layer(1, 1))
    assert fp8["attention.scores"] == pytest.approx(bf16["attention.scores"]) and fp8["qkv"] < 0.6 * bf16["qkv"]
    plan = plan_gpt(PRESETS["1.3b"], h100, 8, 64, fixed={"tp": 1, "pp": 1, "recompute": "selective"})
    cfg = PRESETS["1.3b"]  # the fused kernel's forward once more: 4 s h a token and layer
    extra = cfg.model_flops(64, "selective") / cfg.model_flops(64)
    assert plan.tflops_per_device(with_recompute=True) == pytest.approx(extra * plan.tflops_per_device())


def test_a_head_width_other_than_hidden_over_heads_is_planned_as_the_model_has_it(capsys):
    # Qwen3-30B-A3B's attention (Megatron-Bridge's Qwen3MoEModelProvider30B_A3B: hidden 2048, 32 heads of 128,
    # 4 key/value heads): q and o are 2048 x 4096, not 2048 x 2048; a dense SwiGLU of 6144 stands in for its experts
    for family in ("llama", "gpt"):
        cfg = GPTConfig(2, 2048, 32, seq=1024, vocab=1000, ffn=6144, kv_heads=4 if family == "llama" else 0,
                        family=family, head_dim=128)
        with torch.device("meta"):
            model = GPT(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.parameters
        assert cfg.attention_width == 4096 and "32 heads of 128" in cfg.describe()
        # the matmul FLOPs per token as the model's Linears count them, and the attention's 4 s (heads x head_dim)
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert cfg.model_flops(1) == pytest.approx(1024 * (6 * linear + 3 * 2 * 4.0 * 1024 * 4096))
    same = GPTConfig(2, 2048, 16, seq=1024, family="llama", kv_heads=4, head_dim=128)
    assert same.parameters == dataclasses.replace(same, head_dim=0).parameters
    assert same.model_flops(8) == dataclasses.replace(same, head_dim=0).model_flops(8)
    h100 = load_cluster("h100-ib")
    qwen = GPTConfig(4, 2048, 32, seq=4096, vocab=151936, ffn=6144, kv_heads=4, family="llama", head_dim=128)
    layer = LayerPlanner(qwen, h100, "bf16").layer(2, 1)
    shapes = {r[0]: r[2] for r in layer.rows()}
    assert "4096" in shapes["q"] and "4096" in shapes["o"]
    assert layer.param_count == pytest.approx((2 * 2048 * 4096 + 2 * 2048 * 512 + 3 * 2048 * 6144) / 2, rel=1e-3)
    wide = plan_gpt(qwen, h100, 8, 16, fixed={"tp": 2, "pp": 1, "cp": 1})
    narrow = plan_gpt(dataclasses.replace(qwen, head_dim=64), h100, 8, 16, fixed={"tp": 2, "pp": 1, "cp": 1})
    assert wide.best.step > narrow.best.step and wide.best.memory > narrow.best.memory
    with pytest.raises(ConfigError, match="head_dim must be a positive integer"):
        GPTConfig(2, 2048, 32, head_dim=-1)
    assert GPTConfig(2, 2880, 64, head_dim=64).attention_width == 4096  # GPT-OSS: 64 heads of 64 over 2880
    assert GPTConfig(2, 2880, 50, head_dim=64).attention_width == 3200  # heads need not divide the hidden size then
    with pytest.raises(ConfigError, match="not divisible by 50 heads"):
        GPTConfig(2, 2880, 50)
    assert cli(["plan", "llama", "--layers", "2", "--hidden", "2048", "--heads", "32", "--head-dim", "128",
                "--kv-heads", "4", "--seq", "4096", "-n", "8", "--machine", "h100-ib", "--global-batch", "16",
                "--tp", "2", "--pp", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "32 heads of 128" in out["configuration"]["model"]
    assert cli(["plan", "mlp", "-n", "2", "--head-dim", "64", "--no-calibrate"]) == 2
    assert "--head-dim pins the cluster plan" in capsys.readouterr().err


def test_gpt_only_pins_on_another_model_are_one_line(capsys):
    assert cli(["plan", "mlp", "-n", "2", "--tp", "2", "--sp", "--no-calibrate"]) == 2
    assert "--tp, --sp pin the cluster plan (autopar plan gpt|llama ...)" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("devices", [64, 1024])
def test_llama3_8b_plans_on_a_2d_mesh_with_tensor_parallel_inside_the_key_value_groups(devices):
    plan = plan_gpt(PRESETS["llama3-8b"], load_cluster("h100-ib"), devices, 1024)
    assert plan.best.memory <= plan.memory_limit and plan.considered > 100
    assert {k.t for k in plan.ranked} <= {1, 2, 4, 8}  # a tensor degree must divide the 8 key/value heads
    text = plan.explain()
    assert "Llama 8.0B: 32 layers, hidden 4096, 32 heads (8 key/value)" in text and f"in {plan.seconds:.1f} s" in text
    assert "tied embedding" not in text


@pytest.fixture(scope="module")
def plan_175b():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    plan = plan_gpt(PRESETS["175b"], A100, 1024, 1536)
    return plan, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


@pytest.mark.slow
def test_planning_175b_allocates_nothing_of_its_size(plan_175b):
    plan, grown_mib = plan_175b
    assert grown_mib < 500, f"planning grew the process by {grown_mib:.0f} MiB"
    assert plan.config.parameters > 1.7e11
    assert plan.best.memory <= plan.memory_limit


# ------------------------------------------------------------------------------------------------ the search
@pytest.mark.slow
def test_175b_on_1024_gpus_keeps_tensor_parallel_in_a_node_and_explains_itself(plan_175b):
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "autopar.cli.main", "plan", "gpt", "--layers", "96", "--hidden",
                          "12288", "--seq", "2048", "--global-batch", "1536", "-n", "1024", "--machine", "a100-ib"],
                         capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - start
    assert out.returncode == 0, out.stderr
    assert seconds < 60
    text = out.stdout
    for expect in ("mesh: dp ", "pipeline: ", "bubble (p-1)/(", "MFU", "memory per device:",
                   "one decoder layer on a tensor group of", "qkv", "attention.fused", "runners-up:"):
        assert expect in text, expect
    plan = plan_175b[0]
    b = plan.best
    assert b.t * b.p * b.d == 1024 and b.t <= A100.devices_per_node  # two nodes' worth was costed and lost
    across = plan_gpt(PRESETS["175b"], A100, 1024, 1536, fixed={"tp": 16, "pp": 4})
    assert "tensor groups across nodes" in across.explain() and across.best.step > b.step
    assert 0.2 < plan.mfu() < 0.8
    assert b.step == pytest.approx(sum(b.parts.values()))


def test_a_model_that_fits_one_device_trains_data_parallel():
    plan = plan_gpt(GPTConfig(12, 768, 12, seq=1024), A100, 8, 64)  # GPT-2 small
    assert (plan.best.t, plan.best.p, plan.best.d) == (1, 1, 8), plan.explain()


def test_a_model_too_big_for_data_parallel_gets_sharded_and_the_bubble_is_consistent():
    cfg = PRESETS["13b"]  # 13B x 16 bytes = 208 GB of state: no device holds it whole
    plan = plan_gpt(cfg, A100, 32, 256)
    b = plan.best
    assert b.t > 1 or b.p > 1 or b.zero >= 1
    assert not any(c.t == 1 and c.p == 1 and c.zero == 0 for c in plan.ranked)
    for c in plan.ranked:
        assert c.bubble == pytest.approx((c.p - 1) / (c.v * c.m + c.p - 1))
        assert c.memory <= plan.memory_limit


def test_pinned_parts_are_kept_and_a_pipeline_costs_its_bubble():
    cfg = PRESETS["13b"]
    one = plan_gpt(cfg, A100, 64, 512, fixed={"tp": 8, "pp": 2, "micro_batch": 1, "recompute": True, "zero": 0,
                                              "vpp": 1})
    assert (one.best.t, one.best.p, one.best.b, one.best.recompute) == (8, 2, 1, True)
    assert one.best.m == 512 // (4 * 1)
    assert math.isclose(one.best.bubble, 1 / (128 + 1))


def test_a_model_that_fits_nowhere_names_its_smallest_need():
    with pytest.raises(ConfigError, match=r"fits nowhere on 8 x A100-SXM4-80GB: the smallest plan \(.*\) needs "
                                          r"\d+\.\d GiB per device, 72\.0 GiB usable"):
        plan_gpt(PRESETS["175b"], A100, 8, 64)
    with pytest.raises(ConfigError, match="data-parallel degree must divide the batch"):
        plan_gpt(PRESETS["1.3b"], A100, 8, 3, fixed={"tp": 1, "pp": 1})


def test_gpt_plan_on_this_host_uses_the_local_model(capsys):
    assert cli(["plan", "gpt", "--layers", "2", "--hidden", "256", "--seq", "64", "--global-batch", "8", "-n", "2",
                "--no-calibrate"]) == 0
    text = capsys.readouterr().out
    assert "CPU worker (this host" in text and ", fp32" in text
