"""The runtime of a network in SEMI_AUTO_PARALLEL (and AUTO_PARALLEL once strategies are chosen).

How a forward pass runs:

- The root module's inputs become DTensors: each rank's local batch is its slice of the global batch
  (``full_batch=True``: every rank holds the whole batch, i.e. replicated).
- Every autopar operator (annotated with a strategy, or not: then MindSpore's data-parallel default) goes through
  :meth:`SemiAutoRuntime.run_op`: its inputs are redistributed to the layouts its strategy demands, the operator runs
  on the *local shards* with plain torch, and the output is wrapped with the layout the strategy implies (a split
  contracted dimension gives a partial sum, resolved lazily by the next consumer's redistribution). Running the
  unsharded operator and slicing afterwards never happens.
- Unannotated torch leaf modules (Conv2d, BatchNorm, an unsharded Linear, a loss module) run data-parallel: their
  inputs are redistributed to "batch split over every device", they compute on the local batch with replicated
  parameters, and their outputs go back into the DTensor world.
- The root's outputs come back as plain tensors: this rank's share of the batch (or the whole tensor).
- A parameter takes the layout of the first operator that uses it (as a DTensor holding only this rank's slice:
  1/k of the memory); a second operator asking for another layout is an error naming both.

Gradients: the backward pass yields, for every parameter, the gradient of the sum of the ranks' losses (or of the
global loss when the loss itself was computed on DTensors). Hooks on the parameters (:mod:`autopar.parallel.grads.layouts`)
complete it inside the backward -- Partial -> the parameter's placements for DTensors, all-reduce of replicated
parameters, ``gradients_mean`` -- so that the result equals DATA_PARALLEL's for the same data in any loop.
A replaced parameter is recorded (:mod:`autopar.common.replaced`): optimizers made before the first forward are
moved onto the slices before their next step.
"""
from __future__ import annotations

import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from autopar import errors as _errors
from autopar.comm.topology import world_mesh, world_size
from autopar.common import replaced as _replaced
from autopar.layout.layout import Layout
from autopar.layout.leaves import LAYOUT_TRANSPARENT, is_annotated
from autopar.ops import primitive as _primitive
from autopar.ops.comm import _CommPrimitive
from autopar.ops.primitive import Primitive
from autopar.parallel.grads.layouts import LayoutGrads
from autopar.parallel.state import state_of
from autopar.parallel.tensor import context, experts, fused_split, local_matmul, sequence, sequence_attention
from autopar.parallel.tensor import placements as P
from autopar.parallel.tensor.attention import register_attention_rules
from autopar.parallel.tensor.explain import fused_projection_split, split_heads_view
from autopar.parallel.tensor.handlers import register_cast_handler
from autopar.parallel.tensor.inputs import dataset_input, resplit_sequence, sequence_slice, splits_sequence
from autopar.parallel.tensor.operators import run_operator
from autopar.parallel.tensor.parameters import ParameterPlacement
from autopar.parallel.tensor.regather import Regather
from autopar.parallel.tensor.strategy_io import LoadedStrategy, write_strategy_file

_local = threading.local()
_errors.explained_by(fused_projection_split)
_errors.explained_by(split_heads_view)


def active_runtime() -> "SemiAutoRuntime | None":
    return getattr(_local, "runtime", None)


_replicating: list = []


def _replicate_plain_tensors() -> None:
    """Tensors a network makes itself (a causal or padding mask, ``arange`` positions, a rotary table, a constant)
    are the same on every rank: DTensor takes them as replicated where they meet laid-out tensors -- in the forward,
    and in the backward, where autograd meets the ones it saved. torch's ``implicit_replication`` is one process-wide
    switch (a context entered per forward would be off again when the backward runs), so it is turned on once, by
    the first layout runtime, for the rest of the process."""
    if not _replicating:
        context = implicit_replication()
        context.__enter__()
        _replicating.append(context)


def _execute(op: Primitive, args: tuple, kwargs: dict) -> Any:
    """How an autopar operator runs while a network of this runtime runs (installed for the call's duration)."""
    rt = active_runtime()
    if rt is None or isinstance(op, _CommPrimitive):
        return op.compute(*args, **kwargs)
    return rt.run_op(op, args, kwargs)


_EXPERT_CLASSES: dict[type, type] = {}


def _expert_parallel(module: torch.nn.Module) -> None:
    """Give a module marked ``"expert"`` a forward that, under this runtime, runs only this rank's experts
    (:func:`autopar.parallel.tensor.experts.run`); the module's own forward runs inside on plain tensors, so the
    runtime's hooks stand aside meanwhile. Outside a runtime: the module's own forward."""
    cls = type(module)
    if cls in _EXPERT_CLASSES.values():
        return
    if cls not in _EXPERT_CLASSES:
        original = cls.forward

        def forward(self, *args, **kwargs):
            rt = active_runtime()
            if rt is None:
                return original(self, *args, **kwargs)
            _local.runtime = None
            try:
                return experts.run(self, original, *args, **kwargs)
            finally:
                _local.runtime = rt

        _EXPERT_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (cls,),
                                    {"forward": forward, "__module__": cls.__module__})
    module.__class__ = _EXPERT_CLASSES[cls]


def _whole_value(module, output):
    """A loss module's value on this rank's rows made the whole batch's (``full_batch``: every rank fed the whole
    batch and gets one process's outputs back) -- its mean (or sum) over the ranks' equal shares, one scalar
    all-reduce -- while its gradient stays this rank's part, which the layouts' gradient sums expect."""
    reduction = getattr(module, "reduction", "mean")
    if not isinstance(output, torch.Tensor) or isinstance(output, DTensor) or output.dim() or \
            reduction not in ("mean", "sum"):
        return output
    total = output.detach().clone()
    dist.all_reduce(total)
    if reduction == "mean":
        total /= dist.get_world_size()
    return output + (total - output.detach())


class SemiAutoRuntime(ParameterPlacement):
    def __init__(self, gradients_mean: bool, full_batch: bool = False, parameter_broadcast: bool = False,
                 strategy_save_file: str | None = None, strategy_load_file: str | None = None,
                 dataset_strategy: Any = "data_parallel", zero_level: str | None = None,
                 zero_shard_size: int | None = None, context_parallel_algo: str = "all_gather",
                 context_parallel: int = 1):
        self.device_num = world_size()
        register_attention_rules()
        register_cast_handler()
        _replicate_plain_tensors()
        # optimizer sharding (enable_parallel_optimizer): parameters stored split over the mesh axes their layout
        # replicates them on, gathered to the layout for each use (parallel.optimizer_shard.storage_placements)
        self.zero_level = zero_level
        self.zero_shard_size = zero_shard_size
        self._leaf_params: dict[int, list[tuple[str, DTensor]]] = {}  # id(leaf module) -> its stored params
        self._regathers: dict[int, Regather] = {}  # id(leaf module) -> its level-3 hooks while it runs
        self._leaf_batched: dict[int, list[bool]] = {}  # id(leaf module) -> did its running call get batch data?
        self._leaf_split: dict[int, list[tuple]] = {}  # id(sequence-split leaf) -> its running calls' layouts
        self.gradients_mean = gradients_mean
        self.full_batch = full_batch
        self.dataset_strategy = dataset_strategy if isinstance(dataset_strategy, (tuple, list)) else None
        self.parameter_broadcast = parameter_broadcast
        self.strategy_save_file = strategy_save_file
        self.loaded = LoadedStrategy(strategy_load_file, self.device_num)
        self.roots: list[torch.nn.Module] = []
        self.names: dict[int, str] = {}  # id(operator or module) -> qualified name
        self.param_names: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> name (old and converted)
        _replaced.carry(self.param_names)  # and a parameter materialised in an old one's place
        self.owners: dict[str, list[tuple[torch.nn.Module, str]]] = {}
        # original parameter -> its DTensor parameter. Keyed by identity but weakly: a freed original's id is soon
        # reused by some new tensor (a constant like Tensor(0.1)), which a plain id-keyed dict took for the parameter.
        self.converted: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.param_layout: dict[str, tuple[str, tuple, Layout]] = {}  # name -> (who, placements, layout)
        self.resumed_layouts: set[str] = set()  # preset as a checkpoint was saved: the run's operators may re-lay
        self.optimizers: list[torch.optim.Optimizer] = []
        self.loss_was_global = False
        self._depth = 0
        self._matmul_mode = None
        self._attention_mode = None
        self._split_mode = None
        # context parallelism: the inputs split on their sequence (dimension 1) -- token-wise modules keep that
        # split, attention gathers keys and values (parallel/tensor/context.py)
        self.context_parallel_algo = context_parallel_algo
        # AUTO's sequence split over ``context_parallel`` ranks: the inputs arrive as data parallel loads them (each
        # rank its rows; under full_batch every row) and are re-split on their sequence on the way in
        self.context_parallel = context_parallel
        self.sequence_split = splits_sequence(self.dataset_strategy) or context_parallel > 1
        # a module split on the sequence between tensor-parallel layers (sequence parallelism): the activations an
        # operator gathers from that split are kept split for its backward (operators._gathers)
        self.sequence_parallel = False
        self._hooked: set[int] = set()
        self._strategy_written = False
        self.loss_root: torch.nn.Module | None = None  # network + loss, when Model gave a loss
        self._executing = None
        self.outputs_whole = False  # this forward handed whole outputs back (full_batch)
        self.grads = LayoutGrads(self.device_num, gradients_mean, loss_was_global=lambda: self.loss_was_global,
                                 whole_outputs=lambda: self.outputs_whole)

    # -- installation -------------------------------------------------------------------------------------------
    def add_root(self, root: torch.nn.Module, prefix: str = "") -> None:
        """Make ``root`` a network this runtime runs (calls at depth 0 convert inputs and outputs)."""
        if id(root) in {id(r) for r in self.roots}:
            return
        self.roots.append(root)
        for name, module in root.named_modules(prefix=prefix.rstrip(".")):
            self.names.setdefault(id(module), name or type(module).__name__)
            if experts.is_experts(module):
                _expert_parallel(module)
            leaf = not any(True for _ in module.children())
            if (leaf and not isinstance(module, (Primitive, *LAYOUT_TRANSPARENT)) and not experts.is_experts(module)
                    and id(module) not in self._hooked):
                module.register_forward_pre_hook(self._leaf_pre)
                module.register_forward_hook(self._leaf_post, always_call=True)
                self._hooked.add(id(module))
        self.loaded.apply(root, self.names)  # operators without a strategy take the loaded file's
        for module_name, module in root.named_modules(remove_duplicate=False):
            for attr, param in list(module._parameters.items()):
                if param is None:
                    continue
                full = f"{module_name}.{attr}" if module_name else attr
                name = self.param_names.setdefault(param, full)
                owners = self.owners.setdefault(name, [])
                if (module, attr) not in owners:
                    owners.append((module, attr))
        sequence.check_tensor_parallel(self, root)
        self.sequence_parallel = self.sequence_parallel or any(sequence.is_split(m) for m in root.modules())
        self._store_leaf_parameters(root)
        root.register_forward_pre_hook(self._root_pre, with_kwargs=True)
        root.register_forward_hook(self._root_post, always_call=True)
        if self.parameter_broadcast and self.device_num > 1:
            with torch.no_grad():
                for p in root.parameters():
                    if not isinstance(p, DTensor) and not getattr(p, "layerwise_parallel", False) and not p.is_meta:
                        dist.broadcast(p.data, src=0)
        self.grads.attach(root.parameters())

    def attach_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is not None and optimizer not in self.optimizers:
            self.optimizers.append(optimizer)
            self._remap_optimizers()

    def is_root(self, module: torch.nn.Module) -> bool:
        return any(r is module for r in self.roots)

    def enter_first_call(self, module: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> tuple:
        """The root pre-hook's work for a call already under way when the root was added (torch collected the
        call's pre-hooks before): convert its inputs here -- the keyword ones in place, in the call's own dict
        (:func:`autopar.parallel.entry.call_kwargs`); the post-hook, collected later, runs as usual."""
        out = self._root_pre(module, args, dict(kwargs or {}))
        if out is None:
            return args
        if kwargs is not None:
            kwargs.update(out[1])
        return out[0]

    # -- root and leaf hooks -------------------------------------------------------------------------------------
    def _enter(self) -> bool:
        if self._depth == 0:
            if active_runtime() not in (None, self):
                return False
            _local.runtime = self
            self.loss_was_global = self.outputs_whole = False
            self._executing = _primitive.executing(_execute)
            self._executing.__enter__()
            if self.device_num > 1:  # a column-split fused projection cut into q, k and v: each split by heads
                self._split_mode = fused_split.enter()
            if len(world_mesh().shape) > 1:  # a dimension may be split over two mesh axes
                self._matmul_mode = local_matmul.enter()
            if self.sequence_split:  # context parallelism: attention over the split sequence
                self._attention_mode = sequence_attention.enter(self.context_parallel_algo)
        self._depth += 1
        return True

    def _exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            _local.runtime = None
            executing, self._executing = self._executing, None
            if executing is not None:
                executing.__exit__(None, None, None)
            attention, self._attention_mode = self._attention_mode, None
            if attention is not None:
                local_matmul.leave(attention)  # pops a torch function mode if it is the innermost one
            mode, self._matmul_mode = self._matmul_mode, None
            if mode is not None:
                local_matmul.leave(mode)
            split, self._split_mode = self._split_mode, None
            if split is not None:
                local_matmul.leave(split)

    def _root_pre(self, module, args, kwargs):
        outer = self._depth == 0
        if not self._enter():
            return None
        if outer:
            if self.sequence_split:
                context.check_equal_slices(args, kwargs)
            count = iter(range(10**9))

            def convert(t):
                if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
                    return t
                k = next(count)
                if self.context_parallel > 1:
                    whole = P.to_dtensor_replicated(t) if self.full_batch else P.wrap_data_parallel(t)
                    return resplit_sequence(whole, self.context_parallel)
                if self.dataset_strategy is not None and k < len(self.dataset_strategy):
                    return dataset_input(t, self.dataset_strategy[k])
                return P.to_dtensor_replicated(t) if self.full_batch else P.wrap_data_parallel(t)

            return tree_map(convert, args), tree_map(convert, kwargs)
        return None

    def _root_post(self, module, args, output):
        if active_runtime() is not self:
            return None
        outer = self._depth == 1
        self._exit()
        if not outer:
            return None
        result = tree_map(self._output_to_local, output)
        self._after_first_forward()
        return result

    def _output_to_local(self, t):
        if not isinstance(t, DTensor):
            return t
        if self.full_batch:  # every rank fed the whole batch: it gets the whole output back (one process's)
            self.outputs_whole = True
            return t.full_tensor()
        if t.dim() == 0:
            self.loss_was_global = True
        sliced = sequence_slice(t, self.dataset_strategy)
        if sliced is not None:
            return sliced
        return P.to_data_parallel_local(t)

    def _leaf_pre(self, module, args):
        if active_runtime() is not self or is_annotated(module):
            return None
        # (a module of its own split -- sequence parallelism beside context parallelism -- takes that split)
        follow = (self.sequence_split and not self._is_loss(module) and not sequence.is_split(module)
                  and sequence.follows(args))
        if follow or sequence.is_split(module):  # sequence / context parallelism: on its slice of the sequence
            local, layout, grad = sequence.enter(self, module, args, follow=follow)
            self._leaf_split.setdefault(id(module), []).append(layout)
            self._lend_parameters(module, grad)
            return local
        # what the module computes follows its inputs: from the network's inputs (DTensors), this rank's share of
        # the batch; from tensors made inside the network (``arange`` positions, masks), the same on every rank
        # (a batch that does not divide over the ranks -- ``full_batch`` with fewer rows than ranks -- is computed
        # whole on every rank: its outputs are whole, its parameters' gradients too)
        n = self.device_num
        batched = any(isinstance(t, DTensor) and (t.dim() == 0 or t.shape[0] % n == 0 and t.shape[0] >= n)
                      for t in tree_flatten((args,))[0])
        local = tree_map(lambda t: P.to_data_parallel_local(t) if isinstance(t, DTensor) else t, args)
        local_batch = next((a.shape[0] for a, t in zip(tree_flatten((local,))[0], tree_flatten((args,))[0])
                            if isinstance(t, DTensor) and t.dim() >= 1), None)
        self._leaf_batched.setdefault(id(module), []).append((batched, local_batch))
        # Its parameters' gradients here are this rank's part of the sum when the module computed on this rank's
        # batch, the whole gradient already when it computed on what every rank holds alike
        self._lend_parameters(module, tuple(Partial() if batched else Replicate() for _ in P.replicate_placements()))
        return local

    def _is_loss(self, module) -> bool:
        """A loss module (torch's, or the loss ``Model`` was given): it reduces over the tokens, so under a sequence
        split it runs as any data-parallel leaf does (its inputs moved onto the batch split), not on a slice."""
        return isinstance(module, torch.nn.modules.loss._Loss) or (
            self.loss_root is not None and module is getattr(self.loss_root, "loss_fn", None))

    def _lend_parameters(self, module, grad: tuple) -> None:
        """The module's whole parameters for this call only (under ZeRO an all-gather, the gradient reduce-scattered
        back); ``grad``: the placements their local gradient has."""
        stored_params = self._leaf_params.get(id(module), ())
        regather = Regather() if stored_params and self.zero_level == "level3" else None
        whole = P.replicate_placements()
        for attr, stored in stored_params:
            module._parameters[attr] = stored.redistribute(stored.device_mesh, whole).to_local(grad_placements=grad)
            if regather is not None:
                regather.add(module._parameters[attr], stored, whole)
        if regather is not None:
            regather.__enter__()  # left in _leaf_post (always called, also when the forward raises)
            self._regathers[id(module)] = regather

    def _leaf_post(self, module, args, output):
        if active_runtime() is not self or is_annotated(module):
            return None
        for attr, stored in self._leaf_params.get(id(module), ()):
            module._parameters[attr] = stored
        regather = self._regathers.pop(id(module), None)
        if regather is not None:
            regather.__exit__(None, None, None)
        split = self._leaf_split.get(id(module))
        if split:
            return sequence.leave(self, module, output, split.pop())
        batched = self._leaf_batched.get(id(module))
        batched, local_batch = batched.pop() if batched else (True, None)
        n = self.device_num
        if self.full_batch and batched and n > 1 and self._is_loss(module):
            return _whole_value(module, output)

        def wrap(t):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.dim() >= 1:
                # an output of one row where the module was handed several (Llama's rotary cos/sin: from positions
                # alike on every rank, the activations given only for their dtype) is whole on every rank, to be
                # broadcast over the batch -- not one rank's share of a batch of n
                split = n > 1 and batched and not (t.shape[0] == 1 and local_batch not in (None, 1))
                return P.wrap_data_parallel(t) if split else P.to_dtensor_replicated(t)
            return t

        return tree_map(wrap, output)

    # -- operators -------------------------------------------------------------------------------------------
    def name_of(self, op: Primitive) -> str:
        return f"{type(op).__name__} '{self.names.get(id(op), '?')}'"

    def run_op(self, op: Primitive, args: tuple, kwargs: dict) -> Any:
        return run_operator(self, op, args, kwargs)

    # -- parameters ------------------------------------------------------------------------------------------
    def _input(self, arg: torch.Tensor, op: Primitive, plan, layout: Layout) -> DTensor:
        if isinstance(arg, torch.nn.Parameter) or arg in self.converted:
            return self._parameter(arg, op, plan, layout)
        if isinstance(arg, DTensor):
            return arg
        return P.to_dtensor_replicated(arg)  # a constant: whole on every rank

    def _remap_optimizers(self) -> None:
        for opt in self.optimizers:
            _replaced.remap_optimizer(opt)

    def parameters(self):
        seen = set()
        for root in self.roots:
            for name, p in root.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield self.param_names.get(p, name), p

    # -- strategy file -----------------------------------------------------------------------------------------
    def layouts(self) -> dict[str, Layout]:
        """Every parameter's layout (replicated parameters included)."""
        out = {}
        for name, p in self.parameters():
            if isinstance(p, DTensor):
                out[name] = self.param_layout[name][2] if name in self.param_layout else Layout.from_placements(
                    p.placements, tuple(p.shape), tuple(p.device_mesh.shape))
            elif not getattr(p, "layerwise_parallel", False):
                out[name] = Layout.replicated(tuple(p.shape), self.device_num)
        return out

    def _after_first_forward(self) -> None:
        from autopar.common import deferred

        for root in self.roots:  # built on the meta device and used by no operator: whole, as they are
            deferred.materialize_module(root)
        self._remap_optimizers()
        state = state_of(self.roots[0]) if self.roots else None
        failed = sys.exc_info()[1] is not None  # torch calls this hook from its except clause when forward raised
        if state is not None and not state.announced and not failed:
            from autopar.parallel.summary import announce

            announce(state, self.roots[0])
        if self.strategy_save_file and not self._strategy_written:
            self._strategy_written = True
            write_strategy_file(self.strategy_save_file, self)
