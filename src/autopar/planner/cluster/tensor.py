"""Tensor parallelism as Megatron-Core runs it: the collectives of a layer split by columns then rows, and the GEMMs
that hide them.

A transformer layer under Megatron's layout has two blocks, attention and MLP: a column-split projection in (q, k, v
fused into one GEMM; gate and up into one), a row-split one out (Shoeybi et al. 2019). Their collectives, for a
block input of ``X`` bytes on a tensor group of ``t`` (Korthikanti et al. 2022, arXiv 2205.05198 sec. 4.2.2):

- without sequence parallelism: the row-split output is all-reduced in the forward; the column-split input's
  gradient is all-reduced in the backward, launched asynchronously before the weight gradient's GEMM and hidden
  behind it (Megatron-Core ``tensor_parallel/layers.py``, ``LinearWithGradAccumulationAndAsyncCommunication``:
  "Asynchronous all-reduce ... the all-reduce is scheduled before the weight gradient computation");
- with sequence parallelism: the input is all-gathered before the column-split GEMM and the output reduce-scattered
  after the row-split one; the backward all-gathers the output's gradient before the row-split GEMM's input
  gradient, reduce-scatters the column-split input's gradient behind the weight-gradient GEMM ("the reduce scatter
  is scheduled before the weight gradient computation"), and all-gathers the input again -- only its shard was kept
  -- behind the input-gradient GEMM ("the gather is scheduled before the input gradient computation");
- the forward's collectives are exposed. Transformer Engine's ``--tp-comm-overlap`` (userbuffers: the forward's too
  split into chunks and pipelined with their GEMMs), which Megatron-Core's and NeMo's performance recipes enable, is
  not counted as hiding them: the GEMMs it chunks are smaller and share their SMs and HBM with the reduction, and
  the published runs that use it -- Megatron-LM's weak-scaling table on H100, NeMo's and dgxc's Llama and Nemotron
  runs -- are predicted within 10 % (``bench/published_heldout.py``, ``bench/published_runs.py``) with the forward
  exposed, where hiding it too put them 8-25 % fast.

That is ``overlap="megatron"``, the default. PyTorch's DTensor tensor parallelism, as torchtitan and KempnerForge run
it without async TP (and as autopar's own layouts run it), is ``"none"`` (``--tp-overlap none``): each collective
issued where autograd reaches it and waited on by the next operator, the backward's as exposed as the forward's.
torchtitan's async TP (each gather fused into the GEMM it feeds, each scatter into the GEMM it follows, chunk by
chunk over symmetric memory) is read as Megatron's: counted as hiding every collective, the development set's two
async-TP runs (``bench/published_heldout.py``, torchtitan's 405B on 512 H100s) went from +11 and +44 % to +28 and
+65 %, as Transformer Engine's overlap went fast above; its vanilla-TP runs, read as ``"none"``, went from +9, +14
and +39 % to +2, +8 and +28 %.

A collective hidden behind a GEMM costs what sticks out past it and the GEMM it slows while they share the GPU
(``collectives.behind``). Megatron fuses the projections of one input
into one GEMM, so an input is gathered once however many projections read it; the operator-level search prices a
gather per consumer, which is why the layer's tensor-parallel communication is priced here, not by it. The
collectives above are the layer's only ones: the search's prices for moving tensors between its other operators are
dropped, since in this layout none move -- the attention runs on the heads the column split leaves each rank, and the
norms and residuals on what the row side's collective delivers (whole, or the sequence shard under sequence
parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.planner.cluster.collectives import behind

# Megatron's tensor-parallel layout: the projections into the attention and the MLP split by columns (their
# outputs), those out of them by rows; the head's vocabulary projection by columns (vocabulary-parallel)
COLUMN_PARALLEL = {"qkv", "fc1", "q", "kv", "gate", "up", "out", "q_up", "kv_up"}
ROW_PARALLEL = {"proj", "fc2", "o", "down"}
# latent attention's down-projections to its latents: whole on every rank of the group (Megatron-Core's MLA: the
# latents are small; the up-projections from them split the heads)
REPLICATED = {"q_down", "kv_down"}
BLOCKS = ((("qkv", "q", "kv", "q_down", "kv_down", "q_up", "kv_up"), ("proj", "o")),
          (("fc1", "gate", "up"), ("fc2", "down")))


def short_name(node) -> str:
    return node.name.split(".")[-1]


def megatron_strategy(node, t: int) -> tuple | None:
    """The strategy Megatron gives a projection over ``t`` (column- or row-split), None for anything else."""
    short = short_name(node)
    if node.kind != "linear" or (short not in COLUMN_PARALLEL | ROW_PARALLEL | REPLICATED):
        return None
    rank = len(node.shapes[0])
    bias = len(node.shapes) > 2
    if short in REPLICATED:
        return ((1,) * rank, (1, 1)) + (((1,),) if bias else ())
    if short in COLUMN_PARALLEL:
        return ((1,) * rank, (t, 1)) + (((t,),) if bias else ())
    return ((1,) * (rank - 1) + (t,), (1, t)) + (((1,),) if bias else ())


def is_megatron(graph, chosen, t: int) -> bool:
    """Does every projection of the plan take Megatron's split (and is there one)?"""
    found = False
    for node, c in zip(graph.nodes, chosen):
        want = megatron_strategy(node, t)
        if want is None:
            continue
        found = True
        if tuple(tuple(s) for s in c.strategy) != want:
            return False
    return found


@dataclass(frozen=True)
class GemmTimes:
    forward: float
    input_grad: float
    weight_grad: float


def _gemms(nodes_choices) -> GemmTimes:
    """Forward, input-gradient and weight-gradient seconds of one fused projection (the sum of its parts); a choice
    prices its backward's two GEMMs together, taken here as two halves."""
    f = b = 0.0
    for _, c in nodes_choices:
        b += c.backward
        f += c.compute - c.optimizer - c.backward
    return GemmTimes(f, b / 2, b / 2)


OVERLAPS = ("megatron", "none")


def block_seconds(machine, t: int, nbytes_in: float, col: GemmTimes, row: GemmTimes | None,
                  sp: bool, overlap: str = "megatron") -> tuple[float, float]:
    """Exposed seconds of one block's tensor-parallel collectives (module docstring), as (the column-split side's,
    the row-split side's); ``row`` None: a column-split projection alone (the head's vocabulary projection, its loss
    vocabulary-parallel)."""
    forward, backward = block_parts(machine, t, nbytes_in, col, row, sp, overlap)
    return forward[0] + backward[0], forward[1] + backward[1]


def block_parts(machine, t: int, nbytes_in: float, col: GemmTimes, row: GemmTimes | None,
                sp: bool, overlap: str = "megatron") -> tuple[tuple[float, float], tuple[float, float]]:
    """:func:`block_seconds` split into the forward's (column side, row side) and the backward's: a recomputed
    forward runs its collectives again. ``overlap``: which of them hide behind GEMMs (module docstring)."""
    ag = machine.collective("all_gather", nbytes_in, t)
    slowdown = machine.spec.overlap_slowdown
    hide = (lambda comm, gemm: comm) if overlap == "none" else (  # noqa: E731
        lambda comm, gemm: behind(comm, gemm, slowdown))
    rs = machine.collective("reduce_scatter", nbytes_in, t)
    if not sp:
        ar = machine.collective("all_reduce", nbytes_in, t)
        return (0.0, ar if row is not None else 0.0), (hide(ar, col.weight_grad), 0.0)
    # forward: the input's gather, the output's scatter; backward: the output gradient's gather before the row-split
    # input gradient (no GEMM runs before it to hide it), the input gradient's scatter and the input's second gather
    # behind the column-split GEMMs
    return (ag, rs if row is not None else 0.0), (hide(rs, col.weight_grad) + hide(ag, col.input_grad),
                                                  ag if row is not None else 0.0)


def layer_seconds(graph, chosen, machine, t: int, sp: bool, overlap: str = "megatron") -> tuple[dict[str, float],
                                                                                                  float]:
    """The exposed tensor-parallel communication of a layer (or the head) planned in Megatron's layout, by the
    projection it belongs to (a fused input's collectives on its first projection), and the forward's part of it."""
    by_name = {short_name(n): (n, c) for n, c in zip(graph.nodes, chosen)}
    out: dict[str, float] = {}
    forward = 0.0
    for col_names, row_names in BLOCKS:
        cols = [by_name[n] for n in col_names if n in by_name]
        rows = [by_name[n] for n in row_names if n in by_name]
        if not cols:
            continue
        node = cols[0][0]
        f, b = block_parts(machine, t, _input_bytes(node), _gemms(cols), _gemms(rows) if rows else None, sp, overlap)
        out[node.name] = f[0] + b[0]
        forward += f[0] + f[1]
        if rows:
            out[rows[0][0].name] = f[1] + b[1]
    if "out" in by_name:  # the head: its vocabulary-parallel loss all-reduces a max, a sum and the target logit a row
        node, _ = by_name["out"]
        x = _input_bytes(node)
        f, b = block_parts(machine, t, x, _gemms([by_name["out"]]), None, sp, overlap)
        loss = 3 * machine.collective("all_reduce", x / (node.shapes[0][-1] * node.itemsize) * 4, t)
        out[node.name] = f[0] + b[0] + loss
        forward += f[0] + loss  # the three run in the loss's forward; its backward needs none
    return out, forward


def _input_bytes(node) -> float:
    n = 1
    for s in node.shapes[0]:
        n *= s
    return float(n * node.itemsize)
