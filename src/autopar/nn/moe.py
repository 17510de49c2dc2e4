"""MindSpore's mixture of experts: ``nn.transformer.MoEConfig``, ``MoE`` and the ``expert_parallel`` degree of its
parallel config.

``MoE(hidden_size, ffn_hidden_size, dropout_rate, hidden_act, moe_config=MoEConfig(expert_num, capacity_factor,
aux_loss_factor, num_experts_chosen), parallel_config=...)`` returns ``(output, aux_loss)`` as MindSpore's does. What
it computes is the Switch Transformer / GShard router (Fedus et al. 2021; Lepikhin et al. 2020):

- a bias-free dense layer scores the experts, softmax, the ``num_experts_chosen`` best per token, their weights
  renormalised to sum to one;
- each expert takes at most ``capacity = ceil(capacity_factor * tokens * num_experts_chosen / expert_num)``
  assignments, first choices before second ones and, within a choice, in token order; the rest are dropped (the
  token gets nothing from that expert; the residual around the layer carries it) and counted in ``moe.dropped``
  (not inside pipeline stages, which run the traced network: said when the pipeline is built);
- ``aux_loss = aux_loss_factor * expert_num * sum_e(fraction of first choices to e * mean router probability of e)``.

The experts are one module of stacked weights (:class:`StackedExperts`, Hugging Face's form), so
``expert_parallel = ep`` spreads them over each group of ``ep`` consecutive ranks (``ep = n``: as
``autopar.shard(model, {"*.experts": "expert"})`` does; :mod:`autopar.parallel.tensor.experts`); the router and the capacity run on every rank's tokens as the layouts run
any operator, so dropping follows the global batch, as one process drops. Not checked against MindSpore itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from autopar.errors import ConfigError
from autopar.nn.cell import Cell

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "fast_gelu": F.gelu, "silu": F.silu, "swish": F.silu}


@dataclass
class MoEConfig:
    """``MoEConfig(expert_num=1, capacity_factor=1.1, aux_loss_factor=0.05, num_experts_chosen=1)``."""

    expert_num: int = 1
    capacity_factor: float = 1.1
    aux_loss_factor: float = 0.05
    num_experts_chosen: int = 1
    expert_group_size: int | None = None
    group_wise_a2a: bool = False
    comp_comm_parallel: bool = False
    comp_comm_parallel_degree: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.expert_num, bool) or not isinstance(self.expert_num, int) or self.expert_num < 1:
            raise ConfigError(f"MoEConfig: expert_num must be a positive integer, got {self.expert_num!r}")
        if not isinstance(self.num_experts_chosen, int) or not 1 <= self.num_experts_chosen <= self.expert_num:
            raise ConfigError(f"MoEConfig: num_experts_chosen must be 1..expert_num ({self.expert_num}), got "
                              f"{self.num_experts_chosen!r}")
        if not isinstance(self.capacity_factor, (int, float)) or self.capacity_factor <= 0:
            raise ConfigError(f"MoEConfig: capacity_factor={self.capacity_factor!r} gives the experts no capacity: "
                              "every token would be dropped (MindSpore's default is 1.1)")
        if not isinstance(self.aux_loss_factor, (int, float)) or self.aux_loss_factor < 0:
            raise ConfigError(f"MoEConfig: aux_loss_factor must be >= 0, got {self.aux_loss_factor!r}")
        from autopar.errors import warn_once

        for name, default in (("expert_group_size", None), ("group_wise_a2a", False), ("comp_comm_parallel", False)):
            if getattr(self, name) != default:
                warn_once(f"MoEConfig.{name}", f"MoEConfig({name}={getattr(self, name)!r}) is accepted and not "
                          "applied: capacity follows the global batch and tokens are gathered, not exchanged by group")


class StackedExperts(torch.nn.Module):
    """``expert_num`` feed-forward experts in stacked weights; ``forward(tokens, top_k_index, top_k_weights)``: each
    token's chosen experts, weighted and summed (an index of ``num_experts`` means "no expert": a dropped choice)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, act: str, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_experts, self.act = num_experts, act
        bound_in, bound_out = 1 / math.sqrt(hidden), 1 / math.sqrt(ffn)
        self.mapping = torch.nn.Parameter(torch.empty(num_experts, hidden, ffn, dtype=dtype).uniform_(-bound_in, bound_in))
        self.mapping_bias = torch.nn.Parameter(torch.zeros(num_experts, ffn, dtype=dtype))
        self.projection = torch.nn.Parameter(torch.empty(num_experts, ffn, hidden, dtype=dtype).uniform_(-bound_out,
                                                                                                           bound_out))
        self.projection_bias = torch.nn.Parameter(torch.zeros(num_experts, hidden, dtype=dtype))

    def forward(self, tokens, top_k_index, top_k_weights):
        out = torch.zeros_like(tokens)
        chosen = F.one_hot(top_k_index, num_classes=self.num_experts + 1)  # [tokens, k, experts + "none"]
        act = _ACTIVATIONS[self.act]
        for e in range(self.num_experts):
            token, slot = torch.where(chosen[..., e] > 0)
            if token.numel() == 0:
                continue
            h = act(tokens[token] @ self.mapping[e] + self.mapping_bias[e])
            y = (h @ self.projection[e] + self.projection_bias[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y)
        return out


class MoE(Cell):
    """``MoE(hidden_size, ffn_hidden_size, dropout_rate, hidden_act='gelu', param_init_type=float32, moe_config=
    MoEConfig(), parallel_config=None)`` -> ``(output, aux_loss)``."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, dropout_rate: float = 0.0, hidden_act: str = "gelu",
                 param_init_type: torch.dtype = torch.float32, moe_config: MoEConfig | None = None,
                 parallel_config=None):
        super().__init__()
        self.config = moe_config or MoEConfig()
        if hidden_act not in _ACTIVATIONS:
            raise ConfigError(f"MoE: hidden_act {hidden_act!r} is not one of {', '.join(sorted(_ACTIVATIONS))}")
        self.router = torch.nn.Linear(hidden_size, self.config.expert_num, bias=False, dtype=param_init_type)
        self.experts = StackedExperts(self.config.expert_num, hidden_size, ffn_hidden_size, hidden_act,
                                      param_init_type)
        self.dropout = torch.nn.Dropout(dropout_rate)
        self.dropped = 0  # assignments the last call dropped for want of capacity
        ep = getattr(parallel_config, "expert_parallel", 1)
        if ep > 1:
            _spread(self, ep)

    def construct(self, x):
        cfg, shape = self.config, x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = self.router(tokens).softmax(dim=-1)
        weights, index = probs.topk(cfg.num_experts_chosen, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        n, experts, k = tokens.shape[0], cfg.expert_num, cfg.num_experts_chosen
        capacity = math.ceil(cfg.capacity_factor * n * k / experts)
        chosen = F.one_hot(index, experts).to(probs.dtype)  # [tokens, k, experts]
        earlier = torch.zeros_like(chosen[:, 0].sum(dim=0))  # assignments to each expert by earlier choices
        keep = []
        for j in range(k):
            place = (chosen[:, j].cumsum(dim=0) + earlier) * chosen[:, j]  # 1-based place in its expert's queue
            keep.append(place.sum(dim=-1) <= capacity)
            earlier = earlier + chosen[:, j].sum(dim=0)
        kept = torch.stack(keep, dim=-1)
        if not torch.compiler.is_exporting():  # (a pipeline's trace: a stage runs the graph, which counts nothing)
            dropped = (~kept).sum()  # under layouts a DTensor: read whole (item() of a pending sum: this rank's part)
            self.dropped = int(dropped.full_tensor() if isinstance(dropped, DTensor) else dropped)
        index = torch.where(kept, index, torch.full_like(index, experts))
        out = self.dropout(self.experts(tokens, index, weights)).reshape(shape)
        fraction, mean_prob = chosen[:, 0].mean(dim=0), probs.mean(dim=0)
        aux = cfg.aux_loss_factor * experts * (fraction * mean_prob).sum()
        return out, aux

    forward = construct


@dataclass
class MoEParallelConfig:
    """``MoEParallelConfig(data_parallel=1, model_parallel=1, expert_parallel=1)``: ``expert_parallel`` spreads the
    experts over groups of that many consecutive ranks (replicas of each other); the data and model degrees are the layouts' business (strategies, dataset_strategy),
    so values other than 1 are said once."""

    data_parallel: int = 1
    model_parallel: int = 1
    expert_parallel: int = 1
    use_seq_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("data_parallel", "model_parallel", "expert_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"MoEParallelConfig: {name} must be a positive integer, got {value!r}")
        if self.data_parallel != 1 or self.model_parallel != 1 or self.use_seq_parallel:
            from autopar.errors import warn_once

            warn_once("MoEParallelConfig", "MoEParallelConfig's data_parallel / model_parallel / use_seq_parallel are "
                      "accepted and not applied to the MoE layer: give the other layers strategies (autopar.shard, "
                      "ops.*.shard) and the inputs dataset_strategy")


default_moeparallel_config = MoEParallelConfig()


def _spread(moe: MoE, ep: int) -> None:
    from autopar.comm.topology import world_size
    from autopar.ops.shard import split_experts

    world = world_size()
    if world % ep:
        raise ConfigError(f"expert_parallel={ep} does not divide the {world} ranks (each group of expert_parallel "
                          "consecutive ranks holds every expert once)")
    split_experts(moe.experts, ep)
