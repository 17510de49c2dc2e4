"""MindSpore's ``nn.transformer.MoE`` in one process: each token gets the weighted sum of its chosen experts (checked
against a token-by-token computation), tokens beyond an expert's capacity are dropped and counted, the auxiliary loss
is the Switch Transformer's; bad configurations are one line. (Expert parallelism over ranks:
tests/parallel/test_expert_parallel.py.)"""
import math

import pytest
import torch
import torch.nn.functional as F

from autopar.errors import ConfigError
from autopar.nn.transformer import MoE, MoEConfig, MoEParallelConfig


def _by_token(moe: MoE, x: torch.Tensor, capacity: float) -> torch.Tensor:
    """Each token, one at a time: its top-k experts' outputs weighted by the renormalised router probabilities,
    a choice dropped once its expert has taken ``capacity`` assignments (first choices before second ones)."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = moe.router(tokens).softmax(-1)
    w, idx = probs.topk(moe.config.num_experts_chosen, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    taken = [0] * moe.config.expert_num
    keep = torch.zeros_like(idx, dtype=torch.bool)
    for j in range(idx.shape[1]):
        for t in range(idx.shape[0]):
            e = int(idx[t, j])
            taken[e] += 1
            keep[t, j] = taken[e] <= capacity
    ex, out = moe.experts, torch.zeros_like(tokens)
    for t in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            if keep[t, j]:
                e = int(idx[t, j])
                h = F.gelu(tokens[t] @ ex.mapping[e] + ex.mapping_bias[e])
                out[t] += w[t, j] * (h @ ex.projection[e] + ex.projection_bias[e])
    return out.reshape(x.shape), int((~keep).sum())


@pytest.mark.parametrize("capacity_factor", [0.5, 4.0])
def test_moe_computes_each_tokens_experts_and_drops_beyond_capacity(capacity_factor):
    torch.manual_seed(0)
    moe = MoE(8, 12, moe_config=MoEConfig(expert_num=4, capacity_factor=capacity_factor, num_experts_chosen=2),
              param_init_type=torch.float64)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    out, aux = moe(x)
    want, dropped = _by_token(moe, x, math.ceil(capacity_factor * 10 * 2 / 4))
    assert torch.allclose(out, want, atol=1e-12) and moe.dropped == dropped
    assert (dropped > 0) == (capacity_factor < 1)
    probs = moe.router(x.reshape(-1, 8)).softmax(-1)
    first = F.one_hot(probs.argmax(-1), 4).double().mean(0)
    assert torch.allclose(aux, 0.05 * 4 * (first * probs.mean(0)).sum())
    out.sum().backward()  # every parameter reached
    assert all(p.grad is not None for p in moe.parameters())


@pytest.mark.parametrize("make, message", [
    (lambda: MoEConfig(expert_num=4, capacity_factor=0), "gives the experts no capacity: every token would be dropped"),
    (lambda: MoEConfig(expert_num=2, num_experts_chosen=3), "num_experts_chosen must be 1..expert_num (2)"),
    (lambda: MoEConfig(expert_num=0), "expert_num must be a positive integer"),
    (lambda: MoE(4, 8, moe_config=MoEConfig(expert_num=2), parallel_config=MoEParallelConfig(expert_parallel=2)),
     "expert_parallel=2 does not divide the 1 ranks"),
    (lambda: MoE(4, 8, hidden_act="tanhh"), "hidden_act 'tanhh' is not one of"),
])
def test_bad_moe_configurations_are_one_line(make, message):
    with pytest.raises(ConfigError) as info:
        make()
    assert message in str(info.value) and "\n" not in str(info.value)
