"""Worker: the shared-memory all-reduce and the bucketed reducer on it, checked against gloo on the same data.

argv: MODE. ``check`` (under ``autopar launch -n N``): prints ``HOST_MEMORY_OK <rank>`` when every case holds.
``die`` / ``stall`` (started by hand, RANK WORLD PORT after MODE): rank 1 exits / never arrives; rank 0 must fail
with a one-line CommError (``AUTOPAR_COMM_TIMEOUT`` bounds the stall).
"""
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist

from autopar.comm.host_memory import HostGroup
from autopar.errors import CommError
from autopar.parallel.grads.buckets import bucket_reducers


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().numpy().tobytes()).hexdigest()


def same_on_every_rank(value: str) -> bool:
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, value)
    return len(set(seen)) == 1


def check_engine(rank: int, world: int) -> None:
    n = 1_000_003  # not a multiple of the ranks
    host = HostGroup.create(n)
    assert host is not None, "ranks of one host got no shared segment"
    data = torch.randn(n, generator=torch.Generator().manual_seed(100 + rank))
    host.region.copy_(data)
    expected = data.double()
    dist.all_reduce(expected)
    # ranges of every shape: empty, shorter than the ranks, uneven, the rest; in one of them every contribution is
    # halved, and this rank's own slice is summed from a tensor outside the region (its region there is garbage)
    cuts = [0, 0, 1, 3, 77_777, 500_000, n]
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        if i != 4:
            host.all_reduce_range(a, b)
            continue
        lo, hi = host.owned(a, b)
        mid = (lo + hi) // 2  # two pieces with a gap between them: the gap is summed from the region
        host.region[a:b] *= 0.5
        pieces = [(lo, data[lo:lo + 1000].clone()), (mid, data[mid:hi].clone())]
        host.region[lo:lo + 1000] = float("nan")
        host.region[mid:hi] = float("nan")
        host.all_reduce_range(a, b, pieces, own_scale=0.5)
    host.settle()
    expected[77_777:500_000] *= 0.5
    err = (host.region.double() - expected).abs().max().item()
    assert err < 1e-5, f"sum off by {err}"
    assert same_on_every_rank(digest(host.region)), "ranks hold different sums"
    if world == 2:  # a + b: exactly what gloo computes
        gloo = data.clone()
        dist.all_reduce(gloo)
        gloo[77_777:500_000] *= 0.5  # exact: a power of two
        assert torch.equal(gloo, host.region), "two-rank sum differs from gloo's"


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8, 5)
        self.spare = torch.nn.Linear(5, 5)  # used by rank 0 only
        self.never = torch.nn.Linear(5, 5)  # used by no rank

    def forward(self, x, use_spare: bool):
        y = self.fc(torch.relu(self.conv(x)).mean((2, 3)))
        return self.spare(y) if use_spare else y


def local_grads(net: Net, x, use_spare: bool) -> dict[str, torch.Tensor]:
    """This rank's own gradients, from a copy (a copy carries none of the reducer's hooks)."""
    import copy

    net = copy.deepcopy(net)
    names = [n for n, _ in net.named_parameters()]
    grads = torch.autograd.grad(net(x, use_spare).square().sum(), list(net.parameters()), allow_unused=True)
    return {n: (torch.zeros_like(p) if g is None else g) for n, p, g in zip(names, net.parameters(), grads)}


def reducer_of(net: torch.nn.Module, scale: float, bucket_bytes: int):
    params = list(net.parameters())
    reducers = bucket_reducers(params, scale=scale, bucket_mb=bucket_bytes / 2**20, shared_memory=True)
    assert len(reducers) == 1 and reducers[0].transport_name == "shared memory", reducers
    reducers[0].watch(net)
    return reducers[0]


def check_reducer(rank: int, world: int) -> None:
    """The engine every loop runs: plain backward() calls, no wrapper, no call into autopar."""
    torch.manual_seed(0)
    net = Net().to(memory_format=torch.channels_last)  # gradients keep the weights' layout
    params = list(net.parameters())
    reducer = reducer_of(net, 1.0 / world, 1200)  # several buckets
    # a fresh gradient (.grad None); accumulated onto the last step's summed .grad (a second backward before a step:
    # the summed part is kept apart, not summed again); zero_grad(set_to_none=False)
    for step, start in enumerate(["none", "kept", "zeroed"]):
        if start == "zeroed":
            net.zero_grad(set_to_none=False)
        x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        x = x.to(memory_format=torch.channels_last)
        expected = local_grads(net, x, rank == 0)
        for g in expected.values():
            dist.all_reduce(g)
            g /= world
        if start != "none":
            expected = {n: g + (p.grad if p.grad is not None else 0)
                        for (n, g), p in zip(expected.items(), net.parameters())}
        net(x, rank == 0).square().sum().backward()
        for name, p in net.named_parameters():
            if name.startswith("never."):  # used by no rank: no gradient, as in one process
                assert p.grad is None, f"step {step} {name}: a gradient for a parameter no rank used"
                continue
            err = (p.grad - expected[name]).abs().max().item()
            assert err < 1e-5, f"step {step} {name}: gradient off by {err}"
            assert p.grad.stride() == p.stride(), f"{name}: gradient layout {p.grad.stride()} != {p.stride()}"
        assert same_on_every_rank(digest(torch.cat([p.grad.flatten() for p in params if p.grad is not None])))
    with reducer.no_sync():  # accumulation: nothing summed, gradients stay this rank's own
        net.zero_grad(set_to_none=True)
        net(x, False).square().sum().backward()
        own = local_grads(net, x, False)
        assert all(torch.allclose(p.grad, own[n]) for n, p in net.named_parameters() if p.grad is not None)
    # the next backward outside sums what accumulated: (local + new) summed
    net(x, False).square().sum().backward()
    summed = {n: 2 * g for n, g in own.items()}
    for g in summed.values():
        dist.all_reduce(g)
        g /= world
    assert all(torch.allclose(p.grad, summed[n], atol=1e-5) for n, p in net.named_parameters() if p.grad is not None)
    # torch.autograd.grad: the returned gradients are summed (nothing is accumulated into .grad)
    net.zero_grad(set_to_none=True)
    names = ["conv.weight", "fc.bias"]
    grads = torch.autograd.grad(net(x, False).square().sum(), [net.conv.weight, net.fc.bias])
    for name, g in zip(names, grads):
        want = own[name].clone()
        dist.all_reduce(want)
        assert torch.allclose(g, want / world, atol=1e-5), f"autograd.grad: {name} not summed"
    assert net.conv.weight.grad is None
    # a reducer made for one measurement (the planner's data-parallel step) ends its summing thread when closed
    transport = reducer.transport
    thread = transport._thread
    reducer.close()
    transport.close()
    assert thread is not None and not thread.is_alive() and transport._thread is None


def check_sums_without_mean(rank: int, world: int) -> None:
    """gradients_mean=False (MindSpore's default): two backwards before a step are still exact -- the part summed
    by the first is not summed again by the second (it would count world times)."""
    import copy

    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    reducer_of(net, 1.0, 1 << 20)
    xs = [torch.randn(3, 6, generator=torch.Generator().manual_seed(50 + 7 * k + rank)) for k in range(2)]
    expected = None
    twin = copy.deepcopy(net)  # a copy carries none of the reducer's hooks
    for x in xs:
        g = [t.clone() for t in torch.autograd.grad(twin(x).sum(), list(twin.parameters()))]
        for t in g:
            dist.all_reduce(t)
        expected = g if expected is None else [a + b for a, b in zip(expected, g)]
    for x in xs:  # no zero_grad between them
        net(x).sum().backward()
    for p, want in zip(net.parameters(), expected):
        err = (p.grad - want).abs().max().item()
        assert err < 1e-5, f"accumulated sums off by {err}"
    # a part of the network called on its own (no sink on its outputs): the first gradient arms the sum
    net.zero_grad(set_to_none=True)
    x = xs[0]
    net[0](x).sum().backward()
    want = torch.autograd.grad(net[0](x).sum(), [net[0].weight])[0]  # summed, as returned gradients are
    assert torch.allclose(net[0].weight.grad, want, atol=1e-5), "a sub-module's backward was not summed"


class Checkpointed(torch.nn.Module):
    """The layer nearest the loss inside a reentrant checkpoint: its backward is a nested backward pass."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.b, torch.relu(self.a(x)), use_reentrant=True)


def plain_grads(net: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """This rank's own gradients, from a copy (reentrant checkpoints refuse torch.autograd.grad)."""
    import copy

    twin = copy.deepcopy(net)
    twin.zero_grad(set_to_none=True)
    twin(x).square().sum().backward()
    return [p.grad for p in twin.parameters()]


def check_reducer_edges(rank: int, world: int) -> None:
    torch.manual_seed(1)
    net = Checkpointed()
    params = list(net.parameters())
    reducer = reducer_of(net, 1.0, 200)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))
    names = [n for n, _ in net.named_parameters()]
    expected = plain_grads(net, x)
    for g in expected:
        dist.all_reduce(g)
    net(x).square().sum().backward()
    for name, p, g in zip(names, params, expected):
        err = (p.grad - g).abs().max().item()
        assert err < 1e-5, f"reentrant checkpoint: {name} off by {err}"
    # a forward that raised leaves nothing armed: the next no_sync backward is not summed
    try:
        net(torch.randn(5, 7))
    except RuntimeError:
        pass
    net.zero_grad(set_to_none=True)
    with reducer.no_sync():
        net(x).square().sum().backward()
    own = plain_grads(net, x)
    assert all(torch.allclose(p.grad, g) for p, g in zip(params, own)), "a no_sync backward was summed"
    # a parameter frozen after wrapping keeps no gradient (no zero one for the optimizer to apply)
    net.zero_grad(set_to_none=True)
    net.a.weight.requires_grad_(False)
    net(x).square().sum().backward()
    assert net.a.weight.grad is None and net.b.weight.grad is not None


def main() -> None:
    mode = sys.argv[1]
    torch.set_num_threads(1)
    if mode == "check":
        import autopar

        autopar.init()
        rank, world = dist.get_rank(), dist.get_world_size()
        check_engine(rank, world)
        check_reducer(rank, world)
        check_sums_without_mean(rank, world)
        check_reducer_edges(rank, world)
        print(f"HOST_MEMORY_OK {rank}", flush=True)
        return
    rank, world, port = (int(a) for a in sys.argv[2:5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    host = HostGroup.create(1000)
    if rank == 1:
        if mode == "die":
            os._exit(7)
        time.sleep(60)  # stall: alive, never arrives
        return
    start = time.monotonic()
    try:
        host.all_reduce_range(0, 1000)
    except CommError as e:
        print(f"COMM_ERROR after {time.monotonic() - start:.1f}s: {e}", flush=True)
        os._exit(3)
    print("NO_ERROR", flush=True)


if __name__ == "__main__":
    main()
