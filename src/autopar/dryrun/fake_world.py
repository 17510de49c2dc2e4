"""A world of N ranks inside one process: torch's fake process group (collectives that move nothing), tensors
without storage (``FakeTensorMode``), and plain answers where a fake tensor has none.

A fake tensor knows its shape, not its values: ``loss.item()``, ``torch.allclose`` and an object collective cannot
be answered. The dry run answers them as the rank it simulates would see them in a healthy job -- every rank holds
what this one holds (an all-gathered object is this rank's, N times; replicas agree), and a number read from a tensor
is 1 (a step count of 0 would divide by zero in Adam's bias correction; a loss of 1 prints and compares harmlessly),
a health check (``isnan``, ``isinf``, ``isfinite``) says the value is finite; a real tensor answers with its value.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_ANSWERED = {
    aten.allclose.default: True,
    aten.equal.default: True,
    aten.is_nonzero.default: True,
}


# what a health check of a value answers in a healthy job: not NaN, not infinite, finite
_HEALTH = {aten.isnan.default: False, aten.isinf.default: False, aten.isfinite.default: True}
_KEEPS = {aten.any.default, aten.any.dim, aten.all.default, aten.all.dim, aten.view.default, aten.squeeze.default,
          aten.clone.default, aten._to_copy.default, aten.sum.default, aten.max.default, aten.min.default}


# torch's files a value read passes through on its way from the script: the op call, the modes' dispatch, a
# tensor's formatting and printing
_DISPATCH_FILES = ("_ops.py", os.path.join("utils", "_python_dispatch.py"), os.path.join("utils", "_stats.py"),
                   "_subclasses" + os.sep, "_tensor.py", "_tensor_str.py", "_compile.py",
                   os.path.join("_dynamo", "eval_frame.py"))


class PlainAnswers(TorchDispatchMode):
    """Answer what depends on tensor values (see the module's docstring) instead of failing; a real tensor (made
    before the fake mode, or read from a file) answers with its real value. ``invented`` lists the lines of
    ``script`` that read a made-up one (torch's and autopar's own reads -- Adam's step count -- are not the
    script's business)."""

    def __init__(self, script: str | None = None):
        super().__init__()
        self.script = script
        self.invented: list[int] = []

    def _note(self) -> None:
        """Record the script's line that read a made-up value -- unless torch's or autopar's own code read it (a
        replica check in the network's first call, Adam's step count, FSDP's bookkeeping: the script's line
        calling them did not read anything). Past the dispatch machinery (the modes, torch's op call, a tensor's
        printing), the first frame says who read."""
        import sys

        frame = sys._getframe(2)
        torch_dir = os.path.dirname(torch.__file__) + os.sep
        machinery = (os.path.dirname(__file__) + os.sep, *(torch_dir + f for f in _DISPATCH_FILES))
        while frame is not None and frame.f_code.co_filename.startswith(machinery):
            frame = frame.f_back
        if frame is None or frame.f_code.co_filename.startswith(torch_dir) or \
                frame.f_code.co_filename.startswith(os.path.dirname(os.path.dirname(__file__)) + os.sep):
            return
        while frame is not None:
            if frame.f_code.co_filename == self.script:
                self.invented.append(frame.f_lineno)
                return
            frame = frame.f_back

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

        if _seeded:
            known = _with_known_values(func, args, kwargs or {})
            if known is not _UNKNOWN:
                return known
        if func is aten._local_scalar_dense.default or func in _ANSWERED:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if tensors and not any(is_fake(t) for t in tensors):
                with unset_fake_temporarily():
                    return func(*args, **(kwargs or {}))
            answer = getattr(tensors[0], "_dryrun_answer", None) if tensors else None
            if answer is not None:
                return answer
            self._note()
            if func in _ANSWERED:
                return _ANSWERED[func]
            t = args[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        out = func(*args, **(kwargs or {}))
        answer = _HEALTH.get(func)
        if answer is None and func in _KEEPS and args and isinstance(args[0], torch.Tensor):
            answer = getattr(args[0], "_dryrun_answer", None)
        if answer is None and func is aten.logical_not.default:
            answer = getattr(args[0], "_dryrun_answer", None)
            answer = None if answer is None else not answer
        if answer is not None and isinstance(out, torch.Tensor):
            out._dryrun_answer = answer
        return out


# Values a dry run knows: a mixture-of-experts layer's routing (seeded by :func:`route_alike`) and whatever is
# computed from it alone -- the expert masks, the tokens each expert takes (``nonzero``, ``where``), their counts.
# A fake tensor carries its values, a small real CPU tensor, as ``_dryrun_value``; an op over such tensors runs on
# the values too, so a size that depends on them (``nonzero``) is the one a healthy job would meet.
_seeded = False
_UNKNOWN = object()


def known_value(t: torch.Tensor) -> torch.Tensor | None:
    from torch._subclasses.fake_tensor import is_fake

    return getattr(t, "_dryrun_value", None) if is_fake(t) else t


def _with_known_values(func, args, kwargs):
    """``func`` on tensors whose values are all known (at least one of them fake): the values computed for real,
    the fake result given them (or made from their sizes where fake tensors cannot say a size). ``_UNKNOWN`` where
    any tensor's values are unknown."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, is_fake, unset_fake_temporarily
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten((args, kwargs))
    if not any(isinstance(t, torch.Tensor) and is_fake(t) and hasattr(t, "_dryrun_value") for t in leaves):
        return _UNKNOWN
    values = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            leaf = known_value(leaf)
            if leaf is None or leaf.numel() > _LARGEST_KNOWN:
                return _forget_written(func, args)
        elif isinstance(leaf, torch.device):  # the values live on the host whatever device the fake ones claim
            leaf = torch.device("cpu")
        values.append(leaf)
    if func.namespace in ("c10d", "_c10d_functional"):  # the fake group moves nothing: what arrives is unknown
        return _forget_written(func, args)
    value_args, value_kwargs = pytree.tree_unflatten(values, spec)
    try:
        with unset_fake_temporarily():
            real = func(*value_args, **value_kwargs)
    except Exception:  # noqa: BLE001 - a kernel the host lacks (a GPU's histc of integers): values unknown
        return _forget_written(func, args)
    if not any(isinstance(r, torch.Tensor) for r in pytree.tree_leaves(real)):
        return real  # a number read from known values: the value itself
    try:
        out = func(*args, **kwargs)
    except DynamicOutputShapeException:  # a size set by the values: a fake tensor of the values' size
        device = next(t.device for t in leaves if isinstance(t, torch.Tensor) and is_fake(t))
        out = pytree.tree_map_only(torch.Tensor, lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype,
                                                                                device=device), real)
    for o, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(real)):
        if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and is_fake(o):
            o._dryrun_value = r
    return out


# known values larger than this many elements are not kept (a 262k-token batch's one-hot over 256 experts, top-8,
# would take 4 GB of host memory): sizes computed from them are then unknown, and the dry run says so in one line
_LARGEST_KNOWN = 1 << 24


def _forget_written(func, args):
    """An op whose values are not computed: tensors it writes in place no longer hold their known values."""
    for arg, schema in zip(args, func._schema.arguments):
        if isinstance(arg, torch.Tensor) and schema.alias_info is not None and schema.alias_info.is_write \
                and hasattr(arg, "_dryrun_value"):
            del arg._dryrun_value
    return _UNKNOWN


def route_alike(module: torch.nn.Module, args):
    """A forward pre-hook for every module: a mixture-of-experts layer's stacked experts -- an ``int``
    ``num_experts`` and ``forward(tokens, top_k_index, top_k_weights)`` over one row of k choices per token, as
    Hugging Face's and autopar's experts are called positionally -- get routing whose values are known. A fake
    router has none, and which tokens an expert takes (``nonzero``) is set by them. The routing is what an
    untrained or load-balanced router gives: each token's k experts drawn uniformly, without repeats (seeded by the
    rank; the expert-parallel dispatcher takes what a rank receives from the others to be what it sends itself,
    every rank routing alike)."""
    global _seeded
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

    experts = getattr(module, "num_experts", None)
    if not isinstance(experts, int) or isinstance(experts, bool) or len(args) < 3 or torch.compiler.is_exporting():
        return None  # (a pipeline's trace: there the experts are one opaque operator, which needs no routing values)
    tokens, index, weights = args[0], args[1], args[2]
    local = getattr(index, "_local_tensor", index)  # a DTensor's routing: its local rows
    if not (isinstance(tokens, torch.Tensor) and isinstance(local, torch.Tensor) and is_fake(local)
            and isinstance(weights, torch.Tensor) and weights.is_floating_point()
            and tuple(weights.shape) == tuple(index.shape) and tokens.dim() == 2 and tokens.shape[0] == index.shape[0]
            and local.dim() == 2 and not local.is_floating_point() and local.dtype != torch.bool
            and not hasattr(local, "_dryrun_value") and local.shape[-1] <= experts):
        return None
    from autopar.layout.leaves import uniform_routing

    rows, k = local.shape
    with unset_fake_temporarily():
        local._dryrun_value = uniform_routing(rows, experts, k, local.dtype, seed=dist.get_rank())
    _seeded = True
    return None


def routed(answers: "PlainAnswers", index: torch.Tensor, experts: int):
    """A context in which a fake ``index`` (a mixture's ``[rows, k]`` routing that no pre-hook reached: the opaque
    operator of a pipeline stage's experts) has values as :func:`route_alike` gives them, and ``answers`` follows
    values through the ops -- re-entered, as the operator runs inside DTensor's dispatch, where the mode that
    dispatched to it is off."""
    global _seeded
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from autopar.layout.leaves import uniform_routing

    if not hasattr(index, "_dryrun_value"):
        rows, k = index.shape
        with unset_fake_temporarily():
            index._dryrun_value = uniform_routing(rows, experts, k, index.dtype, seed=dist.get_rank())
    _seeded = True
    return contextlib.nullcontext() if answers in _get_current_dispatch_mode_stack() else answers


def _joined(*args, **kwargs) -> None:
    """The script's own ``init_process_group``: it joins the fake world, and autopar's ``init()`` then takes the
    device the script chose, as it does after torchrun's (``AUTOPAR_DRYRUN_SCRIPT_INIT``)."""
    os.environ["AUTOPAR_DRYRUN_SCRIPT_INIT"] = "1"


def _all_gather_object(object_list, obj, group=None):
    object_list[:] = [obj] * len(object_list)


def _gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
    if object_gather_list is not None:
        object_gather_list[:] = [obj] * len(object_gather_list)


def _keep(*args, **kwargs):  # broadcast_object_list / scatter_object_list: every rank already holds rank 0's
    return None


def form(rank: int, world: int, device: str = "cpu") -> None:
    """Make torch's default process group a fake one of ``world`` ranks with this process as ``rank``, and the
    environment say so (torchrun's variables and MindSpore's RANK_ID/RANK_SIZE/DEVICE_ID, for scripts that read
    them); a script's own ``init_process_group`` then joins it instead of forming a second one. ``device`` "cuda":
    the group stands for NCCL (``AUTOPAR_DRYRUN_DEVICE``, which autopar's ``init()`` reads when it adopts the
    world)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local_size(world)),
                      LOCAL_WORLD_SIZE=str(local_size(world)), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                      AUTOPAR_DRYRUN_DEVICE=device,
                      # what MindSpore's launchers give a rank too (rank tables, msrun): scripts read them
                      RANK_ID=str(rank), RANK_SIZE=str(world), DEVICE_ID=str(rank % local_size(world)))
    for name in ("MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT", "RANK_TABLE_FILE",
                 "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        os.environ.pop(name, None)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    # the fake world stays for the whole run: a script's own init joins it, its destroy keeps it (a real
    # init_process_group after a destroy would wait for N real ranks at MASTER_ADDR)
    dist.init_process_group = _joined
    dist.destroy_process_group = lambda *args, **kwargs: None
    dist.all_gather_object = _all_gather_object
    dist.gather_object = _gather_object
    dist.broadcast_object_list = _keep
    dist.scatter_object_list = _keep
    _real_meshes()
    torch.nn.modules.module.register_module_forward_pre_hook(route_alike)
    from autopar.dryrun import fake_ddp

    fake_ddp.install()
    _swap_keeps_fakes()
    _no_files_written()
    _scaler_steps()


def _swap_keeps_fakes() -> None:
    """``model.to(device)`` / ``.cuda()`` of a fake parameter swaps it for the moved one, which torch refuses while
    the fake mode holds a weak reference to the new tensor ("Couldn't swap Embedding.weight"): the parameter takes
    the new tensor's data and device instead -- what the swap would have made of it."""
    import torch.utils

    swap = torch.utils.swap_tensors

    def swap_tensors(t1, t2):
        try:
            return swap(t1, t2)
        except RuntimeError as exc:
            if "weakref" not in str(exc) or not hasattr(t2, "fake_device"):
                raise
            t1.data = t2
            t1.fake_device = t2.fake_device

    torch.utils.swap_tensors = swap_tensors


def _no_files_written() -> None:
    """A fake tensor has no values to save: ``torch.save`` and DCP's ``save`` write nothing (a warning says what was
    skipped) -- a checkpoint that already lies at the path stays as it was."""
    import warnings

    import torch.distributed.checkpoint as dcp

    def skipped(what):
        def save(obj=None, f=None, *args, **kwargs):
            where = f if f is not None else kwargs.get("checkpoint_id", kwargs.get("storage_writer", ""))
            warnings.warn(f"autopar: {what}({where}) not written in a dry run", stacklevel=2)

        return save

    torch.save = skipped("torch.save")
    dcp.save = skipped("torch.distributed.checkpoint.save")
    if hasattr(dcp, "async_save"):
        dcp.async_save = skipped("torch.distributed.checkpoint.async_save")


def _scaler_steps() -> None:
    """Loss scaling skips a step whose gradients hold inf/NaN -- which a fake tensor cannot rule out: it steps."""
    from torch.amp import grad_scaler

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)

    grad_scaler.GradScaler._maybe_opt_step = _maybe_opt_step


def _real_meshes() -> None:
    """A device mesh is a small tensor of ranks that torch reads values from (which coordinate is mine): it is made
    real, outside the fake mode, wherever the script, autopar or torch builds one."""
    import torch.distributed.device_mesh as device_mesh
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def real(original):
        if getattr(original, "_dryrun", False):
            return original

        def call(*args, **kwargs):
            with unset_fake_temporarily():
                return original(*args, **kwargs)

        call._dryrun = True
        return call

    import sys

    device_mesh.DeviceMesh.__init__ = real(device_mesh.DeviceMesh.__init__)
    for method in ("_unflatten", "_flatten"):  # a mesh made from another's ranks (a pipeline stage's replicas
        # unflattened into expert groups): its rank tensor computed from real values too
        if hasattr(device_mesh.DeviceMesh, method):
            setattr(device_mesh.DeviceMesh, method, real(getattr(device_mesh.DeviceMesh, method)))
    original = device_mesh.init_device_mesh
    device_mesh.init_device_mesh = real(original)
    # torch's own modules imported before this (FSDP2's default mesh, through autopar's import) hold the name too
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed") and getattr(module, "init_device_mesh", None) is original:
            module.init_device_mesh = device_mesh.init_device_mesh


def local_size(world: int) -> int:
    return int(os.environ.get("AUTOPAR_DRYRUN_LOCAL_SIZE", min(world, 8)))


def fake_tensors():
    """The mode the script runs under: tensors it makes (a 6.6e9-parameter model too) have no storage; real tensors
    it reads from files become fake on first use."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)
