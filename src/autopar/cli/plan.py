"""``autopar plan MODEL -n N``: the AUTO_PARALLEL plan for a network, as a table, with data parallel's totals.

MODEL is ``resnet50``, ``mlp``, ``transformer`` or ``path/to/file.py:function`` where the function returns
``(network, loss_fn_or_None, sample_inputs)`` with the *global* batch. The machine model comes from the cache of
a calibration on this host with N local workers (run first when missing; ``--no-calibrate`` uses documented
default constants instead).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

from autopar.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="show the AUTO_PARALLEL plan of a network on N devices",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="resnet50 | mlp | transformer | FILE.py:FUNCTION")
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of devices (processes)")
    p.add_argument("--batch", type=int, default=32, help="batch size per device (global = batch x N)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--width", type=int, default=4096, help="mlp width / transformer model size")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128, help="transformer sequence length")
    p.add_argument("--memory-limit", default=None, help="per device, e.g. 2GB (default: available memory / N)")
    p.add_argument("--search-mode", default="dynamic_programming",
                   choices=("dynamic_programming", "recursive_programming", "sharding_propagation"))
    p.add_argument("--no-calibrate", action="store_true", help="use default constants, no micro-benchmark")
    p.add_argument("--recalibrate", action="store_true", help="measure the machine again")
    p.add_argument("--out", default=None, help="write the plan's strategy file (JSON) here")
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
        return mlp(args.width, args.layers), torch.nn.MSELoss(), (torch.randn(b, args.width),
                                                                  torch.randn(b, args.width))
    if args.model == "transformer":
        return (TransformerBlock(args.width, 8, 4 * args.width), torch.nn.MSELoss(),
                (torch.randn(b, args.seq, args.width), torch.randn(b, args.seq, args.width)))
    path, _, func = args.model.partition(":")
    if not path.endswith(".py") or not Path(path).is_file():
        raise ConfigError(f"unknown model {args.model!r}: use resnet50, mlp, transformer or FILE.py:FUNCTION")
    spec = importlib.util.spec_from_file_location("autopar_plan_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, func or "build", None)
    if fn is None:
        raise ConfigError(f"{path} has no function {func or 'build'}() returning (network, loss_fn, inputs)")
    return fn()


def machine_for(n: int, recalibrate: bool):
    """The calibrated model of this host with n local workers (calibrating through the launcher if needed)."""
    from autopar.cluster.launcher import LaunchConfig, launch
    from autopar.parallel.auto import machine as M

    threads = max(1, (os.cpu_count() or 1) // n)
    path = M.cache_path("gloo", n, threads)
    if recalibrate or not path.exists():
        print(f"[autopar] calibrating {n} local workers (collectives and compute, a few seconds)...", flush=True)
        import tempfile

        env = {"AUTOPAR_RECALIBRATE": "1"} if recalibrate else {}
        with tempfile.TemporaryDirectory() as logs:
            code = launch(LaunchConfig(nproc=n, script=M.__file__, log_dir=logs, stream_rank=None, extra_env=env))
        if code != 0 or not path.exists():
            raise ConfigError(f"calibration failed (exit {code}); rerun with --no-calibrate to plan on defaults")
    return M.MachineModel.from_json(path.read_text())


def run(args: argparse.Namespace) -> int:
    from autopar.context import _memory_bytes
    from autopar.parallel.auto.machine import MachineModel
    from autopar.parallel.auto.plan import plan_network

    if args.nproc < 1:
        raise ConfigError(f"-n must be positive, got {args.nproc}")
    network, loss_fn, sample = build(args)
    machine = MachineModel(device_num=args.nproc) if args.no_calibrate else machine_for(args.nproc, args.recalibrate)
    limit = _memory_bytes(args.memory_limit, "--memory-limit") if args.memory_limit else None
    plan = plan_network(network, loss_fn, tuple(sample), args.nproc, machine, args.search_mode, limit)
    print(plan.explain())
    if args.out:
        from autopar.parallel.layout import Layout
        from autopar.parallel.semi_auto.strategy_file import save_strategy_file

        layouts = {n: Layout.replicated(tuple(p.shape), args.nproc) for n, p in network.named_parameters()}
        layouts.update({} if plan.pure_data_parallel else plan.layouts())
        save_strategy_file(args.out, layouts, list(network.named_parameters()))
        print(f"strategy file: {args.out}")
    return 0
