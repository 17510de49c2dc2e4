"""``autopar ckpt merge | info | convert-mindspore``."""
from __future__ import annotations

import argparse
from pathlib import Path

from autopar.errors import CheckpointError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ckpt", help="merge, inspect and convert checkpoints")
    cmds = p.add_subparsers(dest="ckpt_command", metavar="ACTION")
    cmds.required = True
    m = cmds.add_parser("merge", help="the ranks' sliced checkpoints -> one integrated file",
                        description="Merge the sliced checkpoints of all ranks (directories written with "
                        "integrated_save=False) into one integrated checkpoint. Give the checkpoints, or a directory "
                        "holding the ranks' directories (the newest checkpoint present in all of them is merged).")
    m.add_argument("paths", nargs="+", help="sliced checkpoint directories, or one parent directory")
    m.add_argument("--out", required=True, help="the integrated checkpoint file to write")
    m.set_defaults(func=merge)
    i = cmds.add_parser("info", help="a table of a checkpoint's tensors: name, shape, dtype, layout")
    i.add_argument("path", help="an integrated file, a sliced checkpoint directory or a MindSpore .ckpt")
    i.set_defaults(func=info)
    c = cmds.add_parser("convert-mindspore", help="any MindSpore .ckpt -> an integrated autopar checkpoint",
                        description="Read a MindSpore .ckpt (no MindSpore needed) and write an integrated autopar "
                        "checkpoint holding every tensor, names and dtypes kept (load it with autopar.load_checkpoint "
                        "into any network: MindSpore's norm names are mapped on loading). --torch-names renames "
                        "norm layers' gamma/beta/moving_mean/moving_variance to torch's weight/bias/running_mean/"
                        "running_var. --model resnet50 maps the tutorial ResNet-50 onto autopar.models.resnet50, "
                        "Momentum state (moments.*) included, checking every shape.")
    c.add_argument("path")
    c.add_argument("--out", required=True)
    c.add_argument("--model", default=None, choices=("resnet50",),
                   help="map onto this network (default: none, every tensor as it is)")
    c.add_argument("--torch-names", action="store_true", help="norm layers' tensors under torch's names")
    c.set_defaults(func=convert_mindspore)


def merge(args: argparse.Namespace) -> int:
    from autopar.checkpoint.api import merge_sliced_checkpoints, sliced_under
    from autopar.checkpoint.store import is_sliced
    from autopar.cli.paths import writable_parent

    writable_parent(args.out, "--out")
    paths = [Path(p) for p in args.paths]
    for p in paths:
        if not p.exists():
            raise CheckpointError(f"checkpoint not found: {p}")
    if len(paths) == 1 and paths[0].is_dir() and not is_sliced(paths[0]):
        paths = sliced_under(paths[0])
    out = merge_sliced_checkpoints(paths, args.out)
    print(f"merged {len(paths)} sliced checkpoints into {out}")
    return 0


def info(args: argparse.Namespace) -> int:
    from autopar.checkpoint import store
    from autopar.checkpoint.api import _is_mindspore_file, load_checkpoint

    path = Path(args.path)
    layouts, rows = {}, []
    if store.is_sliced(path):
        from autopar.checkpoint.merged_reader import MergedReader

        meta = store.read_meta(path)
        layouts = meta.layouts
        md = MergedReader([path], require_complete=False).read_metadata().state_dict_metadata
        for key, m in md.items():
            if key.startswith("model.") and hasattr(m, "size"):
                local = [tuple(c.sizes) for c in m.chunks]
                rows.append((key[6:], tuple(m.size), str(m.properties.dtype).replace("torch.", ""), local))
        header = f"{path}: sliced checkpoint of rank {meta.rank} of {meta.world_size}, epoch {meta.epoch} step " \
                 f"{meta.step_in_epoch} (global step {meta.global_step})"
    else:
        if _is_mindspore_file(path):
            tensors = load_checkpoint(path)
            header = f"{path}: MindSpore checkpoint"
        else:
            obj = store.read_integrated(path)
            tensors = obj["model"]
            meta = store.CheckpointMeta.from_dict(obj.get("meta") or {})
            layouts = meta.layouts
            header = f"{path}: integrated checkpoint (saved by {meta.world_size} rank(s)), epoch {meta.epoch} " \
                     f"step {meta.step_in_epoch} (global step {meta.global_step})"
        rows = [(k, tuple(v.shape), str(v.dtype).replace("torch.", ""), None) for k, v in tensors.items()]
    print(header)
    width = max([len(r[0]) for r in rows] + [4])
    print(f"{'name':<{width}}  {'shape':<20} {'dtype':<9} layout")
    for name, shape, dtype, chunks in rows:
        lay = layouts.get(name)
        if lay:
            from autopar.layout.layout import Layout

            text = str(Layout.from_dict(lay))
        else:
            text = "whole"
        if chunks is not None and chunks != [shape]:
            text += f"  (this rank: {chunks[0]})"
        print(f"{name:<{width}}  {str(list(shape)):<20} {dtype:<9} {text}")
    print(f"{len(rows)} tensors")
    return 0


def convert_mindspore(args: argparse.Namespace) -> int:
    from autopar.checkpoint.mindspore_ckpt import read_mindspore_checkpoint
    from autopar.checkpoint.mindspore_names import mindspore_named_tensors
    from autopar.cli.paths import writable_parent

    writable_parent(args.out, "--out")
    from autopar.checkpoint.store import CheckpointMeta, write_integrated

    ms = read_mindspore_checkpoint(args.path)
    if args.model == "resnet50":
        return _convert_resnet50(args, ms)
    tensors = mindspore_named_tensors(ms, torch_names=args.torch_names)
    step = int(ms["global_step"].reshape(-1)[0]) if "global_step" in ms and ms["global_step"].size else 0
    write_integrated(args.out, tensors, None, CheckpointMeta(global_step=step))
    names = "norm layers under torch's names" if args.torch_names else "names kept"
    print(f"converted {len(tensors)} tensors from {args.path} to {args.out} ({names}, dtypes kept)")
    return 0


def _convert_resnet50(args: argparse.Namespace, ms: dict) -> int:
    import torch

    from autopar.checkpoint.mindspore_names import mindspore_to_torch_state
    from autopar.checkpoint.store import CheckpointMeta, save_integrated
    from autopar.models import resnet50

    if args.torch_names:
        raise CheckpointError("--torch-names goes with the generic conversion: --model resnet50 always gives "
                              "autopar.models.resnet50's (torch) names")
    fc = ms.get("fc.weight")
    if fc is None:
        raise CheckpointError(f"{args.path}: no 'fc.weight': not the tutorial ResNet-50")
    net = resnet50(num_classes=int(fc.shape[0]))
    rename = {"head.": ""} if any(k.startswith("head.") for k in ms) else None
    model_state, momentum, unmapped = mindspore_to_torch_state(ms, net, rename=rename)
    net.load_state_dict(model_state)
    opt = None
    if momentum:
        # MindSpore stores these as float32: keep their shortest decimal form (0.01, not 0.009999999776)
        lr = float(str(ms["learning_rate"].reshape(-1)[0])) if "learning_rate" in ms else 0.01
        mom = float(str(ms["momentum"].reshape(-1)[0])) if "momentum" in ms else 0.9
        from autopar.nn import Momentum

        opt = Momentum(net.parameters(), lr, mom)
        params = dict(net.named_parameters())
        for name, buf in momentum.items():
            opt.state[params[name]]["momentum_buffer"] = torch.as_tensor(buf).clone()
    step = int(ms["global_step"].reshape(-1)[0]) if "global_step" in ms else 0
    save_integrated(args.out, net, opt, CheckpointMeta(global_step=step))
    print(f"converted {len(model_state)} tensors ({len(momentum)} momentum buffers) from {args.path} to {args.out}; "
          f"not mapped: {unmapped or 'none'}")
    return 0
