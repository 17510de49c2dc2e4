"""Where a laid-out network's parameters live: each one replaced, in every module that owns it, by a DTensor holding
this rank's slice -- laid out as the first operator that uses it asks (a second operator asking for another layout is
an error naming both), as a strategy file or checkpoint presets it, or, for plain torch leaf modules, replicated (under
ZeRO also split over the ranks). The parameter half of :class:`autopar.parallel.tensor.runtime.SemiAutoRuntime`."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.comm.topology import mesh_shape, world_mesh
from autopar.common import deferred
from autopar.common import replaced as _replaced
from autopar.errors import StrategyError
from autopar.layout.layout import Layout
from autopar.layout.leaves import is_annotated
from autopar.ops.primitive import Primitive
from autopar.parallel.tensor import experts
from autopar.parallel.tensor import placements as P
from autopar.parallel.tensor import state_dict as _state_dict


class ParameterPlacement:
    """Mixed into the runtime, whose state it uses: ``owners`` (name -> [(module, attr)]), ``param_names``,
    ``param_layout`` (name -> (who, placements, Layout)), ``converted`` (original -> DTensor parameter), ``grads``,
    ``loaded`` (a strategy read from a file), ``zero_level`` / ``zero_shard_size``, ``device_num``."""

    def _parameter(self, param: torch.nn.Parameter, op: Primitive, plan, layout: Layout) -> DTensor:
        name = self.param_names.get(param, f"<parameter of {self.name_of(op)}>")
        if getattr(param, "layerwise_parallel", False):
            raise StrategyError(f"parameter '{name}' is layerwise_parallel: that belongs to HYBRID_PARALLEL, where "
                                f"the network adds its own collectives")
        who = f"{self.name_of(op)} with strategy {plan.strategy}"
        self.loaded.check(name, tuple(param.shape), layout, who)
        if isinstance(param, DTensor) and param in self.converted:  # re-laid out since (a reference kept before)
            param = self.converted[param]
        prev = self.param_layout.get(name)
        if prev is not None and name in self.resumed_layouts:
            # laid out as the checkpoint it was resumed from was saved: the first operator to use it decides (AUTO
            # planned again, a strategy changed) -- its values move to that layout, its optimizer state after them
            self.resumed_layouts.discard(name)
            if prev[1] != layout.placements() and isinstance(param, DTensor):
                self.param_layout[name] = (who, layout.placements(), layout)
                return self._lay_out(param, name, layout)
        if prev is None:
            self.param_layout[name] = (who, layout.placements(), layout)
        elif prev[1] != layout.placements():
            raise StrategyError(f"parameter '{name}' is used by {prev[0]} and by {who}: one parameter must have one "
                                f"strategy for all its operators (layouts {prev[2]} vs {layout})")
        if isinstance(param, DTensor):
            if tuple(param.placements) not in (layout.placements(), self._stored(layout.placements(), param.shape)):
                raise StrategyError(f"parameter '{name}' is laid out as {self.param_layout[name][2]} but {who} needs "
                                    f"{layout}")
            return param
        if param in self.converted:
            return self.converted[param]
        return self._lay_out(param, name, layout)

    def _lay_out(self, param: torch.nn.Parameter, name: str, layout: Layout) -> torch.nn.Parameter:
        return self._replace(param, name, self._stored(layout.placements(), tuple(param.shape)))

    def _replace(self, param: torch.nn.Parameter, name: str, placements: tuple,
                 default_owner: tuple | None = None) -> torch.nn.Parameter:
        """Replace ``param`` in every module that owns it by a DTensor parameter holding this rank's slice."""
        with torch.no_grad():
            if param.is_meta:  # built under deferred_init / no_init_parameters: only this rank's slice is kept
                sharded = deferred_slice(param, world_mesh(), placements)
            elif isinstance(param, DTensor):  # laid out otherwise before (a resumed checkpoint's layout)
                sharded = param.detach().redistribute(param.device_mesh, placements)
            else:
                sharded = distribute_tensor(param.detach(), world_mesh(), placements, src_data_rank=0)
        new = torch.nn.Parameter(sharded, requires_grad=param.requires_grad)
        for module, attr in self.owners.get(name) or ([default_owner] if default_owner else []):
            module._parameters[attr] = new
            _state_dict.install(module)
        self.converted[param] = new
        self.param_names[new] = name
        _replaced.record(param, new)
        self.grads.attach([new])
        self._remap_optimizers()
        return new

    def _stored(self, placements: tuple, shape: tuple[int, ...]) -> tuple:
        """Where a parameter of this layout lives between uses: the layout itself, or under ZeRO also split over
        the axes the layout replicates it on."""
        if not self.zero_level:
            return tuple(placements)
        from autopar.parallel.zero.fsdp import storage_placements

        return storage_placements(tuple(placements), tuple(shape), mesh_shape(), self.zero_shard_size)

    def _store_leaf_parameters(self, root: torch.nn.Module) -> None:
        """The parameters of plain torch leaf modules (they run data-parallel on the local batch) become DTensors too:
        replicated -- or under ZeRO split over the ranks -- and handed to the module as plain tensors for each of its
        calls (:meth:`_leaf_pre` / :meth:`_leaf_post`). So every parameter of a laid-out network is a DTensor:
        ``clip_grad_norm_`` and the optimizers see one kind, and forward code may use a parameter directly on
        DTensor activations. Rank 0's initial values, as any layout."""
        converted = set(id(v) for v in self.converted.values())
        for module in root.modules():
            if id(module) not in self._hooked or is_annotated(module) or id(module) in self._leaf_params:
                continue
            stored = []
            for attr, param in list(module._parameters.items()):
                if param is None or not param.requires_grad or getattr(param, "layerwise_parallel", False):
                    continue
                if isinstance(param, DTensor):
                    if id(param) in converted:  # shared with a leaf stored before (a tied embedding and head)
                        stored.append((attr, param))
                    continue
                name = self.param_names.get(param, attr)
                placements = self._stored(P.replicate_placements(), tuple(param.shape))
                new = self._replace(param, name, placements, default_owner=(module, attr))
                converted.add(id(new))
                stored.append((attr, new))
                layout = Layout.replicated(tuple(param.shape), self.device_num)
                self.param_layout[name] = (f"data-parallel module '{self.names.get(id(module), '?')}'",
                                           layout.placements(), layout)
            if stored:
                self._leaf_params[id(module)] = stored
        self._store_direct_parameters(root, converted)

    def _store_direct_parameters(self, root: torch.nn.Module, converted: set) -> None:
        """Parameters a composite module uses in its own ``forward`` (timm's cls token and position embedding, a
        learned scale) become replicated DTensors for good: they meet DTensor activations there (``torch.cat``
        with the batch), and autograd through DTensor gives their gradient's layout (a pending sum over the
        batch's ranks), which the gradient hooks complete as any laid-out parameter's -- a Cell's too, when it
        holds no operator (``x * self.scale`` in its ``construct``). Left to the operators that use them: the
        parameters of a module with autopar operators (MindSpore's way, where the first operator to use a
        parameter lays it out)."""
        for module in root.modules():
            if experts.is_experts(module):  # expert parallelism: each rank keeps its experts
                self._store_experts(module)
                continue
            if (id(module) in self._hooked or is_annotated(module) or isinstance(module, Primitive)
                    or any(isinstance(child, Primitive) for child in module.children())):
                continue
            for attr, param in list(module._parameters.items()):
                if (param is None or isinstance(param, DTensor) or not param.requires_grad
                        or getattr(param, "layerwise_parallel", False)):
                    continue
                name = self.param_names.get(param, attr)
                if name in self.param_layout or param in self.converted:
                    continue
                placements = self._stored(P.replicate_placements(), tuple(param.shape))
                new = self._replace(param, name, placements, default_owner=(module, attr))
                converted.add(id(new))
                layout = Layout.replicated(tuple(param.shape), self.device_num)
                self.param_layout[name] = (f"module '{self.names.get(id(module), '?')}' (used in its forward)",
                                           layout.placements(), layout)

    def _store_experts(self, module: torch.nn.Module) -> None:
        where = self.names.get(id(module), type(module).__name__)
        for attr, param in list(module._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            name = self.param_names.get(param, attr)
            layout = experts.expert_layout(where, module, param)
            self.param_layout[name] = (f"expert-parallel module '{where}'", layout.placements(), layout)
            self._lay_out(param, name, layout)

    def preset_layout(self, name: str, layout: Layout, resumed: bool = False) -> None:
        """Lay parameter ``name`` out now (a strategy to load a checkpoint into, or one read from a file); the
        operators that use it later must agree -- unless ``resumed``: the layout a resumed checkpoint was saved in
        (its slices read straight into it), which the run's own operators may lay out otherwise."""
        owners = self.owners.get(name)
        if not owners:
            raise StrategyError(f"the strategy names parameter '{name}', which the network does not have")
        module, attr = owners[0]
        param = module._parameters[attr]
        if tuple(param.shape) != tuple(layout.full_shape):
            raise StrategyError(f"the strategy gives parameter '{name}' the shape {layout.full_shape} but the network "
                                f"has {tuple(param.shape)}")
        if resumed and name not in self.param_layout:
            self.resumed_layouts.add(name)
        self.param_layout.setdefault(name, (f"the given strategy for '{name}'", layout.placements(), layout))
        if self.param_layout[name][1] != layout.placements():
            raise StrategyError(f"parameter '{name}' is already laid out as {self.param_layout[name][2]}, "
                                f"the strategy asks for {layout}")
        if isinstance(param, DTensor):
            return
        self._lay_out(param, name, layout)


def deferred_slice(param: torch.Tensor, mesh, placements: tuple) -> DTensor:
    """The DTensor holding this rank's slice of a meta parameter's recorded value: every rank computes the whole
    value (the same on each: the same record) and keeps its slice -- no collective, and the whole is freed before
    the next parameter is made."""
    local = deferred.slice_of(param, mesh, placements)
    return DTensor.from_local(local.to(mesh.device_type), mesh, placements, run_check=False,
                              shape=param.shape, stride=param.stride())
