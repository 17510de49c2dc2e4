"""What lays out a pipeline stage's own weights: ZeRO over the stage's data-parallel replicas (FSDP2, driven by
torch's pipeline schedules) and tensor and sequence parallelism over its tensor group (DTensor's sharding
propagation on the traced piece) -- alone or together, as Megatron-LM's and torchtitan's pipelines compose them.

Both replace a piece's parameters; the network's own give their memory up and are recorded (``sharded``: id of the
network's parameter -> (it, the parameter that trains)), so that optimizers made before are moved onto the new ones
and :meth:`~autopar.parallel.pipeline.runner.PipelineParallel.gather_parameters` makes the network whole again.
"""
from __future__ import annotations

import contextlib

import torch

from autopar.common import replaced
from autopar.errors import ConfigError
from autopar.parallel.pipeline.split import piece_calls


def shard_over_replicas(pieces: list, network: torch.nn.Module, sharded: dict, mesh, level: str,
                        gradients_mean: bool) -> None:
    """ZeRO inside the stage, as Megatron-LM's distributed optimizer and torchtitan's FSDP under pipelines run
    it: each of this rank's pieces an FSDP2 module over the stage's data-parallel ranks (the ``dp`` axis of
    :func:`~autopar.comm.topology.pipeline_mesh`), so its optimizer state and gradients -- at level 3 its
    weights between uses too -- are 1/D of the stage's; torch's pipeline stage drives FSDP2 itself (no gradient
    reduction before the last micro-batch, the reduce-scatter after it). The network's own parameters give
    their memory up (the shards train in their place, and optimizers made before are moved onto them); the
    runner's ``gather_parameters`` makes them whole and current again."""
    from torch.distributed.fsdp import fully_shard

    from autopar.parallel.zero.fsdp import LEVELS

    remap_before_steps()
    own = dict(network.named_parameters(remove_duplicate=False))
    for piece in pieces:
        # (experts spread over the replicas by expert parallelism: each rank's own already, none to shard)
        spread = {p for p in piece.parameters() if getattr(p, "_autopar_spread", False)}
        fully_shard(piece, mesh=mesh, reshard_after_forward=LEVELS[level], ignored_params=spread or None)
        if not gradients_mean:  # MindSpore's default sums the replicas' gradients; FSDP averages
            piece.set_gradient_divide_factor(1.0)
            piece.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        for name, shard in piece.graph_module.named_parameters(remove_duplicate=False):
            old = own.get(name)
            if old is None or old is shard:
                continue
            if id(old) in sharded:  # split over the tensor group first: that split is what FSDP2 shards
                split = sharded[id(old)][1]
                if split is not shard:
                    sharded[id(old)] = (old, shard)
                    replaced.record(split, shard)
                continue
            sharded[id(old)] = (old, shard)
            replaced.record(old, shard)
            old.data = torch.empty(0, dtype=old.dtype, device=old.device)  # its memory: the shard's now


def spread_experts(pieces: list, network: torch.nn.Module, sharded: dict, mesh, experts: set[str],
                   zero: bool = False) -> None:
    """Expert parallelism inside the stage (Megatron-LM's EP under PP, folded over the data-parallel ranks): each
    module of stacked experts in this rank's pieces keeps ``experts / ep`` of its experts -- its weights split on
    the expert dimension over the stage's replicas (``mesh``, their ``dp`` axis), or over groups of ``ep`` of them
    (a 2-D ``(edp, ep)`` mesh: split on ``ep``, a copy on each group), marked ``_autopar_spread`` -- and its operator
    (:mod:`.opaque_experts`) sends each token to the replicas of its group holding its experts. Each rank's experts'
    gradients are whole over its group's tokens: the runner sums them over the groups' copies only. Under ZeRO
    (``zero``) with copies on several groups, the copies are ZeRO's too, as Megatron-LM's distributed optimizer
    shards the experts over their expert-data-parallel ranks: each weight is stored split on its second dimension
    over the groups (the ``edp`` axis), so its gradients and optimizer state are 1/edp of a copy's; the operator
    gathers the copy for each call and reduce-scatters its gradients (FSDP2 cannot take parameters already
    placed on a mesh). ``experts``: the names of the network's modules of stacked experts, found before any of its
    weights gave its memory up (a module half given up, by a tensor split of the stage, no longer looks stacked)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    remap_before_steps()
    own = dict(network.named_parameters(remove_duplicate=False))
    ep = mesh.size(mesh.ndim - 1)  # the experts' axis: the mesh's last (a copy on each of the others)
    zero = zero and mesh.ndim > 1  # (copies only where there are groups)
    for piece in pieces:
        for name, whole in list(piece.graph_module.named_parameters(remove_duplicate=False)):
            owner, _, attr = name.rpartition(".")
            if owner not in experts:
                continue
            if whole.shape[0] % ep:
                raise ConfigError(f"ep={ep}: module '{owner}' has {whole.shape[0]} experts, which {ep} ranks do "
                                  "not divide")
            value = whole.to_local() if isinstance(whole, DTensor) else whole  # (replicated over a tensor group)
            # the groups' copies of an expert: ZeRO's shards (a 1-D weight, one number an expert, whole), or whole
            copies = Shard(1) if zero and value.dim() > 1 else Replicate()
            placements = [copies] * (mesh.ndim - 1) + [Shard(0)]
            split = torch.nn.Parameter(distribute_tensor(value.detach().clone(), mesh, placements),
                                       requires_grad=whole.requires_grad)
            split._autopar_spread = True
            piece.graph_module.get_submodule(owner)._parameters[attr] = split
            old = own.get(name)
            if old is not None and id(old) in sharded:  # replicated over a tensor group first: that copy trains
                # no more (an optimizer made before steps the spread one in its place)
                sharded[id(old)], before = (old, split), sharded[id(old)][1]
                replaced.record(before, split)
            elif old is not None:
                sharded[id(old)] = (old, split)
                replaced.record(old, split)
                old.data = torch.empty(0, dtype=old.dtype, device=old.device)


def split_over_tensor_group(pieces: list, network: torch.nn.Module, sharded: dict, mesh, plan: dict,
                            context: str | None = None) -> None:
    """Tensor parallelism inside the stage, as Megatron-LM and torchtitan compose it with pipelines: the weights
    of this rank's pieces' modules named in ``tensor_parallel`` split over the stage's ``tp`` ranks as the
    style says (``"colwise"``: a ``Linear``'s output features, ``"rowwise"``: its input features -- Megatron's
    pairs; an ``Embedding``'s embedding or vocabulary dimension), and the traced piece run on DTensor's
    sharding propagation: whatever it does with a split module's output -- a view into heads, a residual, a
    softmax -- is computed as one process would, the collectives where the layouts meet (its plain tensors are
    taken as replicated: ``implicit_replication``); what a piece sends to the next stage is made whole. The
    network's own parameters give their memory to the splits, as under ZeRO, and the runner's
    ``gather_parameters`` makes them whole. (torch's ``parallelize_module`` needs ``nn.Linear`` modules; a traced
    piece's are interpreters of them.) A parameter named in the plan with a placement (``{"mlp.w1": Shard(1)}``:
    a weight a module does not own as a ``Linear`` does, or MindSpore's strategies read by the trace --
    :mod:`.stage_strategies`) is split as that placement says.

    With ``context`` (an attention algorithm: ``"all_gather"``, ``"ring"``, ``"ulysses"``) the mesh has a ``cp``
    axis too (before ``tp``): every piece runs on the rank's slice of the sequence -- what it receives and the
    network inputs it reads (token ids, targets) split on dimension 1 there, its weights replicated there -- and
    its attention is the context-parallel one (:mod:`autopar.parallel.tensor.sequence_attention`), every other
    module token-wise on the slice; the replicated weights' gradients are partial sums over the group, which
    DTensor completes where they are used, as for the norms of sequence parallelism."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from autopar.parallel.tensor.attention import register_attention_rules

    remap_before_steps()
    register_attention_rules()  # (the CPU's flash attention on heads split: DTensor has no rule of its own)
    own = dict(network.named_parameters(remove_duplicate=False))
    kinds = dict(network.named_modules())
    made: dict[int, torch.nn.Parameter] = {}  # a weight used twice on this rank is laid out once
    given = {id(own[n]): p for n, p in plan.items() if n in own and not isinstance(p, str)}  # by parameter (any of
    # its names: one tied across pieces has one in each)
    axes = mesh.mesh_dim_names

    def placement_of(name: str, whole: torch.Tensor):
        owner = name.rpartition(".")[0]
        old = own.get(name)
        if old is not None and id(old) in given:
            return given[id(old)]
        style = plan.get(owner)
        return _placement(kinds[owner], whole, style) if style in STYLES[:2] else Replicate()

    for piece in pieces:
        named = list(piece.graph_module.named_parameters(remove_duplicate=False))
        if context is None and not any(placement_of(name, whole).is_shard() for name, whole in named):
            continue
        # every tensor of a split piece a DTensor -- the rest of its parameters and its inputs replicated -- so
        # that each gradient comes back as its tensor is: a plain tensor's from DTensor arithmetic would be a
        # DTensor, which neither the optimizer nor the stage's send can take
        piece.tensor_mesh, piece.context = mesh, context
        for name, style in plan.items():  # Megatron's sequence parallelism: these modules run on the rank's
            # slice of the sequence (a norm, a dropout), their input split there -- and what the piece receives
            # (the residual stream) enters split there too
            if style == "sequence" and name in dict(piece.graph_module.named_modules()):
                piece.graph_module.get_submodule(name).register_forward_pre_hook(_on_the_sequence)
                piece.sequence_split = True
        for name, whole in named:
            owner, _, attr = name.rpartition(".")
            if id(whole) not in made:
                placement = placement_of(name, whole)
                placements = [Replicate() if axis == "cp" else placement for axis in axes]
                made[id(whole)] = torch.nn.Parameter(distribute_tensor(whole.detach().clone(), mesh, placements),
                                                     requires_grad=whole.requires_grad)
            split = made[id(whole)]
            (piece.graph_module.get_submodule(owner) if owner else piece.graph_module)._parameters[attr] = split
            old = own.get(name)
            if old is not None and id(old) not in sharded:
                sharded[id(old)] = (old, split)
                replaced.record(old, split)
                old.data = torch.empty(0, dtype=old.dtype, device=old.device)


CONTEXT_ALGOS = ("all_gather", "ring", "ulysses")


def context_plan(cp: int, algo: str, grads: str, tensor_plan: dict) -> tuple[int, str]:
    """``cp`` and its attention algorithm, checked: one line for each way they cannot run."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ConfigError(f"PipelineParallel cp must be a positive whole number of ranks, got {cp!r}")
    if algo not in CONTEXT_ALGOS:
        raise ConfigError(f"PipelineParallel cp_algo={algo!r}; expected one of {', '.join(CONTEXT_ALGOS)}")
    if cp > 1 and grads != "stage":
        raise ConfigError(f"PipelineParallel cp={cp} splits a stage's sequence over its context group, which needs "
                          "grads='stage' (with grads='full' every rank steps every parameter whole)")
    if cp > 1 and "sequence" in tensor_plan.values():
        raise ConfigError(f"PipelineParallel cp={cp} with tensor_parallel 'sequence' modules: sequence parallelism "
                          "beside context parallelism is not run yet (the context split already holds each norm "
                          "and residual on 1/cp of the sequence: drop 'sequence')")
    return cp, algo


def check_sequence_divides(example: tuple, cp: int) -> None:
    """Every rank alike, before the stages are built: a micro-batch's sequence (dimension 1 of every input with
    one) must split into ``cp`` equal slices -- one line naming the shape."""
    for t in example:
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] % cp:
            raise ConfigError(f"PipelineParallel cp={cp} splits the sequence (dimension 1) of every input: a "
                              f"micro-batch of shape {tuple(t.shape)} does not split into {cp} equal slices (pad "
                              f"the sequence to a multiple of {cp})")


def expert_plan(ep, grads: str, replicas: int) -> int:
    """``PipelineParallel(ep=...)``, checked in one line: expert parallelism over the stage's replicas -- all of
    them or each group of ``ep`` consecutive ones (each rank holding experts / ep) -- beside data parallel, ZeRO
    (which shards the rest of the stage over the replicas, and the groups' copies of the experts over the groups)
    and a tensor split
    (sequence-parallel or not) or a context split of the stage (each rank of the inner group exchanging its own
    tokens with its peers of the other replicas)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"PipelineParallel ep must be a positive number of ranks, got {ep!r}")
    if ep == 1:
        return 1
    if grads != "stage":
        raise ConfigError(f"PipelineParallel ep={ep} spreads a stage's experts over its replicas, which needs "
                          "grads='stage' (with 'full' every rank steps every parameter)")
    if replicas % ep:
        raise ConfigError(f"PipelineParallel ep={ep}: a stage's experts spread over its {replicas} data-parallel "
                          f"replica(s) or over groups of them -- give an ep that divides {replicas}")
    return ep


def zero_level(zero: str | None, grads: str) -> str | None:
    from autopar.parallel.zero.fsdp import LEVELS

    if zero is None:
        return None
    if zero not in LEVELS:
        raise ConfigError(f"PipelineParallel zero={zero!r}; expected one of {', '.join(sorted(LEVELS))} or None")
    if grads != "stage":
        raise ConfigError(f"PipelineParallel zero={zero!r} shards a stage's optimizer state over its replicas, which "
                          "needs grads='stage' (with grads='full' every rank steps every parameter)")
    return zero


_remapping: list = []  # the optimizer step pre-hook below, once registered


def remap_before_steps() -> None:
    """Every optimizer moved onto the parameters that replaced its own before it steps -- the PyTorch door's
    ``opt = AdamW(net.parameters())`` made before the stages were sharded -- also where no parallel mode is set
    (whose hooks do it otherwise, :mod:`autopar.parallel.entry`). Registered once per process."""
    if not _remapping:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        from autopar.common.replaced import remap_optimizer

        _remapping.append(register_optimizer_step_pre_hook(lambda opt, args, kwargs: remap_optimizer(opt)))


STYLES = ("colwise", "rowwise", "sequence")


def _on_the_sequence(module, args):
    """A ``"sequence"`` module's input split on the sequence (dimension 1) over the tensor group: the all-gather
    before the next column split and the reduce-scatter after a row split's partial sums are DTensor's, where
    the layouts meet."""
    from torch.distributed.tensor import DTensor, Shard

    first = args[0] if args else None
    if isinstance(first, DTensor) and first.dim() > 1 and tuple(first.placements) != (Shard(1),):
        return (first.redistribute(first.device_mesh, [Shard(1)]),) + tuple(args[1:])
    return None


def tensor_plan(tp: int, plan: dict | None, grads: str) -> tuple[int, dict]:
    """``tp`` and the modules it splits, checked: one line for each way they cannot run."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"PipelineParallel tp must be a positive whole number of ranks, got {tp!r}")
    plan = dict(plan or {})
    if tp == 1:
        if plan:
            raise ConfigError("PipelineParallel tensor_parallel splits modules over tp ranks: give tp > 1 too")
        return 1, plan
    if not plan:
        raise ConfigError(f"PipelineParallel tp={tp} needs tensor_parallel={{module name: 'colwise' | 'rowwise'}} "
                          "saying which modules to split")
    if grads != "stage":
        raise ConfigError(f"PipelineParallel tp={tp} splits a stage's weights over its tensor group, which needs "
                          "grads='stage' (with grads='full' every rank steps every parameter whole)")
    bad = [name for name, style in plan.items() if isinstance(style, str) and style not in STYLES]
    if bad:
        raise ConfigError(f"PipelineParallel tensor_parallel['{bad[0]}']={plan[bad[0]]!r}; expected 'colwise', "
                          "'rowwise' or 'sequence'")
    return tp, plan


def check_plan_names(plan: dict, modules: dict, parameters: dict) -> None:
    """Each key of a tensor plan names a module (given a style) or a parameter (given its placement on the tensor
    group, ``Shard(d)`` or ``Replicate()``): one line for any other."""
    from torch.distributed.tensor import Replicate, Shard

    for name, value in plan.items():
        if name in parameters and not isinstance(value, str):
            if not isinstance(value, (Shard, Replicate)) or (isinstance(value, Shard)
                                                              and not 0 <= value.dim < parameters[name].dim()):
                raise ConfigError(f"PipelineParallel tensor_parallel['{name}']={value!r}: a parameter takes "
                                  f"Shard(d) for one of its {parameters[name].dim()} dimensions, or Replicate()")
        elif name not in modules:
            raise ConfigError(f"PipelineParallel tensor_parallel names '{name}', which is not a module of the "
                              "network" + (" (a parameter takes a placement: Shard(d) or Replicate())"
                                           if name in parameters else ""))
        elif not isinstance(value, str):
            raise ConfigError(f"PipelineParallel tensor_parallel['{name}']={value!r}: a module takes a style, "
                              "'colwise', 'rowwise' or 'sequence' (a placement is for a parameter's name)")


def check_sequence_beside_splits(pipe, plan: dict) -> None:
    """Every rank, on the whole split network (so that all stop alike): a ``"sequence"`` module in a piece that
    splits no module has no tensor group to share the sequence with -- one line."""
    for call in piece_calls(pipe):
        piece = pipe.split_gm.get_submodule(call.target)
        modules = dict(piece.named_modules())
        if any(plan.get(name) in STYLES[:2] for name in modules) or any(
                not isinstance(plan.get(name, ""), str) for name, _ in piece.named_parameters()):
            continue
        alone = [name for name, style in plan.items() if style == "sequence" and name in modules]
        if alone:
            raise ConfigError(f"PipelineParallel tensor_parallel['{alone[0]}']='sequence' in a piece that splits no "
                              "module: sequence parallelism runs beside the stage's column and row splits (Megatron's);"
                              " split its Linears too, or drop 'sequence'")


def _placement(module: torch.nn.Module, param: torch.Tensor, style: str):
    """Where ``style`` puts one of ``module``'s parameters on the tensor group: a ``Linear``'s weight ``(out, in)``
    split on ``out`` (colwise) or ``in`` (rowwise), its bias with the output; an ``Embedding``'s ``(vocab, dim)`` on
    ``dim`` (colwise) or ``vocab`` (rowwise); transformers' ``Conv1D`` (``(in, out)``) as a ``Linear`` means."""
    from torch.distributed.tensor import Replicate, Shard

    if param.dim() == 2:
        if isinstance(module, torch.nn.Embedding):
            return Shard(1 if style == "colwise" else 0)
        transposed = type(module).__name__ == "Conv1D"
        return Shard((0 if style == "colwise" else 1) ^ int(transposed))
    return Shard(0) if style == "colwise" and param.dim() == 1 else Replicate()


def attention_traced_plainly(active: bool):
    """The trace with attention's math kernel: the CPU's flash kernel returns its output in (batch, sequence, heads)
    memory order, so the ``.transpose(1, 2).contiguous()`` after it is already contiguous and the trace drops the
    copy; under tensor parallelism the same output is a DTensor whose strides are the standard ones, and the
    ``view`` after it fails ("Cannot view a tensor with shape ... and strides ..."). Traced with the math kernel the
    copy stays (it runs where it must, and costs nothing where the layout is already contiguous)."""
    if not active:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def implicit_replication_while(active: bool):
    if not active:
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


def local(t: torch.Tensor) -> torch.Tensor:
    """A ZeRO shard's slice on this rank (a plain tensor: itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's slice) as a gradient of ``param``: a DTensor laid out as a ZeRO shard is."""
    if not hasattr(param, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())
