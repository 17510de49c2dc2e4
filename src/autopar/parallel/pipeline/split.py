"""Where a network is cut into pipeline pieces, and what each piece becomes on its rank.

MindSpore marks the cut with ``cell.pipeline_stage = k`` (and ``cell.pipeline_segment`` for interleaved pipelines):
:func:`split_points_from_stages` turns the marks into the module each piece begins with. torch traces the network
and splits it there (``torch.distributed.pipelining.pipeline``); :func:`pieces_of` then makes each piece a module a
pipeline stage can run:

- its parameters are the network's own objects (the trace copies some: a weight tied between the first and the
  last piece -- an embedding and its output head -- would train as two unrelated copies, and the network's
  parameter, the one the optimizer holds, would get no gradient at all);
- the network's inputs a piece reads (the targets of a loss computed inside the last piece) come from this rank's
  copy of the batch -- every rank of a replica holds it -- one micro-batch per forward, in order; the schedule
  carries only activations between the pieces.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
from torch.utils._pytree import tree_map

from autopar.errors import ConfigError


def stage_of_modules(network: torch.nn.Module, attr: str = "pipeline_stage", unset: int = -1) -> dict[str, int]:
    """``{module name: pipeline stage}`` (or another cell attribute, e.g. ``pipeline_segment``) for every module,
    inherited from the nearest annotated ancestor (``unset``: none)."""
    stages: dict[str, int] = {}
    for name, module in network.named_modules():
        own = getattr(module, attr, None)
        parent = name.rpartition(".")[0] if name else None
        inherited = stages.get(parent, unset) if parent is not None else unset
        stages[name] = int(own) if own is not None else inherited
    return stages


def segments_of(network: torch.nn.Module) -> int:
    """How many virtual segments the cells' ``pipeline_segment`` marks (MindSpore's interleaved pipeline): 1 + the
    largest, 1 when no cell has one."""
    return 1 + max([int(getattr(m, "pipeline_segment", 0) or 0) for m in network.modules()] + [0])


def split_points_from_stages(network: torch.nn.Module, num_stages: int, segments: int = 1) -> list[str]:
    """The module each piece after the first begins with, from the cells' ``pipeline_stage`` (and, interleaved,
    ``pipeline_segment``: piece = segment x S + stage, in forward order); one-line errors for a cell with parameters
    but no stage, a stage out of range or unused, and stages that do not follow the forward order."""
    stages = stage_of_modules(network)
    unstaged = [n or type(network).__name__ for n, m in network.named_modules()
                if stages[n] < 0 and any(True for _ in m.parameters(recurse=False))]
    if unstaged:
        raise ConfigError(f"pipeline_stages={num_stages}: cell '{unstaged[0]}' has parameters but no pipeline_stage "
                          f"(set cell.pipeline_stage = k on it or a parent){' and more' if len(unstaged) > 1 else ''}")
    if segments > 1:
        return _split_points_interleaved(network, stages, num_stages, segments)
    out_of_range = sorted({s for s in stages.values() if s >= num_stages})
    if out_of_range:
        raise ConfigError(f"pipeline_stage {out_of_range[0]} is out of range: pipeline_stages={num_stages} numbers "
                          f"stages 0..{num_stages - 1}")
    first: dict[int, str] = {}
    last_stage = -1
    for name, _ in network.named_modules():
        s = stages[name]
        if s < 0 or not name:
            continue
        if s < last_stage and stages.get(name.rpartition(".")[0], -1) != s:
            raise ConfigError(f"cell '{name}' is in pipeline_stage {s} after a cell of stage {last_stage}: stages "
                              "must follow the order the forward runs the cells in")
        last_stage = max(last_stage, s)
        first.setdefault(s, name)
    missing = [s for s in range(num_stages) if s not in first and s > 0]
    if missing:
        raise ConfigError(f"pipeline_stages={num_stages} but no cell has pipeline_stage {missing[0]}")
    return [first[s] for s in range(1, num_stages)]


def _split_points_interleaved(network: torch.nn.Module, stages: dict[str, int], num_stages: int,
                              segments: int) -> list[str]:
    seg = stage_of_modules(network, "pipeline_segment", unset=0)
    first: dict[int, str] = {}
    last = -1
    for name, _ in network.named_modules():
        if not name or stages[name] < 0:
            continue
        if stages[name] >= num_stages:
            raise ConfigError(f"pipeline_stage {stages[name]} is out of range: pipeline_stages={num_stages} numbers "
                              f"stages 0..{num_stages - 1}")
        piece = seg[name] * num_stages + stages[name]
        parent = name.rpartition(".")[0]
        if piece < last and (seg.get(parent, 0) * num_stages + stages.get(parent, -1)) != piece:
            raise ConfigError(f"cell '{name}' (segment {seg[name]}, stage {stages[name]}) runs after a cell of a later "
                              "piece: segments, then stages, must follow the order the forward runs the cells in")
        last = max(last, piece)
        first.setdefault(piece, name)
    missing = [k for k in range(1, num_stages * segments) if k not in first]
    if missing:
        raise ConfigError(f"pipeline_interleave: no cell has pipeline_segment {missing[0] // num_stages} and "
                          f"pipeline_stage {missing[0] % num_stages}")
    return [first[k] for k in range(1, num_stages * segments)]


class Piece(torch.nn.Module):
    """Piece ``index`` of the split network as one pipeline stage's module: ``forward(*received)`` takes what the
    previous piece sent (the first piece: the network's inputs) and the network inputs it reads from :attr:`feed`."""

    def __init__(self, index: int, graph_module: torch.nn.Module, sources: list[tuple[str, int]]):
        super().__init__()
        self.index = index
        self.graph_module = graph_module
        self.sources = sources  # per argument of the piece: ("recv", i) or ("root", i)
        self.feed: list[tuple] = []  # per micro-batch of this step: the network's inputs
        self.micro = 0  # the micro-batch being computed (the stage's forward context says which)
        self.probing = False  # torch's shape probe: what it "receives" is uninitialised memory
        self.tensor_mesh = None  # its modules split over this tensor group: its tensors DTensors on it
        self.sequence_split = False  # and what it receives split on the sequence (Megatron's sequence parallelism)
        self.context = None  # or its sequence split over the mesh's cp axis, attention by this algorithm

    def reads_inputs(self) -> bool:
        return self.index > 0 and any(kind == "root" for kind, _ in self.sources)

    def running(self, info):
        """The stage's forward context: which micro-batch this forward is (the shape probe: the first)."""
        self.probing = bool(info.is_metadata_inference)
        self.micro = 0 if self.probing else info.microbatch_index
        return contextlib.nullcontext()

    def forward(self, *received):
        if self.probing and self.index > 0:
            # torch's shape probe hands a later piece empty buffers: values that index (targets of a loss, token
            # ids made in an earlier piece) would read uninitialised memory -- out of range, or silently wrong.
            # Zeros are in range for any index; the probe only looks at the shapes of what comes out
            received = tuple(torch.zeros_like(t) if isinstance(t, torch.Tensor) else t for t in received)
        if self.index == 0:  # the first piece is given the network's inputs by the schedule
            root = received
        else:
            root = self.feed[self.micro] if self.reads_inputs() else ()
        args = [received[i] if kind == "recv" else root[i] for kind, i in self.sources]
        # what crosses to the next stage is sent as laid out, and gloo and NCCL send contiguous memory: a Hugging
        # Face model hands its layers an expanded mask and RoPE's cos/sin (strides of 0), which torch's stage would
        # receive into buffers of those strides ("input tensor has to be contiguous")
        if self.tensor_mesh is None:
            return tree_map(lambda t: t.contiguous() if isinstance(t, torch.Tensor) else t, self.graph_module(*args))
        # tensor parallelism inside the stage: what it receives enters as replicated DTensors (their gradients go
        # back whole), what it makes inside (a mask, positions) is taken as replicated (the runner's step runs under
        # ``implicit_replication``), and what it sends is made whole -- the next stage's ranks each receive all of it.
        # Context parallelism: what it receives and reads -- token ids and targets too -- enters split on the
        # sequence over the cp axis, and its attention is the context-parallel one
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh = self.tensor_mesh
        axes = mesh.mesh_dim_names
        cp = mesh.size(axes.index("cp")) if "cp" in axes else 1

        def entering(a):
            if not isinstance(a, torch.Tensor):
                return a
            on_sequence = cp > 1 and a.dim() >= 2 and a.shape[1] % cp == 0
            if not (a.is_floating_point() or on_sequence):
                return a
            whole = DTensor.from_local(a, mesh, [Replicate()] * mesh.ndim, run_check=False)
            target = [Shard(1) if (axis == "cp" and on_sequence)
                      or (axis == "tp" and self.sequence_split and a.dim() > 2) else Replicate() for axis in axes]
            # (split by a redistribution: its backward gathers the gradient whole for the previous stage)
            return whole.redistribute(mesh, target) if any(p.is_shard() for p in target) else whole

        args = [entering(a) for a in args]
        with _context_attention(self.context):
            out = self.graph_module(*args)
        return tree_map(lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).contiguous()
                        if isinstance(t, torch.Tensor) else t, out)


def _context_attention(algo: str | None):
    """The context-parallel attention (:mod:`autopar.parallel.tensor.sequence_attention`) while a piece whose
    sequence is split runs its forward: the traced ``aten.scaled_dot_product_attention`` of a query split on its
    sequence goes to ``algo``'s all-gather, ring or Ulysses form."""
    if algo is None:
        return contextlib.nullcontext()
    from autopar.parallel.tensor.sequence_attention import SequenceAttention

    return SequenceAttention(algo)


def piece_calls(pipe) -> list:
    """The split graph's calls of its pieces (``submod_0``, ``submod_1`` ...), in forward order."""
    return [n for n in pipe.split_gm.graph.nodes if n.op == "call_module" and n.target.startswith("submod_")]


def pieces_of(pipe, network: torch.nn.Module, wanted) -> tuple[dict[int, Piece], dict[str, set[int]]]:
    """The pieces ``wanted`` (indices) of ``pipe`` (a traced ``Pipe``) as :class:`Piece` modules, and for every
    parameter and buffer name the pieces that use it."""
    graph = pipe.split_gm.graph
    roots = [n for n in graph.nodes if n.op == "placeholder"]
    calls = piece_calls(pipe)
    pieces: dict[int, Piece] = {}
    users: dict[str, set[int]] = {}
    for k, call in enumerate(calls):
        module = pipe.split_gm.get_submodule(call.target)
        for name, _ in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
            users.setdefault(name, set()).add(k)
        if k not in wanted:
            continue
        sources = []
        for arg in call.args:
            if isinstance(arg, torch.fx.Node) and arg.op == "placeholder":
                sources.append(("root", roots.index(arg)))
            elif k > 0 and arg is calls[k - 1]:
                sources.append(("recv", 0))
            elif (k > 0 and isinstance(arg, torch.fx.Node) and arg.target is operator.getitem
                  and arg.args[0] is calls[k - 1]):
                sources.append(("recv", int(arg.args[1])))
            else:
                raise ConfigError(f"pipeline: piece {k} reads a value from a piece before the previous one; cut the "
                                  "network where each piece needs only what the one before it computed")
        _use_network_parameters(module, network)
        pieces[k] = Piece(k, module, sources)
    return pieces, users


def _use_network_parameters(module: torch.nn.Module, network: torch.nn.Module) -> None:
    """Make ``module`` (a traced piece, whose attributes mirror the network's names) hold the network's own parameter
    and buffer objects wherever the trace made copies (a BatchNorm's statistics then stay the network's too)."""
    for kind, own, mine in (("_parameters", network.named_parameters(remove_duplicate=False),
                             module.named_parameters(remove_duplicate=False)),
                            ("_buffers", network.named_buffers(remove_duplicate=False),
                             module.named_buffers(remove_duplicate=False))):
        own = dict(own)
        for name, t in list(mine):
            original = own.get(name)
            if original is not None and original is not t and original.shape == t.shape:
                owner, _, attr = name.rpartition(".")
                getattr(module.get_submodule(owner) if owner else module, kind)[attr] = original


def network_output_loss(output: Any) -> torch.Tensor:
    """A network that computes its own loss (``loss_fn`` None): its output is the loss, or a tuple/list ending with
    it (nanoGPT's ``(logits, loss)``)."""
    loss = output[-1] if isinstance(output, (tuple, list)) else output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError("pipeline without a loss_fn: the network must return its loss (or a tuple ending with it), "
                          f"got {type(output).__name__}")
    return loss
