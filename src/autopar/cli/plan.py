"""``autopar plan MODEL -n N``: the plan for a network on N devices, as a table, with data parallel's totals.

MODEL is ``resnet50``, ``mlp``, ``transformer`` or ``path/to/file.py:function`` where the function returns
``(network, loss_fn_or_None, sample_inputs)`` with the *global* batch: the AUTO_PARALLEL operator-level plan. The
machine model comes from the cache of a calibration on this host with N local workers (run first when missing;
``--no-calibrate`` uses documented default constants instead).

MODEL ``gpt`` plans a GPT decoder of any size (``--size 1.3b|13b|175b`` or ``--layers --hidden [--heads]``), built on
the meta device, over data x tensor x pipeline parallelism and ZeRO on a cluster: ``--machine a100-ib`` (a preset)
or ``--machine cluster.json`` (same form); without ``--machine`` it plans for this host. ``--tp/--pp/--vpp/--cp/--sp/
--micro-batch/--zero/--recompute/--attention`` pin parts of the plan (to predict a configuration you have in mind).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from pathlib import Path

from autopar.cli.paths import writable_parent
from autopar.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="show the AUTO_PARALLEL plan of a network on N devices",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="resnet50 | mlp | transformer | gpt | llama | FILE.py:FUNCTION")
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of devices (processes)")
    p.add_argument("--batch", type=int, default=32, help="batch size per device (global = batch x N)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--width", type=int, default=4096, help="mlp width / transformer model size")
    p.add_argument("--layers", type=int, default=None, help="mlp / gpt layers (mlp: 4)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (transformer: 128, gpt: 2048)")
    g = p.add_argument_group("gpt on a cluster")
    g.add_argument("--size", default=None, help="a preset: 1.3b, 13b, 175b (GPT-3), llama3-8b, llama3-70b; mixtures "
                   "of experts qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b, mixtral-8x22b, deepseek-v3, kimi-k2, "
                   "moonlight-16b-a3b, gpt-oss-120b, gpt-oss-20b")
    g.add_argument("--hidden", type=int, default=None, help="gpt hidden size")
    g.add_argument("--heads", type=int, default=None, help="gpt attention heads (default hidden / 128)")
    g.add_argument("--vocab", type=int, default=None, help="vocabulary (gpt: 51200, llama: 128256)")
    g.add_argument("--kv-heads", type=int, default=None, help="key/value heads (grouped-query attention)")
    g.add_argument("--ffn", type=int, default=None, help="feed-forward size (gpt: 4 x hidden)")
    g.add_argument("--head-dim", type=int, default=None,
                   help="each attention head's width where heads x head-dim is not the hidden size (Qwen3: 128)")
    g.add_argument("--experts", type=int, default=None,
                   help="llama: a mixture of experts -- every layer's MLP this many SwiGLU experts (Qwen3-MoE, "
                        "Mixtral; the mixture presets of --size)")
    g.add_argument("--top-k", type=int, default=None, help="experts each token is routed to (default 2)")
    g.add_argument("--expert-ffn", type=int, default=None, help="each expert's feed-forward size (default --ffn)")
    g.add_argument("--ep", type=int, default=None,
                   help="pin the expert-parallel degree: the experts over this many consecutive ranks, each holding "
                        "experts / ep whole (unpinned, searched where autopar runs it; --ep 1 keeps them whole)")
    g.add_argument("--moe-dispatcher", default=None, choices=("alltoall", "deepep"),
                   help="how tokens reach their experts: alltoall (NCCL's all-to-all, a copy a chosen expert: "
                        "Megatron's alltoall dispatcher, autopar's; the default) or deepep (DeepEP's / HybridEP's "
                        "kernels, Megatron's flex dispatcher: a token once a node over the network, once a rank)")
    g.add_argument("--ep-overlap", action="store_true",
                   help="the experts' all-to-alls hidden behind another micro-batch's compute (Megatron's "
                        "--overlap-moe-expert-parallel-comm)")
    g.add_argument("--tp-overlap", default=None, choices=("megatron", "none"),
                   help="which tensor-parallel collectives hide behind GEMMs: megatron (the backward's, behind the "
                        "GEMMs launched after them: Megatron-Core's, and read so for async TP; the default) or none "
                        "(every one exposed: PyTorch's DTensor tensor parallelism as torchtitan, KempnerForge and "
                        "autopar's layouts run it)")
    g.add_argument("--fp8-recipe", default=None, choices=("delayed", "tensorwise", "rowwise"),
                   help="with --dtype fp8, how the projections' operands are scaled and cast: delayed (Transformer "
                        "Engine's default, as Megatron-Core and NeMo run it; the default), tensorwise (per-tensor "
                        "current scaling: torchao's default, as torchtitan runs it, or Transformer Engine's current "
                        "scaling) or rowwise (torchao's)")
    g.add_argument("--global-batch", type=int, default=512, help="sequences per step")
    g.add_argument("--machine", default=None, help="preset name or cluster JSON file (default: this host)")
    g.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 | fp8 (default bf16, fp32 on this host; fp8: the "
                   "projections' GEMMs in fp8 as Transformer Engine runs them, the rest in bf16)")
    g.add_argument("--tp", type=int, default=None, help="pin the tensor-parallel degree")
    g.add_argument("--pp", type=int, default=None, help="pin the pipeline stages")
    g.add_argument("--micro-batch", type=int, default=None, help="pin the micro-batch size")
    g.add_argument("--vpp", type=int, default=None,
                   help="pin the virtual stages per device (interleaved 1F1B; 1: plain 1F1B)")
    g.add_argument("--zero", type=int, default=None, choices=(0, 1, 2, 3), help="pin the ZeRO level")
    g.add_argument("--zero-shard", type=int, default=None,
                   help="shard ZeRO's state over groups of this many data-parallel ranks, replicated across the "
                        "groups (hybrid sharding: FSDP2's HSDP, MiCS; MindSpore's optimizer_weight_shard_size)")
    g.add_argument("--cp", type=int, default=None,
                   help="pin the context-parallel degree (ring attention over the sequence; unpinned, searched "
                        "for sequences of 8,192 tokens and more under fused attention; --cp 1 keeps it off)")
    g.add_argument("--split-embedding-and-loss", action="store_true",
                   help="the embedding and the loss each take a layer's place in the pipeline split, the first and "
                        "last stages a layer fewer (Megatron-LM's --account-for-embedding-in-pipeline-split and "
                        "--account-for-loss-in-pipeline-split; DeepSpeed's --pp-partition-method "
                        "'type:transformer|embedding')")
    g.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help="pin sequence parallelism in the tensor group on (--sp) or off (--no-sp); unpinned, the "
                        "search weighs it for every tensor group (Megatron's: norms, dropout and residuals split on "
                        "the sequence, an all-gather and a reduce-scatter in place of each all-reduce)")
    g.add_argument("--recompute", default=None, choices=("full", "selective", "block", "none", "on", "off"),
                   help="pin activation recomputation: full (on), selective (the attention core only: Korthikanti et "
                        "al. 2022), block (some layers of a device whole, Megatron's --recompute-method block: the "
                        "fewest that fit, or --recompute-layers) or none (off)")
    g.add_argument("--recompute-layers", type=int, default=None,
                   help="pin block recomputation of this many layers a device (all its virtual chunks together; "
                        "Megatron's --recompute-num-layers counts a chunk's: multiply it by --vpp)")
    g.add_argument("--attention", default="fused", choices=("fused", "flash2", "materialized"),
                   help="fused: one kernel, the scores never stored (the default: FlashAttention-3 / cuDNN on Hopper, "
                        "as Transformer Engine runs it, FlashAttention-2 on Ampere); flash2: FlashAttention-2's kernel "
                        "(PyTorch's SDPA, flash-attn 2) on every GPU; materialized: the s x s scores kept for the "
                        "backward (Megatron-LM of 2021-2022)")
    p.add_argument("--memory-limit", default=None, help="per device, e.g. 2GB (default: available memory / N)")
    p.add_argument("--search-mode", default="dynamic_programming",
                   choices=("dynamic_programming", "recursive_programming", "sharding_propagation"))
    p.add_argument("--no-calibrate", action="store_true", help="use default constants, no micro-benchmark")
    p.add_argument("--recalibrate", action="store_true", help="measure the machine again")
    p.add_argument("--out", default=None, help="write the plan's strategy file (JSON) here")
    p.add_argument("--json", action="store_true",
                   help="gpt / llama: print the plan as one JSON object (step_s, tokens_per_s_per_device, mfu, "
                        "model_tflops_per_device, hardware_tflops_per_device, memory_gib, the configuration, the "
                        "step's breakdown; runners_up) instead of the table")
    p.set_defaults(func=run)


def build(args: argparse.Namespace):
    import torch

    from autopar.models import TransformerBlock, mlp, resnet50
    from autopar.nn import SoftmaxCrossEntropyExpand

    b = args.batch * args.nproc
    if args.model == "resnet50":
        x = torch.randn(b, 3, args.image_size, args.image_size)
        return resnet50(num_classes=10), SoftmaxCrossEntropyExpand(sparse=True), (x, torch.randint(0, 10, (b,)))
    if args.model == "mlp":
        return mlp(args.width, args.layers or 4), torch.nn.MSELoss(), (torch.randn(b, args.width),
                                                                  torch.randn(b, args.width))
    if args.model == "transformer":
        return (TransformerBlock(args.width, 8, 4 * args.width), torch.nn.MSELoss(),
                (torch.randn(b, args.seq or 128, args.width), torch.randn(b, args.seq or 128, args.width)))
    path, _, func = args.model.partition(":")
    if not path.endswith(".py"):
        raise ConfigError(f"unknown model {args.model!r}: use resnet50, mlp, transformer or FILE.py:FUNCTION")
    if not Path(path).is_file():
        raise ConfigError(f"model file not found: {path}" + (" (a directory)" if Path(path).is_dir() else ""))
    spec = importlib.util.spec_from_file_location("autopar_plan_model", path)
    module = importlib.util.module_from_spec(spec)
    name = func or "build"
    try:
        spec.loader.exec_module(module)
        fn = getattr(module, name, None)
        if fn is None:
            raise ConfigError(f"{path} has no function {name}() returning (network, loss_fn, inputs)")
        return fn()
    except ConfigError:
        raise
    except Exception as exc:  # the user's file: say where, in one line (AUTOPAR_TRACEBACK=1 shows the traceback)
        if os.environ.get("AUTOPAR_TRACEBACK"):
            raise
        first = str(exc).strip().splitlines()
        raise ConfigError(f"{path}:{name}() raised {type(exc).__name__}: {first[0] if first else ''} "
                          f"(AUTOPAR_TRACEBACK=1 shows where)") from None


def machine_for(n: int, recalibrate: bool):
    """The calibrated model of this host with n local workers (calibrating through the launcher if needed)."""
    from autopar.cluster.launcher import LaunchConfig, launch
    from autopar.planner import machine as M

    threads = max(1, (os.cpu_count() or 1) // n)
    path = M.cache_path("gloo", n, threads)
    if recalibrate or not path.exists():
        print(f"[autopar] calibrating {n} local workers (collectives and compute, a few seconds)...", flush=True)
        import tempfile

        env = {"AUTOPAR_RECALIBRATE": "1"} if recalibrate else {}
        with tempfile.TemporaryDirectory() as logs:
            code = launch(LaunchConfig(nproc=n, script=M.__file__, log_dir=logs, stream_ranks=[], extra_env=env))
        if code != 0 or not path.exists():
            raise ConfigError(f"calibration failed (exit {code}); rerun with --no-calibrate to plan on defaults")
    return M.MachineModel.from_json(path.read_text())


def run(args: argparse.Namespace) -> int:
    from autopar.context_values import memory_bytes
    from autopar.planner.machine import MachineModel
    from autopar.planner.plan import plan_network

    if args.nproc < 1:
        raise ConfigError(f"-n must be positive, got {args.nproc}")
    if args.out:
        writable_parent(args.out, "--out")
    if args.model in ("gpt", "llama"):
        return run_gpt(args)
    if args.json:
        raise ConfigError("--json is the cluster plan's (autopar plan gpt|llama ...); this model's plan is the table")
    cluster_only = [flag for flag, value in (("--tp", args.tp), ("--pp", args.pp), ("--vpp", args.vpp), ("--cp", args.cp),
                                             ("--sp" if args.sp else "--no-sp", None if args.sp is None else True),
                                             ("--zero", args.zero), ("--zero-shard", args.zero_shard),
                                             ("--recompute", args.recompute),
                                             ("--recompute-layers", args.recompute_layers),
                                             ("--split-embedding-and-loss", args.split_embedding_and_loss),
                                             ("--micro-batch", args.micro_batch), ("--machine", args.machine),
                                             ("--size", args.size), ("--hidden", args.hidden), ("--heads", args.heads),
                                             ("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim),
                                             ("--ffn", args.ffn), ("--vocab", args.vocab),
                                             ("--experts", args.experts), ("--top-k", args.top_k),
                                             ("--expert-ffn", args.expert_ffn), ("--ep", args.ep),
                                             ("--moe-dispatcher", args.moe_dispatcher),
                                             ("--ep-overlap", args.ep_overlap), ("--tp-overlap", args.tp_overlap),
                                             ("--fp8-recipe", args.fp8_recipe))
                    if value not in (None, False)]
    if cluster_only:
        raise ConfigError(f"{', '.join(cluster_only)} pin{'s' if len(cluster_only) == 1 else ''} the cluster plan "
                          f"(autopar plan gpt|llama ...); {args.model}'s plan is AUTO_PARALLEL's own search")
    network, loss_fn, sample = build(args)
    machine = MachineModel(device_num=args.nproc) if args.no_calibrate else machine_for(args.nproc, args.recalibrate)
    limit = memory_bytes(args.memory_limit, "--memory-limit") if args.memory_limit else None
    plan = plan_network(network, loss_fn, tuple(sample), args.nproc, machine, args.search_mode, limit)
    print(plan.explain())
    if args.out:
        from autopar.layout.layout import Layout
        from autopar.layout.strategy_file import save_strategy_file

        layouts = {n: Layout.replicated(tuple(p.shape), args.nproc) for n, p in network.named_parameters()}
        layouts.update({} if plan.pure_data_parallel else plan.layouts())
        save_strategy_file(args.out, layouts, list(network.named_parameters()))
        print(f"strategy file: {args.out}")
    return 0


def gpt_config(args: argparse.Namespace):
    from autopar.planner.gpt import PRESETS, GPTConfig

    if args.size:
        if args.size.lower() not in PRESETS:
            raise ConfigError(f"unknown --size {args.size!r}; expected one of {', '.join(PRESETS)}")
        base = PRESETS[args.size.lower()]
        given = {name: getattr(args, name) for name in ("layers", "hidden", "heads", "seq", "vocab", "ffn", "kv_heads",
                                                          "head_dim", "experts", "top_k", "expert_ffn")}
        # the preset with what the flags give in its place (its latent attention, shared experts, ... kept)
        return dataclasses.replace(base, attention=args.attention,
                                   **{k: v for k, v in given.items() if v is not None})
    if not args.layers or not args.hidden:
        raise ConfigError(f"autopar plan {args.model} needs --size ({', '.join(PRESETS)}) or --layers and --hidden")
    heads = args.heads or max(1, args.hidden // 128)
    llama = args.model == "llama"
    return GPTConfig(args.layers, args.hidden, heads, args.seq or 2048, args.vocab or (128256 if llama else 51200),
                     args.ffn or 0, args.kv_heads or 0, "llama" if llama else "gpt", args.attention,
                     args.head_dim or 0, args.experts or 0, args.top_k or 0, args.expert_ffn or 0)


def run_gpt(args: argparse.Namespace) -> int:
    import sys

    from autopar.context_values import memory_bytes
    from autopar.planner.cluster import ClusterSpec, load_cluster, plan_gpt

    config = gpt_config(args)
    if args.machine:
        spec = load_cluster(args.machine)
        dtype = args.dtype or "bf16"
    else:
        from autopar.planner.machine import MachineModel, available_memory

        model = MachineModel(device_num=args.nproc) if args.no_calibrate else machine_for(args.nproc, args.recalibrate)
        model.memory_per_device = available_memory() / args.nproc
        spec = ClusterSpec.from_machine_model(model, args.nproc)
        dtype = args.dtype or "fp32"
    limit = memory_bytes(args.memory_limit, "--memory-limit") if args.memory_limit else None
    fixed = {"tp": args.tp, "pp": args.pp, "vpp": args.vpp, "micro_batch": args.micro_batch, "zero": args.zero,
             "cp": args.cp, "sp": args.sp, "zero_shard": args.zero_shard,
             "recompute": {None: None, "full": True, "on": True, "none": False, "off": False,
                           "selective": "selective", "block": "block"}[args.recompute],
             "recompute_layers": args.recompute_layers, "split_embedding": args.split_embedding_and_loss or None,
             "ep": args.ep, "dispatcher": args.moe_dispatcher, "ep_overlap": args.ep_overlap or None,
             "tp_overlap": args.tp_overlap, "fp8_recipe": args.fp8_recipe}
    print(f"[autopar] planning {config.describe()} on {args.nproc} x {spec.device_name} ({spec.name})...",
          file=sys.stderr, flush=True)
    plan = plan_gpt(config, spec, args.nproc, args.global_batch, dtype, limit, fixed=fixed)
    if args.json:
        import json

        out = plan.to_dict()
        out["runners_up"] = [plan.to_dict(c) for c in plan.ranked[1:6]]
        out["planning_s"] = plan.seconds
        print(json.dumps(out, indent=1))
    else:
        print(plan.explain())
    return 0
