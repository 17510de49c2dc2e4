"""A mixture's experts as one opaque operator in a pipeline stage's trace.

torch's pipelines trace the network (``torch.export``) and cut the graph into stages; a module of stacked experts
(:func:`autopar.layout.leaves.stacked_experts`: transformers' ``MixtralExperts``, ``Qwen2MoeExperts``, autopar's
``StackedExperts``) picks each expert's tokens with ``nonzero`` / ``where`` -- shapes the trace cannot follow ("data/
shape-dependent control flow"), so no mixture could be split into stages. While the network is traced, each such
module's call is one operator, ``autopar::stacked_experts``, whose result has its input's shape (what the trace
needs) and whose work is the module's own forward on the stage's rank, run eagerly with the piece's parameters.
Its backward runs that forward again under autograd (one more forward of the experts, no activations kept between)
and returns the gradients of the tokens, the routing weights and the experts' weights: exact, the same arithmetic
as the module's own backward.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.func import functional_call

from autopar.errors import ConfigError
from autopar.layout.leaves import stacked_experts
from autopar.parallel.tensor.handlers import install
from autopar.parallel.tensor.placements import splits

# key -> (the module, weakly: a network let go is not kept alive here; the names of its parameters in the order the
# operator receives them)
_MODULES: dict[int, tuple[weakref.ref, tuple[str, ...]]] = {}


def _run(key: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
         params: list[torch.Tensor]) -> torch.Tensor:
    module, names = _MODULES[key]
    return functional_call(module(), dict(zip(names, params)), (hidden, index, weights))


@torch.library.custom_op("autopar::stacked_experts", mutates_args=())
def _experts(key: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
             params: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = _run(key, hidden, index, weights, params)
    return out.clone() if any(out is t for t in (hidden, weights, *params)) else out


@_experts.register_fake
def _(key, hidden, index, weights, params):
    return torch.empty_like(hidden)


def _setup(ctx, inputs, output) -> None:
    key, hidden, index, weights, params = inputs
    ctx.key = key
    ctx.save_for_backward(hidden, index, weights, *params)


def _again(ctx, run, hidden, weights, params: list, grad) -> list:
    """The gradients of the tokens, the routing weights and ``params`` (None where not asked): ``run(hidden,
    weights, params)`` -- the experts' forward -- again under autograd, differentiated against ``grad``."""
    wanted = [ctx.needs_input_grad[1], ctx.needs_input_grad[3]]
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(w) for t, w in zip((hidden, weights), wanted)]
        own = [p.detach().requires_grad_(True) for p in params]
        out = run(leaves[0], leaves[1], own)
        asked = [t for t in (*leaves, *own) if t.requires_grad]
        got = iter(torch.autograd.grad(out, asked, grad, allow_unused=True))
    return [next(got) if t.requires_grad else None for t in (*leaves, *own)]


def _backward(ctx, grad):
    saved = ctx.saved_tensors
    spread = _spread_over(saved[3:])
    if spread is not None:
        return _expert_parallel_backward(ctx, grad, saved, spread)
    mesh = next((t.device_mesh for t in (grad, *saved) if isinstance(t, DTensor)), None)
    tokens = _token_placements(saved[0], saved[1], saved[2]) if mesh is not None else None
    hidden, index, weights = (_local(t, tokens) for t in saved[:3])
    params, grad = [_local(p, None) for p in saved[3:]], _local(grad, tokens)
    grads = _again(ctx, lambda h, w, own: _run(ctx.key, h, index, w, own), hidden, weights, params, grad)
    if mesh is not None:  # a laid-out stage's: the tokens' gradients placed as the tokens, the weights' summed over
        # the ranks whose tokens they saw (partial where the tokens are split, replicated where they are not)
        weight = [Partial() if splits(p) else Replicate() for p in tokens]
        grads = [g if g is None or not isinstance(s, DTensor) else DTensor.from_local(
            g, mesh, tokens if i < 2 else weight, run_check=False)
            for i, (g, s) in enumerate(zip(grads, (saved[0], saved[2], *saved[3:])))]
    return None, grads[0], None, grads[1], list(grads[2:])


def _spread_over(params):
    """The mesh a stage's experts are spread over (``PipelineParallel(ep=...)``: their weights split on the expert
    dimension over the stage's replicas), or None."""
    for p in params:
        if isinstance(p, DTensor) and any(q.is_shard(0) for q in p.placements):
            return p.device_mesh
    return None


def split_copies(p) -> bool:
    """Is ``p``, a spread expert weight, stored split over the groups' copies (ZeRO's shards of them,
    :func:`autopar.parallel.pipeline.stage_layout.spread_experts`)?"""
    return isinstance(p, DTensor) and any(splits(q) for q in p.placements[:-1])


def _copy(p) -> torch.Tensor:
    """This rank's experts' weights whole: ``p``'s local tensor, gathered over the groups' copies where ZeRO
    splits them."""
    if split_copies(p):
        p = p.redistribute(p.device_mesh, [Replicate()] * (p.device_mesh.ndim - 1) + [Shard(0)])
    return p.to_local()


def _placed(g: torch.Tensor, p):
    """A rank's gradient of its experts' weights ``p`` (whole over its group's tokens) placed as ``p``: the groups'
    sums reduce-scattered into ZeRO's shards where ``p`` is split over the copies."""
    if not split_copies(p):
        return DTensor.from_local(g, p.device_mesh, p.placements, run_check=False)
    mesh = p.device_mesh
    return DTensor.from_local(g, mesh, [Partial()] * (mesh.ndim - 1) + [Shard(0)], run_check=False).redistribute(
        mesh, p.placements)


def _expert_parallel(key: int, hidden, index, weights, local: list, mesh) -> torch.Tensor:
    """The experts spread over ``mesh``'s last axis (a stage's replicas, or a group of ep of them: each rank holding
    ``experts / ep``, ``local`` their weights): each token sent with its routing only to the ranks of its group
    holding the experts it chose, run there, its results brought back and summed -- the layout modes' all-to-all
    dispatcher (:func:`autopar.parallel.tensor.experts.exchanged`) on the stage's own tokens. Differentiable."""
    from autopar.parallel.tensor.experts import exchanged, experts_holding

    ref, names = _MODULES[key]
    module = ref()
    axis = mesh.ndim - 1
    ep = mesh.size(axis)
    per = module.num_experts // ep
    start = mesh.get_local_rank(axis) * per
    forward = type(module).forward
    return exchanged(hidden, index, weights, mesh.get_group(axis), ep, per, lambda h, i, w: experts_holding(
        module, forward, dict(zip(names, local)), per, h, i, w, start))


# A dry run's (``autopar.dryrun``) way to follow the experts' exchange on fake tensors: a function of (a fake
# routing, the number of experts) giving a context in which the routing has the values a balanced router gives and
# ops on known values compute theirs (the sizes of what each rank sends and each expert takes); None elsewhere.
routing_values = None

_warned = False


def _unsized_warning() -> None:
    """Said once where fake tensors meet spread experts outside a dry run that follows their routing."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("autopar: fake tensors meet expert parallelism inside a pipeline stage without routing values "
                      "to send tokens by: the exchange and the experts' work on them are left out", stacklevel=2)


def _num_experts(key: int) -> int:
    return _MODULES[key][0]().num_experts


def _expert_parallel_backward(ctx, grad, saved, mesh):
    """The backward of :func:`_expert_parallel`: the forward again under autograd -- its all-to-alls with it, on
    every rank of the group alike (the schedules run the same micro-batches' backward at once on every replica)
    -- and its gradients; the experts' weights' placed as the weights (each rank's experts' own, whole over the
    group's tokens)."""
    tokens = _inner_tokens(*saved[:3])  # (a tensor or context split of the stage: each rank's own tokens)
    hidden, index, weights = (_local(t, tokens[1]) if tokens else t for t in saved[:3])
    grad = _local(grad, tokens[1]) if tokens else grad
    local = [_copy(p) for p in saved[3:]]
    again = lambda: _again(ctx, lambda h, w, own: _expert_parallel(ctx.key, h, index, w, own, mesh),  # noqa: E731
                           hidden, weights, local, grad)
    if is_fake(hidden) and routing_values is not None:  # a dry run's: the exchange followed on known routing
        with routing_values(index, _num_experts(ctx.key)):
            grads = again()
    elif is_fake(hidden):  # fake tensors without routing values: gradients of the inputs' sizes
        _unsized_warning()
        grads = [torch.zeros_like(t) if ctx.needs_input_grad[i] else None
                 for t, i in ((hidden, 1), (weights, 3))] + [torch.zeros_like(p) for p in local]
    else:
        grads = again()
    if tokens:  # the tokens' gradients placed as the tokens; the experts' summed over the ranks whose tokens they
        # saw where the tokens are split (replicated tokens gave every rank the same)
        inner, placements = tokens
        grads[:2] = [g if g is None else DTensor.from_local(g, inner, placements, run_check=False) for g in grads[:2]]
        for dim, p in enumerate(placements):
            if splits(p):
                for g in grads[2:]:
                    if g is not None:
                        torch.distributed.all_reduce(g, group=inner.get_group(dim))
    placed = [None if g is None else _placed(g, p) for g, p in zip(grads[2:], saved[3:])]
    return None, grads[0], None, grads[1], placed


def _inner_tokens(hidden, index, weights):
    """(mesh, placements) of the tokens where a tensor or context split of the stage holds them as DTensors --
    replicated over the tensor group, split over a context group or sequence-parallel ranks -- else None."""
    mesh = next((t.device_mesh for t in (hidden, index, weights) if isinstance(t, DTensor)), None)
    return None if mesh is None else (mesh, _token_placements(hidden, index, weights))


def _on_local_tensors(op_call, args: tuple, kwargs: dict):
    """DTensor's handler of the operator (a stage laid out over a tensor or context group, whose pieces compute on
    DTensors): the experts whole on each rank of the group, on its tokens -- all of them where they are
    replicated, its share where the sequence is split (the experts map each token alone) -- their results placed
    as the tokens; or, the experts spread over the stage's replicas, the tokens sent to them
    (:func:`_expert_parallel`)."""
    key, hidden, index, weights, params = args
    spread = _spread_over(params)
    if spread is not None:
        if is_fake(hidden) and routing_values is None:  # no routing values to send tokens by
            _unsized_warning()
            return torch.empty_like(hidden)
        tokens = _inner_tokens(hidden, index, weights)  # (a tensor or context split of the stage: each rank's own)
        h, i, w = (_local(t, tokens[1]) if tokens else t for t in (hidden, index, weights))
        with torch.no_grad(), (routing_values(i, _num_experts(key)) if is_fake(h) else contextlib.nullcontext()):
            out = _expert_parallel(key, h, i, w, [_copy(p) for p in params], spread)
        return DTensor.from_local(out, tokens[0], tokens[1], run_check=False) if tokens else out
    mesh = next(t.device_mesh for t in (hidden, index, weights, *params) if isinstance(t, DTensor))
    tokens = _token_placements(hidden, index, weights)
    out = op_call(key, _local(hidden, tokens), _local(index, tokens), _local(weights, tokens),
                  [_local(p, None) for p in params], **kwargs)
    return DTensor.from_local(out, mesh, tokens, run_check=False)


def _token_placements(hidden, index, weights) -> list:
    """Where the tokens are: replicated, or split over their rows (a context split) -- the placements of the
    tokens' hidden states once partial sums (a row-split projection's output) are reduced."""
    for t in (hidden, index, weights):
        if isinstance(t, DTensor):
            return [Replicate() if p.is_partial() else p for p in t.placements]
    raise AssertionError("no DTensor among the tokens")


def _local(t, placements):
    """``t``'s local tensor at ``placements`` (None: replicated -- the experts' weights): partial sums reduced, as
    any other consumer of them reduces them; one line where the weights or the hidden size are split (a tensor plan
    that splits the experts or what feeds them, which the experts' operator does not run)."""
    if not isinstance(t, DTensor):
        return t
    want = list(placements) if placements is not None else [Replicate()] * t.device_mesh.ndim
    if any(splits(p) and p.dim != 0 for p in want) or (placements is None and any(
            splits(p) for p in t.placements)):
        raise ConfigError(f"stacked experts inside a pipeline stage run whole on each rank, on its tokens, but "
                          f"receive a tensor placed {tuple(t.placements)}: keep the experts and the modules that "
                          "feed them out of tensor_parallel (split the attention's projections)")
    if tuple(t.placements) != tuple(want):
        t = t.redistribute(t.device_mesh, want)
    return t.to_local()


_experts.register_autograd(_backward, setup_context=_setup)


@contextlib.contextmanager
def opaque_while_traced(network: torch.nn.Module):
    """Every module of stacked experts in ``network`` called as ``autopar::stacked_experts`` while the context lasts
    (the trace); the graph keeps the operator, which runs the module's own forward whenever the stage calls it."""
    patched = []
    install(torch.ops.autopar.stacked_experts.default, _on_local_tensors)  # (DTensor's table: once it is used)
    for module in network.modules():
        if not stacked_experts(module) or "forward" in module.__dict__:
            continue
        names = tuple(name for name, _ in module.named_parameters())
        key = id(module)
        _MODULES[key] = (weakref.ref(module), names)

        def forward(hidden_states, top_k_index, top_k_weights, *rest, _module=module, _key=key, _names=names):
            if rest:
                raise TypeError(f"{type(_module).__name__}: a pipeline stage calls stacked experts with (hidden_states, "
                                "top_k_index, top_k_weights) only")
            own = dict(_module.named_parameters())
            return _experts(_key, hidden_states, top_k_index, top_k_weights, [own[n] for n in _names])

        module.forward = forward
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward
