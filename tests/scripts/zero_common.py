"""What the optimizer-sharding workers share: the optimizers, the training loops users write, and how much of a
parameter or of the optimizer state this rank holds."""
import torch
from torch.distributed.tensor import DTensor

from autopar.train import Model

OPTIMIZERS = {"SGD": lambda ps: torch.optim.SGD(ps, lr=0.1),
              "Momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
              "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01)}


def train(net: torch.nn.Module, opt_name: str, loop: str, batches: list, accumulate: int = 1):
    """5 steps of ``loop``: ``model`` (Model.train), ``plain_before`` / ``plain_after`` (a torch loop with the
    optimizer made before / after the first forward). Returns the optimizer."""
    if loop == "model":
        opt = OPTIMIZERS[opt_name](net.parameters())
        Model(net, torch.nn.CrossEntropyLoss(), opt, grad_accumulation_steps=accumulate).train(1, batches)
        return opt
    opt = OPTIMIZERS[opt_name](net.parameters()) if loop == "plain_before" else None
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt = opt or OPTIMIZERS[opt_name](net.parameters())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def local_numel(t: torch.Tensor) -> int:
    return t.to_local().numel() if isinstance(t, DTensor) else t.numel()


def state_held(opt) -> tuple[int, int]:
    """(elements of optimizer state this rank holds, state slots per parameter element)."""
    held = sum(local_numel(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim())
    slots = (2 if any("exp_avg" in s for s in opt.state.values()) else 1) if any(opt.state.values()) else 0
    return held, slots
