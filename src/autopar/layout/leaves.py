"""Which modules the layout runtime leaves alone: annotated ones run through their strategy, element-wise ones run
on whatever layout they are given; every other leaf module runs data-parallel on the local batch."""
from __future__ import annotations

import contextlib

import torch


def is_annotated(module: torch.nn.Module) -> bool:
    return getattr(module, "_autopar_op", None) is not None


# Element-wise modules without parameters run on whatever layout they receive (DTensor dispatch): sending their
# input back to the batch split first would undo a Megatron column split for nothing.
LAYOUT_TRANSPARENT = (torch.nn.ReLU, torch.nn.ReLU6, torch.nn.GELU, torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.SiLU,
                      torch.nn.LeakyReLU, torch.nn.Identity)


def mixes_tokens(module: torch.nn.Module) -> bool:
    """Does ``module`` combine positions along the sequence (a recurrence, attention, a convolution or pooling, a
    softmax over another dimension than the last)? Such a module cannot run on a slice of the sequence."""
    pools = tuple(getattr(torch.nn.modules.pooling, name) for name in ("_MaxPoolNd", "_AvgPoolNd",
                                                                        "_AdaptiveAvgPoolNd", "_AdaptiveMaxPoolNd"))
    if isinstance(module, (torch.nn.RNNBase, torch.nn.MultiheadAttention, torch.nn.modules.conv._ConvNd, *pools)):
        return True
    if isinstance(module, (torch.nn.Softmax, torch.nn.LogSoftmax, torch.nn.Softmin)):
        return module.dim not in (None, -1)
    return False


def stacked_experts(module: torch.nn.Module) -> bool:
    """A module of stacked expert weights (transformers' ``MixtralExperts``: ``num_experts`` and parameters
    ``[num_experts, ...]``, called ``(hidden_states, top_k_index, top_k_weights)``): what expert parallelism splits."""
    stacked = [p for p in getattr(module, "_parameters", {}).values() if p is not None]
    experts = getattr(module, "num_experts", None)
    # (stacked weight matrices -- at least one 3-D -- not a router's [num_experts, hidden] weight)
    return isinstance(module, torch.nn.Module) and isinstance(experts, int) and any(p.dim() >= 3 for p in stacked) \
        and all(p.dim() >= 2 and p.shape[0] == experts for p in stacked)


@contextlib.contextmanager
def holding_experts(module: torch.nn.Module, weights: dict, count: int, split: bool = True):
    """``module`` (stacked experts) computing with ``weights`` (attribute -> tensor) in place of its stacked
    parameters and with ``count`` experts, its own put back after -- the expert runtime's local experts, the
    planner's timing of them; transformers' experts are told theirs are ``split`` (``_is_expert_parallel``)."""
    own = {attr: module._parameters[attr] for attr in weights}
    before = module.num_experts
    flagged = hasattr(module, "_is_expert_parallel")
    flag = getattr(module, "_is_expert_parallel", None)
    try:
        module._parameters.update(weights)
        module.num_experts = count
        if flagged:
            module._is_expert_parallel = split
        yield module
    finally:
        module.num_experts = before
        if flagged:
            module._is_expert_parallel = flag
        module._parameters.update(own)


def uniform_routing(rows: int, experts: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A router's ``[rows, k]`` choice where its values are not computed (a dry run's fake router, a meta-built
    network's trace): each row's ``k`` experts drawn uniformly without repeats, as an untrained or load-balanced
    router gives -- so the sizes routing sets (``nonzero``: the tokens each expert takes) are a healthy job's."""
    draws = torch.rand(rows, experts, generator=torch.Generator().manual_seed(seed))
    return draws.topk(k, dim=-1).indices.to(dtype)


_TOKEN_WISE = (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.Dropout,
               torch.nn.modules.loss._Loss, *LAYOUT_TRANSPARENT)
# transformers' own per-token modules, by the names every model file gives them (a norm over the last dimension; the
# rotary table computed from the position ids it is given, global positions under a sequence split)
_TOKEN_WISE_NAMES = ("RMSNorm", "LayerNorm", "RotaryEmbedding")


def token_wise(module: torch.nn.Module) -> bool:
    """Is ``module`` known to compute each token from that token alone (so it may run on a slice of the sequence)?
    torch's linear, embedding, norm, dropout, activation and loss modules, transformers' norms and rotary tables.
    A module of the user's own is not known: AUTO does not split the sequence around it."""
    if isinstance(module, _TOKEN_WISE) or stacked_experts(module):
        return True
    cls = type(module)
    return cls.__module__.startswith("transformers.") and cls.__name__.endswith(_TOKEN_WISE_NAMES)
