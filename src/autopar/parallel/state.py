"""What autopar did to one network, in one place: :class:`ParallelState`.

A network parallelized under the context (by its first call, by ``parallelize`` or by ``Model``) gets one state: the
mode it runs in, the engines that complete its gradients (:mod:`autopar.parallel.grads.engine`), its layout
runtime (SEMI_AUTO / AUTO), its pipeline, its ZeRO level, the planner's plan. The only mark on the user's modules is
one reference to it (``_autopar_state``, so that the state lives and dies with the network: a registry keyed by
module would keep every network its state refers to alive); a copy or a pickle of a module does not carry it.
Everything the state hooked is removed by :meth:`ParallelState.close`.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from autopar.context import ParallelMode

_KEY = "_autopar_state"


class _Ref:
    """The reference a module holds; ``copy.deepcopy`` and pickling of the module see an empty one (a copy is a new
    network, with none of the original's hooks)."""

    __slots__ = ("state",)

    def __init__(self, state: "ParallelState | None") -> None:
        self.state = state

    def __deepcopy__(self, memo) -> "_Ref":
        return _Ref(None)

    def __reduce__(self):
        return (_Ref, (None,))


@dataclass(eq=False)
class ParallelState:
    mode: ParallelMode
    world: int
    engines: list = field(default_factory=list)  # GradientEngine: one owner per trainable parameter
    runtime: Any = None  # the layout runtime (SEMI_AUTO / AUTO with strategies)
    pipeline: Any = None  # PipelineParallel (pipeline_stages > 1, or AUTO's planned pipeline)
    zero_level: str | None = None  # optimizer sharding on FSDP2
    plan: Any = None  # AUTO_PARALLEL: the planner's plan this network runs
    channels_last: bool = False  # feed 4-D inputs channels-last (perf.tuning)
    compiled: bool = False  # GRAPH_MODE: the forward runs through torch.compile
    announced: bool = False  # its one line (mode, mesh, ZeRO, splits) was said (parallel.summary)
    handles: list = field(default_factory=list)  # hooks on modules, removed by close()
    _network: Any = None

    @property
    def network(self) -> torch.nn.Module | None:
        return self._network() if self._network is not None else None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backwards inside keep their gradients local; the next one outside sums them."""
        with contextlib.ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(engine.no_sync())
            yield

    def gradient_engines(self) -> str:
        """How this network's gradients are completed: its engines, each with its transport."""
        parts = [getattr(e, "name", type(e).__name__) + (f" over {e.transport_name}" if hasattr(e, "transport_name")
                                                         else "") for e in self.engines]
        return ", ".join(parts) or "no gradient communication"

    def describe(self) -> str:
        """One line: how this network's gradients are completed (for logs and the docs' examples)."""
        return f"{self.mode.value} on {self.world} ranks: {self.gradient_engines()}"

    def close(self) -> None:
        """Remove every hook autopar put on this network and its parameters."""
        for engine in self.engines:
            engine.close()
        self.engines.clear()
        for h in self.handles:
            h.remove()
        self.handles.clear()
        network = self.network
        for module in network.modules() if network is not None else ():
            if state_of(module) is self:
                module.__dict__.pop(_KEY, None)


def bind(state: ParallelState, network: torch.nn.Module) -> ParallelState:
    """Register ``network`` and every module in it as belonging to ``state``."""
    if state._network is None:
        state._network = weakref.ref(network)
    for module in network.modules():
        if state_of(module) is None:
            module.__dict__[_KEY] = _Ref(state)
    return state


def state_of(module: torch.nn.Module) -> ParallelState | None:
    ref = module.__dict__.get(_KEY)
    return ref.state if ref is not None else None


def state_within(module: torch.nn.Module) -> ParallelState | None:
    """The state of ``module`` or of any module inside it (a wrapper around a network parallelized before)."""
    for m in module.modules():
        state = state_of(m)
        if state is not None:
            return state
    return None
