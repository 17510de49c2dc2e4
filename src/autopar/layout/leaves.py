"""Which modules the layout runtime leaves alone: annotated ones run through their strategy, element-wise ones run
on whatever layout they are given; every other leaf module runs data-parallel on the local batch."""
from __future__ import annotations

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
    return isinstance(module, torch.nn.Module) and isinstance(experts, int) and bool(stacked) and all(
        p.dim() >= 2 and p.shape[0] == experts for p in stacked)
