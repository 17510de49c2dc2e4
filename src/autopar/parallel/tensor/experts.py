"""Expert parallelism: a mixture-of-experts layer's experts spread over the ranks, each rank computing only its own.

A module of stacked expert weights -- Hugging Face's ``MixtralExperts`` / ``Qwen2MoeExperts`` and any module of that
form: parameters ``[num_experts, ...]``, ``forward(hidden_states, top_k_index, top_k_weights)`` returning the
weighted sum of each token's chosen experts -- marked ``autopar.shard(model, {"*.experts": "expert"})`` keeps, on
each of the n ranks, experts ``[r * E/n, (r + 1) * E/n)``: its weights are stored split on the expert dimension.
With a degree ``ep`` < n (MindSpore's ``MoEParallelConfig(expert_parallel=ep)``) each group of ``ep`` consecutive
ranks holds every expert once, rank r experts ``[(r mod ep) * E/ep, ...)``; the groups are data-parallel replicas of
each other, their experts' gradients summed over the groups.

A call is Megatron-LM's all-to-all token dispatcher (``moe_token_dispatcher_type="alltoall"``, :func:`_dispatched`):
each token goes, with its routing, only to the ranks of the experts it chose, and its results come back. Where the
routing cannot be read (a dry run's fake router, where the dry run has not given it values) or is not split with the tokens, it is the all-gather dispatcher
(``"allgather"``): every rank's tokens in the group, with their routing, are gathered; each rank runs the module's own forward over them
with only its experts (a token routed elsewhere takes the forward's "no expert" slot, so it adds nothing here) and its weights; the partial sums
are reduce-scattered back to the tokens' ranks. The backward is the mirror (each expert's weight gradient whole on
its rank, the tokens' gradient summed over the experts that saw them). Exact: each token gets the same terms as in
one process, summed in another order. An expert no token chose computes nothing; uneven routing needs no capacity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import DynamicOutputShapeException, is_fake
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autopar.comm.topology import world_mesh, world_size
from autopar.errors import StrategyError
from autopar.layout.layout import Layout
from autopar.layout.leaves import holding_experts
from autopar.parallel.tensor import placements as P


def is_experts(module: torch.nn.Module) -> bool:
    return bool(getattr(module, "_autopar_experts", False))


def degree_of(module: torch.nn.Module) -> int:
    """Over how many consecutive ranks the module's experts are spread (each group of them holds every expert once:
    ``n / degree`` groups, data-parallel replicas of each other)."""
    mark, n = getattr(module, "_autopar_experts", True), world_size()
    return n if mark is True else int(mark)


def expert_layout(name: str, module: torch.nn.Module, param: torch.Tensor) -> Layout:
    """A stacked expert weight split on its expert dimension over its expert-parallel group, replicated over the
    groups."""
    n, experts, ep = world_size(), getattr(module, "num_experts", param.shape[0]), degree_of(module)
    if param.dim() < 2 or param.shape[0] != experts:
        raise StrategyError(f"expert parallelism splits module '{name}' on its experts, but its parameter of shape "
                            f"{tuple(param.shape)} is not stacked by expert ({experts} experts)")
    if n % ep:
        raise StrategyError(f"expert parallelism over groups of {ep} ranks: the {n} ranks do not divide into them "
                            f"(give a degree that divides {n})")
    if experts % ep:
        raise StrategyError(f"expert parallelism over {ep} ranks: module '{name}' has {experts} experts, which the ranks "
                            f"do not divide (give a number of experts that is a multiple of {ep})")
    if ep == n:
        return Layout((n,), (0,) + (-1,) * (param.dim() - 1), tuple(param.shape))
    return Layout((n // ep, ep), (1,) + (-1,) * (param.dim() - 1), tuple(param.shape))


_GROUPS: dict[tuple[int, int], object] = {}


def _group(ep: int):
    """This rank's expert-parallel group: ``ep`` consecutive ranks (every rank calls this alike: each group is made
    by all of them, once)."""
    n = world_size()
    if ep == n:
        return dist.group.WORLD
    if (n, ep) not in _GROUPS:
        mine = None
        for first in range(0, n, ep):
            group = dist.new_group(list(range(first, first + ep)))
            if first <= dist.get_rank() < first + ep:
                mine = group
        _GROUPS[(n, ep)] = mine
    return _GROUPS[(n, ep)]


def _tokens_split(t: DTensor, mesh) -> DTensor:
    """The tokens split over every rank in rank order (the layout the gather and the scatter below assume)."""
    target = [Shard(0)] * mesh.ndim
    return t if tuple(t.placements) == tuple(target) else t.redistribute(mesh, target)


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result as a plain tensor (its wrapper has no storage of its own, which ZeRO-3's
    saved-tensor hooks read)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def run(module: torch.nn.Module, forward, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
    """The module's ``forward`` over its expert-parallel group's tokens with this rank's experts; the tokens'
    results back where their hidden states came from."""
    mesh = world_mesh()
    hidden = hidden_states if isinstance(hidden_states, DTensor) else P.to_dtensor_replicated(hidden_states)
    if hidden.shape[0] % world_size():
        raise StrategyError(f"expert parallelism over {world_size()} ranks: {hidden.shape[0]} tokens do not divide "
                            "over the ranks (give a batch whose tokens they divide)")
    ep = degree_of(module)
    group = _group(ep)

    groups = world_size() // ep
    mine = (dist.get_rank() if dist.is_initialized() else 0) // ep

    def gathered(t):  # the group's tokens, in rank order; the backward reduce-scatters the gradient
        if not isinstance(t, DTensor):  # made alike on every rank: the group's rows of it
            rows = t.shape[0] // groups
            return t if groups == 1 else t[mine * rows:(mine + 1) * rows]
        local = _tokens_split(t, mesh).to_local()
        return _waited(funcol.all_gather_tensor_autograd(local, gather_dim=0, group=group))

    experts = module.num_experts
    per = experts // ep
    start = ((dist.get_rank() if dist.is_initialized() else 0) % ep) * per
    if _sends_tokens(hidden, top_k_index, top_k_weights, ep):
        try:
            return _dispatched(module, forward, hidden, top_k_index, top_k_weights, group, ep, start, *args, **kwargs)
        except DynamicOutputShapeException:  # a dry run's router whose values it does not know: who sends what
            pass                             # cannot be sized, and the gather, which needs no values, runs
    h, index, weights = gathered(hidden), gathered(top_k_index), gathered(top_k_weights)
    out = _local_experts(module, forward, h, index, weights, start, *args, **kwargs)
    sums = _waited(funcol.reduce_scatter_tensor_autograd(out, "sum", scatter_dim=0, group=group))  # this rank's tokens
    return _as_hidden(sums, hidden, mesh)


def _local_experts(module, forward, h, index, weights, start: int, *args, **kwargs) -> torch.Tensor:
    """The module's ``forward`` over tokens ``h`` with this rank's experts ``[start, start + per)`` only: a token's
    choice of another rank's expert takes the "no expert" slot with weight zero."""
    stacked = {attr: p for attr, p in module._parameters.items() if isinstance(p, DTensor)}
    mine_only = {}
    for attr, p in stacked.items():
        # at its layout (ZeRO stores it split over the groups too); the groups' gradients are partial sums over
        # the replicas of each expert
        target = tuple(expert_layout(attr, module, p).placements())
        at = p if tuple(p.placements) == target else p.redistribute(p.device_mesh, target)
        mine_only[attr] = at.to_local(grad_placements=[Partial() if isinstance(q, Replicate) else q for q in target])
    return experts_holding(module, forward, mine_only, module.num_experts // degree_of(module), h, index, weights,
                           start, *args, **kwargs)


def experts_holding(module, forward, mine_only: dict, per: int, h, index, weights, start: int, *args,
                    **kwargs) -> torch.Tensor:
    """The module's ``forward`` over tokens ``h`` with only the ``per`` experts ``[start, start + per)`` whose
    weights ``mine_only`` (attribute -> local tensor) holds: a token's choice of another rank's expert takes the "no
    expert" slot with weight zero."""
    mine = (index >= start) & (index < start + per)
    local = torch.where(mine, index - start, torch.full_like(index, per))
    # another rank's expert adds nothing here whatever the implementation does with the "no expert" slot
    # (transformers' grouped_mm leaves those rows unwritten): its weight is zero, and transformers is told that
    # its experts are split (_is_expert_parallel)
    weights = weights.masked_fill(~mine, 0)
    with holding_experts(module, mine_only, per):
        out = forward(module, h, local, weights, *args, **kwargs)
        if torch.is_grad_enabled() and not out.requires_grad:
            # no token chose this rank's experts (the module skipped every one of them): its result still goes
            # through the collectives whose backward every rank of the group joins, and brings back the other
            # ranks' terms, differentiable in this rank's tokens and routing -- and its experts' gradients are
            # zeros, not missing (clipping reduces every expert's norm on every rank alike)
            out = out + 0 * sum(t.sum() for t in (h, weights, *mine_only.values()) if t.requires_grad)
    return out


def _as_hidden(local: torch.Tensor, hidden: DTensor, mesh) -> DTensor:
    """This rank's tokens' results, laid out as the hidden states came."""
    split = DTensor.from_local(local, mesh, [Shard(0)] * mesh.ndim, run_check=False, shape=hidden.shape,
                               stride=hidden.stride())
    if tuple(split.placements) == tuple(hidden.placements):
        return split
    if len(P.strided_axes(hidden.placements)) > 1:
        # the flattened tokens of a sequence split over several mesh axes (a norm's "sequence" before the router on
        # a 2 x 2 world mesh): torch's redistribution into that strided split fails; from the whole it slices
        split = split.redistribute(mesh, [Replicate()] * mesh.ndim)
    return split.redistribute(mesh, hidden.placements)


def _sends_tokens(hidden, top_k_index, top_k_weights, ep: int) -> bool:
    """Can the tokens go only to their experts' ranks (:func:`_dispatched`)? The routing must be split with the
    tokens (each rank routes its own) and one row of k choices per token."""
    return (ep > 1 and all(isinstance(t, DTensor) for t in (top_k_index, top_k_weights))
            and hidden.dim() == top_k_index.dim() == 2)  # (tokens, features) and (tokens, k), as transformers calls


def _dispatched(module, forward, hidden: DTensor, top_k_index: DTensor, top_k_weights: DTensor, group, ep: int,
                start: int, *args, **kwargs) -> DTensor:
    """Megatron-LM's all-to-all token dispatcher (``moe_token_dispatcher_type="alltoall"``, torchtitan's and
    DeepSpeed's): each rank sends a token, with its routing, only to the ranks holding an expert it chose (a token
    whose two experts live on one rank goes there once), each rank runs its experts over what it received, and an
    all-to-all brings the results back, summed into their tokens. Against the gather, a rank receives about
    k/ep of the group's tokens rather than all of them, and the traffic falls alike. The backward is the mirror
    (``all_to_all_single_autograd``). Exact: each token gets the same terms as in one process."""
    mesh = world_mesh()
    h, index, weights = (_tokens_split(t, mesh).to_local() for t in (hidden, top_k_index, top_k_weights))
    per = module.num_experts // ep
    local = exchanged(h, index, weights, group, ep, per, lambda h_in, index_in, weights_in: _local_experts(
        module, forward, h_in, index_in, weights_in, start, *args, **kwargs))
    return _as_hidden(local, hidden, mesh)


def exchanged(h: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, group, ep: int, per: int,
              experts) -> torch.Tensor:
    """:func:`_dispatched` on this rank's local tokens ``h`` and their routing, over an expert-parallel ``group``
    of ``ep`` ranks holding ``per`` experts each: ``experts(tokens, routing, weights)`` runs this rank's on what it
    receives; the tokens' summed results come back. Differentiable (the all-to-alls' backward is the mirror)."""
    owner = torch.where(index < ep * per, index // per, torch.full_like(index, ep))  # (dropped: no rank)
    picks = [(owner == d).any(-1).nonzero().squeeze(-1) for d in range(ep)]
    sent = [len(p) for p in picks]
    order = torch.cat(picks)

    def exchange(t, out_split, in_split, grad=True):
        move = funcol.all_to_all_single_autograd if grad else funcol.all_to_all_single
        return _waited(move(t.contiguous(), out_split, in_split, group))

    if is_fake(h):  # a dry run, whose fake group moves nothing: every rank routes as this one does, so it receives
        me = (dist.get_rank() if dist.is_initialized() else 0) % ep  # from each what it sends itself
        received, index_in = [sent[me]] * ep, torch.cat([index[picks[me]]] * ep)
    else:
        counts = torch.tensor(sent, dtype=torch.int64, device=h.device)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=group)
        received = got.tolist()
        index_in = exchange(index[order], received, sent, grad=False)
    h_in = exchange(h[order], received, sent)
    weights_in = exchange(weights[order], received, sent, grad=weights.requires_grad)
    back = exchange(experts(h_in, index_in, weights_in), sent, received)
    return torch.zeros_like(h, dtype=back.dtype).index_add(0, order, back)
