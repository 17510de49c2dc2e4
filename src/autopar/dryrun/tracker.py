"""Live tensor storage of one process, its peak and what the peak is made of.

Why not torch's ``MemTracker``: it refuses a module called twice in one iteration (gradient accumulation, a block
applied twice) and needs the model and optimizer handed to it; a dry run gets neither -- the user's script runs
unmodified. What is counted is the same thing: every tensor storage an operator creates, from creation until its
last reference goes, each once however many views share it. The same tracker measures a real run (the accuracy
check of a dry run runs the script for real on gloo ranks under it).

Parts, by what the storage turns out to be: ``parameters`` (parameters and buffers), ``gradients``, ``optimizer``
(its state), ``activations`` (made in a forward), ``other`` (communication buffers and gathered weights: what
collectives write into; data; anything else). A storage is labelled by the phase that made it (a backward's: a
gradient) and re-labelled when it is seen as a module's parameter or buffer (when the module runs), as a parameter,
gradient or optimizer state at an optimizer step, or as a collective's buffer.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autopar.context import in_side_work

PARTS = ("parameters", "gradients", "optimizer", "activations", "other")
aten = torch.ops.aten
# copies out of a communication buffer are communication too: FSDP2 copies an all-gather's output into each
# parameter's unsharded storage (the gathered weights), forward and backward
_COPIES = {aten.split_with_sizes_copy.out, aten.split_with_sizes_copy.default, aten.copy_.default, aten.clone.default,
           aten._to_copy.default, aten.cat.default, aten.cat.out, aten.narrow_copy.default}


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class StorageTracker(TorchDispatchMode):
    """Enter before the script runs; ``peak`` is the largest total seen and ``peak_parts`` its parts."""

    def __init__(self, device_type: str | None = None) -> None:
        super().__init__()
        self.device_type = device_type  # count only this device's tensors ("cuda": a simulated GPU's memory)
        self._live: dict[int, list] = {}  # storage key -> [nbytes, part, weakref]
        self.totals = dict.fromkeys((*PARTS, "data"), 0)  # "data" is reported as "other"
        self.current = 0
        self.peak = 0
        self.peak_parts = dict(self.totals)
        self.steady_peak = 0  # the peak after the first optimizer step: a training step with its optimizer state
        self.steady_parts = dict(self.totals)
        self.user_peak = 0  # torch.cuda.max_memory_allocated() of a simulated GPU: the script resets it at will
        self.steps = 0
        self._forward_depth = 0
        self._in_step = False
        self._handles: list = []
        self._undo: list = []

    # phases -------------------------------------------------------------------------------------------------
    def __enter__(self):
        from torch.nn.modules import module as module_hooks
        from torch.optim import optimizer as optim_hooks

        tracker = self
        resize = torch.UntypedStorage.resize_

        def resize_(storage, size):  # FSDP2 frees and re-allocates unsharded parameters by resizing their storage
            out = resize(storage, size)
            tracker._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        self._undo = [lambda: setattr(torch.UntypedStorage, "resize_", resize)]
        self._handles = [
            module_hooks.register_module_forward_pre_hook(self._forward_in),
            module_hooks.register_module_forward_hook(self._forward_out, always_call=True),
            optim_hooks.register_optimizer_step_pre_hook(self._step_in),
            optim_hooks.register_optimizer_step_post_hook(self._step_out),
        ]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        for undo in reversed(self._undo):
            undo()
        self._handles, self._undo = [], []
        return super().__exit__(*exc)

    def _forward_in(self, module, args):
        # the outermost call: every parameter and buffer of the network (before a runtime replaces them by slices);
        # a module called inside it: its own (a module the network runs that it does not own)
        tensors = (*module.parameters(), *module.buffers()) if not self._forward_depth else \
            (*module._parameters.values(), *module._buffers.values())
        self._forward_depth += 1
        for t in tensors:
            if isinstance(t, torch.Tensor) and self._label(t) == "data":  # not a gathered weight: made at setup
                self.relabel(t, "parameters")

    def _forward_out(self, module, args, out):
        self._forward_depth = max(0, self._forward_depth - 1)

    def _step_in(self, opt, args, kwargs):
        if in_side_work():  # autopar's own measurements (calibration, the planner): not a training step
            return
        self._in_step = True
        self._relabel_optimizer(opt)

    def _step_out(self, opt, args, kwargs):
        if in_side_work():
            return
        self._in_step = False
        self.steps += 1
        self._relabel_optimizer(opt)  # the optimizer may hold other parameters now (autopar moves it onto slices)

    def _relabel_optimizer(self, opt) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                self.relabel(p, "parameters")
                if p.grad is not None:
                    self.relabel(p.grad, "gradients")
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    self.relabel(v, "optimizer")

    def _phase(self) -> str:
        if self._in_step:
            return "optimizer"
        if _in_backward():
            return "gradients"
        if self._forward_depth:
            return "activations"
        return "data"  # made outside any forward and step: data, or parameters (re-labelled when a module runs)

    # storages -----------------------------------------------------------------------------------------------
    @property
    def current_device_bytes(self) -> int:
        return self.current

    def _storage(self, t: torch.Tensor):
        local = getattr(t, "_local_tensor", None)  # a DTensor: its local shard is what is stored
        t = local if isinstance(local, torch.Tensor) else t
        if self.device_type is not None and t.device.type != self.device_type:  # host memory beside a GPU's
            return None
        if t.device.type == "meta":  # a network built without memory (deferred_init): none on a real device either
            return None
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage of its own (a subclass, sparse)
            return None

    def relabel(self, t: torch.Tensor, part: str) -> None:
        st = self._storage(t)
        if st is None:
            return
        entry = self._live.get(st._cdata)
        if entry is None or entry[1] == part:
            return
        self.totals[entry[1]] -= entry[0]
        self.totals[part] += entry[0]
        entry[1] = part

    def _add(self, t: torch.Tensor, part: str) -> None:
        if in_side_work():  # autopar's own measurements (a calibration's 64 MB buffers): freed before training
            return
        st = self._storage(t)
        if st is None:
            return
        key = st._cdata
        if key in self._live:
            return
        nbytes = st.nbytes()
        if not isinstance(nbytes, int):  # a symbolic size: a tensor that torch.export traces (a pipeline's split),
            return                       # not memory the step holds (its arithmetic failed inside the tracer)

        def gone(_ref, key=key):
            entry = self._live.pop(key, None)
            if entry is not None:
                self.totals[entry[1]] -= entry[0]
                self.current -= entry[0]

        try:
            ref = weakref.ref(st, gone)
        except TypeError:
            return
        self._live[key] = [nbytes, part, ref]
        self._grew(part, nbytes)

    def _resized(self, st) -> None:
        entry = self._live.get(st._cdata)
        if entry is None:
            return
        nbytes = st.nbytes()
        part = "other" if entry[1] in ("activations", "gradients") else entry[1]  # gathered weights
        self.totals[entry[1]] -= entry[0]
        self.current -= entry[0]
        entry[0], entry[1] = nbytes, part
        self._grew(part, nbytes)

    def _grew(self, part: str, nbytes: int) -> None:
        self.totals[part] += nbytes
        self.current += nbytes
        self.user_peak = max(self.user_peak, self.current)
        if self.current > self.peak:
            self.peak = self.current
            self.peak_parts = dict(self.totals)
        if self.steps and self.current > self.steady_peak:
            self.steady_peak = self.current
            self.steady_parts = dict(self.totals)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        collective = func.namespace in ("c10d", "_c10d_functional", "fsdp")
        if collective:  # what a collective writes into: a communication buffer (gathered weights included)
            for a in tree_flatten((args, kwargs))[0]:
                if isinstance(a, torch.Tensor):
                    self._add(a, "other")
                    if self._label(a) in ("activations", "gradients"):
                        self.relabel(a, "other")
        part = "other" if collective or (func in _COPIES and self._reads_other(args)) else self._phase()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t, part)
        return out

    def _label(self, t: torch.Tensor) -> str | None:
        st = self._storage(t)
        entry = self._live.get(st._cdata) if st is not None else None
        return entry[1] if entry is not None else None

    def _reads_other(self, args) -> bool:
        return any(isinstance(a, torch.Tensor) and self._label(a) == "other" for a in tree_flatten(args)[0])

    def report(self) -> dict:
        def parts(totals: dict) -> dict:
            out = {k: int(totals[k]) for k in PARTS}
            out["other"] += int(totals["data"])
            return out

        return {"peak_bytes": int(self.peak), **parts(self.peak_parts),
                "steady": {"peak_bytes": int(self.steady_peak), **parts(self.steady_parts)}, "steps": self.steps}
