"""Worker script: checks every collective's values and gradients on the job's ranks; prints CHECKS PASSED."""
import sys

import torch

import autopar
import autopar.comm as C
import autopar.nn as nn
import autopar.ops as ops
from autopar.communication import create_group, get_group_size, get_local_rank, get_local_size, get_rank, init

init()
r, n = get_rank(), get_group_size()
assert n == int(sys.argv[1]), (n, sys.argv)
assert 0 <= get_local_rank() < get_local_size() == n  # one host
close = torch.testing.assert_close
x = torch.tensor([float(r + 1), 2.0 * (r + 1)])

# --- values ---------------------------------------------------------------------------------------------------
total = sum(range(1, n + 1))
close(C.all_reduce(x, "sum"), torch.tensor([total, 2.0 * total]))
close(C.all_reduce(x, "mean"), torch.tensor([total / n, 2.0 * total / n]))
close(C.all_reduce(x, "max"), torch.tensor([float(n), 2.0 * n]))
close(C.all_reduce(x, "min"), torch.tensor([1.0, 2.0]))
prod = float(torch.arange(1, n + 1).prod())
close(C.all_reduce(x, "prod"), torch.tensor([prod, prod * 2.0**n]))
assert torch.equal(x, torch.tensor([float(r + 1), 2.0 * (r + 1)])), "inputs must not be modified"
close(C.all_gather(torch.tensor([[float(r)]])), torch.arange(n, dtype=torch.float32).reshape(n, 1))
close(C.broadcast(x, src=n - 1), torch.tensor([float(n), 2.0 * n]))
rs_in = torch.arange(2 * n, dtype=torch.float32) + r  # rank r holds [r, r+1, ..., r+2n-1]
expected = (torch.arange(2 * n, dtype=torch.float32) * n + sum(range(n)))[2 * r: 2 * r + 2]
close(C.reduce_scatter(rs_in, "sum"), expected)
a2a = torch.arange(n, dtype=torch.float32) + 10 * r  # rank r sends element j to rank j
close(C.all_to_all(a2a), torch.arange(n, dtype=torch.float32) * 10 + r)

# --- gradients (objective = sum over ranks of each rank's loss, as MindSpore's bprop) -------------------------
w = torch.tensor([1.0, 2.0], requires_grad=True)
y = C.all_reduce(w * (r + 1), "sum")
(y * (r + 1)).sum().backward()  # d/dw sum_s (s+1) * sum_r (r+1) w = (r+1) * sum_s (s+1)
close(w.grad, torch.full((2,), float((r + 1) * total)))

w = torch.tensor([float(r + 1)], requires_grad=True)
m = C.all_reduce(w, "max")
(m * 3).sum().backward()  # only the rank holding the max gets sum_s 3 = 3n
close(w.grad, torch.tensor([3.0 * n if r == n - 1 else 0.0]))

w = torch.tensor([[float(r)]], requires_grad=True)
g = C.all_gather(w)  # (n, 1)
(g * torch.arange(1, n + 1, dtype=torch.float32).reshape(n, 1) * (r + 1)).sum().backward()
close(w.grad, torch.tensor([[float((r + 1) * total)]]))  # row r weighted (r+1), summed over all ranks' losses

w = torch.ones(2 * n, requires_grad=True)
s = C.reduce_scatter(w, "sum")
(s * (r + 1)).sum().backward()  # the grad of rank j's slice comes from rank j's loss: (j+1)
close(w.grad, torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(2))

w = torch.tensor([1.0], requires_grad=True)
b = C.broadcast(w * (r + 1), src=0)
(b * (r + 1)).sum().backward()
close(w.grad, torch.tensor([float(total) if r == 0 else 0.0]))


# --- ops inside a Cell's construct, MindSpore style --------------------------------------------------------------
class GatherNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.allgather = ops.AllGather()
        self.allreduce = ops.AllReduce(op="sum")

    def construct(self, v):
        return self.allreduce(self.allgather(v).sum(0, keepdim=True))


v = torch.tensor([[float(r)]], requires_grad=True)
out = GatherNet()(v)
close(out, torch.tensor([[float(n * sum(range(n)))]]))
out.sum().backward()
close(v.grad, torch.tensor([[float(n * n)]]))

# --- groups ----------------------------------------------------------------------------------------------------
if n >= 2 and n % 2 == 0:
    half = [q for q in range(n) if (q < n // 2) == (r < n // 2)]
    name = "low" if r < n // 2 else "high"
    create_group(name, half)
    assert get_group_size(name) == n // 2 and get_rank(name) == half.index(r)
    close(C.all_reduce(torch.tensor([float(r)]), "sum", group=name), torch.tensor([float(sum(half))]))
    assert autopar.comm.get_world_rank_from_group_rank(name, 0) == half[0]
C.barrier()
print(f"rank {r}: CHECKS PASSED", flush=True)
