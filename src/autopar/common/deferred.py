"""Deferred initialisation: build a network without its memory, then give each rank only the values it keeps --
exactly the values an eager build would have drawn.

Why: a network built whole on every rank costs its full size before anything is sharded (a 70B model: 280 GB in
fp32). FSDP2 and torchtitan build on the meta device and initialise the shards afterwards, but their shards are drawn
per rank (not the slices of the one-process model); torchdistx's ``deferred_init`` records the build and replays it.
This is the latter, on torch's own dispatch:

- While :class:`recording` is active (``autopar.deferred_init(fn, ...)``, MindSpore's ``no_init_parameters``)
  every tensor is made on the meta device and every operation on one is written down -- at the aten level (a
  ``TorchDispatchMode``: factories, fills, copies, ``normal_`` ...), and whole for ``torch.nn.init``'s functions,
  some of which are data-dependent (``trunc_normal_`` redraws until its values are in bounds) or do nothing on the
  meta device. An operation that draws random numbers also runs once for real on a scratch tensor of the same
  geometry (freed at once), and the generator's state before it is kept: the random stream advances as in an
  eager build, and the draw can be repeated later, alone.
- :func:`full_value` gives one parameter's whole value: the operations its value depends on (back to the last one
  that overwrote it whole: the default init a later ``_init_weights`` replaced is skipped), each random one from
  its kept state. One parameter at a time, in any order, so a runtime can slice each one as it lays it out and
  never hold the model whole.
- A network built under a plain ``torch.device("meta")`` (the FSDP2 idiom) has no record: :func:`record_initialisers`
  records its own initialisers -- the root's ``init_weights()`` (torchtitan, Hugging Face), else each module's
  ``reset_parameters()`` -- from the random state of that moment, as FSDP2's ``to_empty`` + init would.

Not recorded: a data-dependent ``torch.nn.init`` function reached through a reference bound before the recording
(``from torch.nn.init import trunc_normal_`` at import time) -- it does nothing on the meta device; Hugging Face's
own table of them is covered.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import mmap
import sys
import weakref
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from autopar.errors import ConfigError

_META = torch.device("meta")
_CPU = torch.device("cpu")
# in-place operations that write every element of their target without reading it
_OVERWRITES = {"normal_", "uniform_", "fill_", "zero_", "random_", "exponential_", "cauchy_", "log_normal_",
               "geometric_", "bernoulli_", "copy_"}
_INIT_FUNCTIONS = ("uniform_", "normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
                   "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "orthogonal_", "sparse_")


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A meta tensor as a view of a recorded storage: which storage, and the view's geometry."""

    sid: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def view(self, storage: torch.UntypedStorage | None) -> torch.Tensor:
        if storage is None:  # a dry run's fake tensors: the geometry is all there is
            return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=_CPU)
        out = torch.empty(0, dtype=self.dtype, device=_CPU)
        out.set_(storage, self.offset, self.size, self.stride)
        return out


def _new_storage(nbytes: int) -> torch.UntypedStorage | None:
    """Host memory for one recorded storage (None under a dry run's fake tensors: nothing is allocated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack()):
        return None
    if nbytes < _OWN_MAPPING:
        return torch.UntypedStorage(nbytes, device=_CPU)
    # a mapping of its own, unmapped when the last view of it goes: whole values made and dropped one after another
    # in the allocator's heap leave holes that later small blocks split (measured: a 1 GiB GPT's build kept 0.4 GiB)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).untyped_storage()


_OWN_MAPPING = 1 << 20  # bytes: a storage this large gets its own mapping


@dataclasses.dataclass
class _Op:
    fn: Callable
    args: tuple
    kwargs: dict
    writes: tuple[int, ...]  # storages it writes (in place, or creates)
    reads: tuple[int, ...]  # storages whose values it reads
    overwrites: bool  # writes its targets whole without reading them (so earlier writes are dead)
    outputs: tuple[_Ref, ...] = ()  # new storages (an out-of-place operation's results)
    rng: tuple | None = None  # (generator, state) before a random draw


class _Real:
    """A real tensor an operation read (``param.copy_(torch.tensor(...))``, a loaded value): a small one copied, a
    large one held as it is -- and refused at replay if it was changed in place since."""

    def __init__(self, tensor: torch.Tensor):
        tensor = tensor.detach()
        self.tensor = tensor.clone() if tensor.numel() * tensor.element_size() < _OWN_MAPPING else tensor
        self.version = self.tensor._version

    def get(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise ConfigError(f"a tensor of shape {list(self.tensor.shape)} read while the network was built (or "
                              f"loaded into it) was changed in place since: the network would take its new values "
                              f"-- give it a copy (tensor.clone())")
        return self.tensor


class Recording:
    """The operations that built some meta tensors, and how to compute any one of them again."""

    def __init__(self) -> None:
        self.ops: list[_Op] = []
        self.nbytes: dict[int, int] = {}
        self._watch: dict[int, weakref.ref] = {}  # meta storage id -> a weak reference that forgets it when it dies
        self.writers: dict[int, list[int]] = {}
        self.largest_held = 0  # the most bytes one replay held at once (what setup costs beyond the shards)

    # -- recording ---------------------------------------------------------------------------------------------
    def ref(self, t: torch.Tensor) -> _Ref:
        storage = t.untyped_storage()
        sid = _IDS.get(storage)
        if sid is None:  # an id of our own: a freed storage's address is soon another's
            sid = _IDS[storage] = next(_COUNTER)
        owner = _BY_STORAGE.get(sid)
        if owner is None:
            self.nbytes[sid] = storage.nbytes()
            self._own(sid, storage)
        elif owner is not self:  # built by an earlier recording (a network passed into this build): one history
            self._merge(owner)
        return _Ref(sid, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def _own(self, sid: int, storage: torch.UntypedStorage) -> None:
        """The recording lives while a tensor it made does (and with it what it holds: loaded values)."""
        me = weakref.ref(self)
        self._watch[sid] = weakref.ref(storage, lambda _, sid=sid: _forget(sid, me()))
        _BY_STORAGE[sid] = self

    def _merge(self, other: "Recording") -> None:
        """Take ``other``'s history in front of this one's (it was recorded first; the two share no storage)."""
        shift = len(other.ops)
        self.ops[:0] = other.ops
        self.writers = {sid: [i + shift for i in idx] for sid, idx in self.writers.items()}
        for sid, idx in other.writers.items():
            self.writers[sid] = list(idx) + self.writers.get(sid, [])
        self.nbytes.update(other.nbytes)
        for sid, watch in other._watch.items():
            storage = watch()
            if storage is not None:
                self._own(sid, storage)
        self.largest_held = max(self.largest_held, other.largest_held)
        other.ops, other.writers, other._watch = [], {}, {}

    def covers(self, ref: _Ref) -> bool:
        """Does the view ``ref`` cover every byte of its storage (once)?"""
        numel = 1
        for d in ref.size:
            numel *= d
        if numel * ref.dtype.itemsize != self.nbytes[ref.sid] or ref.offset:
            return False
        expected = 1
        for stride, size in sorted((st, sz) for sz, st in zip(ref.size, ref.stride) if sz != 1):
            if stride != expected:
                return False
            expected *= size
        return True

    def add(self, op: _Op) -> None:
        index = len(self.ops)
        self.ops.append(op)
        for sid in op.writes:
            self.writers.setdefault(sid, []).append(index)

    def placeholders(self, tree: Any) -> Any:
        def swap(x):
            if isinstance(x, torch.Tensor):
                return self.ref(x) if x.device.type == "meta" else _Real(x)
            if isinstance(x, torch.device) and x.type == "meta":
                return _CPU
            return x

        return tree_map(swap, tree)

    # -- the random states, across ranks ------------------------------------------------------------------------
    def rng_payload(self) -> torch.Tensor:
        """Every random operation's generator state before it, as one byte tensor (ranks compare and share it) --
        a real one inside a dry run's fake mode too (its bytes are hashed)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        states = [op.rng[1] for op in self.ops if op.rng is not None]
        with unset_fake_temporarily():
            return torch.cat([s.view(torch.uint8).reshape(-1) for s in states]) if states else \
                torch.zeros(0, dtype=torch.uint8)

    def adopt_rng_payload(self, payload: torch.Tensor) -> None:
        """Draw as the rank whose ``rng_payload`` this is (the same build, another seed)."""
        at = 0
        for op in self.ops:
            if op.rng is not None:
                gen, state = op.rng
                n = state.numel() * state.element_size()
                op.rng = (gen, payload[at:at + n].clone().view(state.dtype).reshape(state.shape))
                at += n

    # -- replay ------------------------------------------------------------------------------------------------
    def _needed(self, sid: int, before: int, into: set[int], seen: set[tuple[int, int]]) -> None:
        if (sid, before) in seen:
            return
        seen.add((sid, before))
        for index in reversed(self.writers.get(sid, ())):
            if index >= before:
                continue
            op = self.ops[index]
            if index not in into:
                into.add(index)
                for read in op.reads:
                    self._needed(read, index, into, seen)
            if op.overwrites:
                return

    def value(self, ref: _Ref) -> torch.Tensor:
        """The whole real (CPU) value of the recorded tensor ``ref`` at the end of the recording."""
        needed: set[int] = set()
        self._needed(ref.sid, len(self.ops), needed, set())
        storages: dict[int, torch.UntypedStorage] = {}

        def real(x):
            if isinstance(x, _Ref):
                if x.sid not in storages:
                    storages[x.sid] = _new_storage(self.nbytes[x.sid])
                return x.view(storages[x.sid])
            if isinstance(x, _Real):
                return x.get()
            return x

        restore: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        try:
            with torch.no_grad(), _suspended():
                for index in sorted(needed):
                    op = self.ops[index]
                    if op.rng is not None:
                        gen, state = op.rng
                        restore.setdefault(id(gen), (gen, gen.get_state()))
                        gen.set_state(state)
                    out = op.fn(*tree_map(real, op.args), **tree_map(real, op.kwargs))
                    if op.outputs:
                        results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                        for target, result in zip(op.outputs, results):
                            real(target).copy_(result)
        finally:
            for gen, state in restore.values():
                gen.set_state(state)
        if ref.sid not in storages:  # never written: an uninitialised tensor, as torch.empty gives
            storages[ref.sid] = _new_storage(self.nbytes[ref.sid])
        self.largest_held = max(self.largest_held, sum(self.nbytes[sid] for sid in storages))
        return ref.view(storages[ref.sid])


_BY_STORAGE: dict[int, Recording] = {}  # live meta storage id -> the recording that made it
_IDS = WeakIdKeyDictionary()  # meta storage -> its id here
_COUNTER = itertools.count(1)


def _owner(t: torch.Tensor) -> "Recording | None":
    """The recording a live meta tensor comes from, if any."""
    if not is_meta(t):
        return None
    sid = _IDS.get(t.untyped_storage())
    return _BY_STORAGE.get(sid) if sid is not None else None


def _forget(sid: int, rec: "Recording | None") -> None:
    if rec is not None and _BY_STORAGE.get(sid) is rec:
        del _BY_STORAGE[sid]
_active: list["recording"] = []


def _generator_of(kwargs: dict) -> torch.Generator:
    gen = kwargs.get("generator")
    return gen if isinstance(gen, torch.Generator) else torch.default_generator


def _scratch_run(fn: Callable, rec: Recording, args: tuple, kwargs: dict, written: tuple = ()) -> None:
    """Run ``fn`` once for real: a random draw advances the generator exactly as the eager build's did. What it
    writes (``written``, by identity) is a scratch tensor of the recorded geometry, freed at once; a meta tensor it
    reads has its recorded value (a draw whose count depends on values -- ``multinomial``, rejection sampling --
    draws as eagerly)."""
    storages: dict[int, torch.UntypedStorage] = {}

    def real(x):
        if isinstance(x, torch.Tensor) and x.device.type == "meta":
            r = rec.ref(x)
            if not any(x is w for w in written):
                return rec.value(r)
            if r.sid not in storages:
                storages[r.sid] = _new_storage(rec.nbytes[r.sid])
            out = r.view(storages[r.sid])
            out.zero_()  # defined values
            return out
        if isinstance(x, torch.device) and x.type == "meta":
            return _CPU
        return x

    with torch.no_grad(), _suspended():
        try:
            fn(*tree_map(real, args), **tree_map(real, kwargs))
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - said as one line, with the operation's name
            name = getattr(fn, "__name__", None) or str(fn)
            raise ConfigError(f"{name} on a tensor of the network being built failed when drawn for real: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


class _MetaAllocations(TorchFunctionMode):
    """``torch.device("meta")`` for allocations only: a factory without a device allocates on the meta device, but a
    tensor made from data the host already holds (``torch.tensor([...])``) stays real -- its values are known and
    small -- and the default device stays the host's, so a library that asks where it is building (Hugging Face
    skips its ``_init_weights`` under a meta device context) builds as it would eagerly."""

    _KEEP = {torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _constructors() and func not in self._KEEP and kwargs.get("device") is None:
            kwargs["device"] = _META
        return func(*args, **kwargs)


def _constructors() -> set:
    from torch.utils._device import _device_constructors

    return _device_constructors()


class _Recorder(TorchDispatchMode):
    def __init__(self, rec: Recording):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        metas_in = [t for t in flat_in if t.device.type == "meta"]
        schema = func._schema
        written, read = [], []  # the tensors of the arguments it writes, and of those it only reads
        values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
        for arg, value in zip(schema.arguments, values):
            tensors = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor)]
            (written if arg.alias_info is not None and arg.alias_info.is_write else read).extend(tensors)
        rng = None
        if torch.Tag.nondeterministic_seeded in func.tags and (metas_in or _makes_meta(func, kwargs)):
            gen = _generator_of(kwargs)
            rng = (gen, gen.get_state())
            _scratch_run(func, self.rec, args, kwargs, tuple(written))
        out = func(*args, **kwargs)
        flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not any(t.device.type == "meta" for t in flat_in + flat_out):
            return out
        if func.is_view or torch.Tag.inplace_view in func.tags:
            return out  # an alias: later operations name the storage and the geometry themselves
        rec = self.rec
        reads = {rec.ref(t).sid for t in read if t.device.type == "meta"}
        if written:
            refs = [rec.ref(t) for t in written if t.device.type == "meta"]
            if not refs:
                return out
            name = func._overloadpacket.__name__
            whole = all(rec.covers(r) for r in refs) and (name in _OVERWRITES or func._overloadname == "out")
            targets = {r.sid for r in refs}
            rec.add(_Op(func, rec.placeholders(args), rec.placeholders(kwargs), tuple(targets),
                        tuple(reads | (set() if whole else targets)), whole, rng=rng))
            return out
        in_storages = [t.untyped_storage() for t in metas_in]
        new = [t for t in flat_out if t.device.type == "meta"
               and not any(t.untyped_storage() is st for st in in_storages)]
        if not new:
            return out
        outputs = tuple(rec.ref(t) for t in new)
        rec.add(_Op(func, rec.placeholders(args), rec.placeholders(kwargs), tuple(r.sid for r in outputs),
                    tuple(reads), True, outputs=outputs, rng=rng))
        return out


def _makes_meta(func, kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"


def _recorded_init(name: str, original: Callable) -> Callable:
    """``torch.nn.init.<name>`` while recording: on a meta tensor, one recorded operation (drawn once for real on a
    scratch tensor, its generator state kept); otherwise torch's own."""

    def init(tensor, *args, **kwargs):
        rec = _active[-1].rec if _active else None
        if rec is None or not isinstance(tensor, torch.Tensor) or tensor.device.type != "meta":
            return original(tensor, *args, **kwargs)
        try:  # the generator, however it was passed
            given = inspect.signature(original).bind(tensor, *args, **kwargs).arguments.get("generator")
        except (TypeError, ValueError):
            given = kwargs.get("generator")
        gen = given if isinstance(given, torch.Generator) else torch.default_generator
        rng = (gen, gen.get_state())
        _scratch_run(original, rec, (tensor, *args), kwargs, (tensor,))
        target = rec.ref(tensor)
        whole = rec.covers(target)
        rec.add(_Op(original, rec.placeholders((tensor, *args)), rec.placeholders(kwargs), (target.sid,),
                    () if whole else (target.sid,), whole, rng=rng))
        return tensor

    init.__name__ = name
    init.__wrapped__ = original
    return init


@contextlib.contextmanager
def _init_functions_recorded():
    """``torch.nn.init``'s functions (and Hugging Face's table of them) replaced while recording."""
    tables: list[tuple[Any, str, Callable, bool]] = []  # (owner, name, original, is a dict)
    for name in _INIT_FUNCTIONS:
        original = getattr(torch.nn.init, name, None)
        if original is not None and not hasattr(original, "__wrapped__"):
            tables.append((torch.nn.init, name, original, False))
    hf = sys.modules.get("transformers.initialization")
    table = getattr(hf, "TORCH_INIT_FUNCTIONS", None)
    if isinstance(table, dict):
        for name, original in table.items():
            if callable(original) and not hasattr(original, "__wrapped__"):
                tables.append((table, name, original, True))
    for owner, name, original, is_dict in tables:
        wrapped = _recorded_init(name, original)
        if is_dict:
            owner[name] = wrapped
        else:
            setattr(owner, name, wrapped)
    try:
        yield
    finally:
        for owner, name, original, is_dict in tables:
            if is_dict:
                owner[name] = original
            else:
                setattr(owner, name, original)


@contextlib.contextmanager
def _suspended():
    """Real work inside a recording (a scratch draw, a replay): the recording's own modes set aside -- only they: a
    dry run's fake tensors stay fake -- and allocations on the host."""
    from torch.overrides import _len_torch_function_stack
    from torch.overrides import _pop_mode_temporarily as pop_function_mode
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    from torch.utils._python_dispatch import _pop_mode_temporarily as pop_dispatch_mode

    with contextlib.ExitStack() as stack:
        while isinstance(_get_current_dispatch_mode(), _Recorder):
            stack.enter_context(pop_dispatch_mode())
        while _len_torch_function_stack() and isinstance(
                torch._C._get_function_stack_at(_len_torch_function_stack() - 1), _MetaAllocations):
            stack.enter_context(pop_function_mode())
        stack.enter_context(torch.device(_CPU))
        saved = list(_active)
        _active.clear()
        try:
            yield
        finally:
            _active.extend(saved)


class recording:
    """``with recording(): net = Net()`` -- every tensor made on the meta device, every operation on one recorded
    (see the module docstring). Nested blocks record into the outermost one. The modules that received a meta
    parameter or buffer are materialised whole at the first call of any module unless a parallel runtime lays
    them out first (:func:`materialize_pending`)."""

    def __enter__(self) -> "recording":
        from torch.nn.modules import module as _module

        self.rec = _active[0].rec if _active else Recording()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_MetaAllocations())
        if not _active:
            self._stack.enter_context(_init_functions_recorded())
        self._stack.enter_context(_Recorder(self.rec))
        for register in (_module.register_module_parameter_registration_hook,
                         _module.register_module_buffer_registration_hook):
            self._stack.callback(register(_note_pending).remove)
        _active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _active.remove(self)
        self._stack.__exit__(*exc)
        if exc[0] is None and not _active:
            _install_first_call_hook()


# -- materialised whole at the first call, unless a parallel runtime takes the network --------------------------------
_pending: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_hook: list = []
_runtime_takes: list[Callable[[torch.nn.Module], bool]] = []  # set by the parallel runtime: will it lay this out?


def _note_pending(module: torch.nn.Module, name: str, tensor: Any) -> None:
    if is_meta(tensor):
        _pending.add(module)


_held = [0]  # > 0: calls leave the recorded meta tensors as they are (calls_keep_meta)


@contextlib.contextmanager
def calls_keep_meta():
    """Calls inside make nothing real: the AUTO planner traces a meta-built network on meta tensors, and its first
    call would otherwise make it whole on every rank (as a stand-alone call does)."""
    _held[0] += 1
    try:
        yield
    finally:
        _held[0] -= 1


@contextlib.contextmanager
def swapped(modules: list, which: Callable[[torch.Tensor], bool], make: Callable[[torch.Tensor], torch.Tensor]):
    """While inside, every parameter and buffer ``t`` of ``modules`` for which ``which(t)`` stands replaced by
    ``make(t)`` -- one replacement per tensor, so tied ones stay tied; a parameter's is a parameter, with its
    ``requires_grad`` -- and is put back afterwards, the same objects. A pipeline traces a meta-built network with
    host stand-ins of its meta tensors; the AUTO planner traces one with meta twins of the tensors already made."""
    saved, made = [], {}
    try:
        for root in modules:
            for module in root.modules():
                for table in (module._parameters, module._buffers):
                    for name, t in list(table.items()):
                        if t is None or not which(t):
                            continue
                        if id(t) not in made:
                            r = make(t)
                            made[id(t)] = torch.nn.Parameter(r, t.requires_grad) if isinstance(
                                t, torch.nn.Parameter) else r
                        saved.append((table, name, t))
                        table[name] = made[id(t)]
        yield
    finally:
        for table, name, t in reversed(saved):
            table[name] = t


def taken_by(predicate: Callable[[torch.nn.Module], bool]) -> None:
    """The parallel runtime says which first calls it will lay out itself (it materialises their slices)."""
    _runtime_takes[:] = [predicate]


def _install_first_call_hook() -> None:
    from torch.nn.modules import module as _module

    if _hook or not _pending:
        return

    def first_call(module: torch.nn.Module, args: tuple) -> None:
        if _held[0]:
            return
        for waiting in list(_pending):
            if not has_meta(waiting, recurse=False):  # laid out (or materialised) by a parallel runtime
                _pending.discard(waiting)
        if not _pending:
            _remove_hook()
        elif not (_runtime_takes and _runtime_takes[0](module)):
            materialize_pending()

    handle = _module.register_module_forward_pre_hook(first_call)
    _module._global_forward_pre_hooks.move_to_end(handle.id, last=False)  # before the parallel runtime's
    _hook.append(handle)


def materialize_pending() -> int:
    """Every recorded meta parameter and buffer not laid out yet made real and whole; returns how many."""
    done, made = 0, {}
    for module in list(_pending):
        done += materialize_module(module, recurse=False, made=made)  # one shared map: tied ones stay tied
    _pending.clear()
    _remove_hook()
    return done


def _remove_hook() -> None:
    while _hook:
        _hook.pop().remove()


def deferred_init(module_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``model = autopar.deferred_init(GPT, config)``: torchdistx's spelling. The network is built on the meta
    device, no parameter takes memory; each rank materialises only what it keeps, with the values
    ``GPT(config)`` would have drawn, when the parallel runtime lays it out (its first call, or
    ``autopar.parallelize``)."""
    with recording():
        return module_fn(*args, **kwargs)


# -- asking ---------------------------------------------------------------------------------------------------------
def is_meta(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def recordings_of(module: torch.nn.Module) -> list[Recording]:
    """The recordings a network's meta tensors come from (one, unless parts were built apart)."""
    found: dict[int, Recording] = {}
    for t in [*module.parameters(), *module.buffers()]:
        rec = _owner(t)
        if rec is not None:
            found[id(rec)] = rec
    return list(found.values())


def is_recorded(t: torch.Tensor) -> bool:
    return _owner(t) is not None


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole value a recorded meta tensor stands for (a new CPU tensor of its dtype and shape)."""
    rec = _owner(t)
    if rec is None:
        raise ConfigError("a tensor on the meta device has no recorded initial value: build the network under "
                          "autopar.deferred_init(...) or nn.utils.no_init_parameters()")
    return rec.value(rec.ref(t))


def local_slice(full: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor:
    """This rank's piece of ``full`` laid out as ``placements`` on ``mesh`` (a view: clone it to let ``full``
    go)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tuple(full.shape), mesh, tuple(placements))
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def slice_of(t: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor:
    """This rank's piece of a recorded meta tensor laid out as ``placements`` on ``mesh``: its whole value made,
    sliced, and let go (a copy of the slice is all that stays) -- or, for a tensor a checkpoint is about to fill
    (:func:`expect_loaded`), the slice alone, unset."""
    if t in _to_load:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, _ = compute_local_shape_and_global_offset(tuple(t.shape), mesh, tuple(placements))
        return _unset(shape, t.dtype)
    return local_slice(full_value(t), mesh, placements).clone()


# meta tensor -> True: a checkpoint read right after the network is laid out gives its value (``resume_from=``)
_to_load = WeakIdKeyDictionary()


def expect_loaded(module: torch.nn.Module, names: set[str]) -> list[str]:
    """The floating-point meta parameters and buffers of ``module`` named in ``names`` will be read from a
    checkpoint right after the network is laid out: each rank makes only its slice (or its whole tensor, where the
    mode keeps it whole), filled with NaN -- never its initial value, no initialiser replayed, never whole where
    the mode slices. :func:`check_loaded` then finds any the checkpoint did not fill. Returns the names marked."""
    marked = []
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if name in names and is_meta(t) and t.is_floating_point() and t not in _to_load:
            _to_load[t] = True
            marked.append(name)
    return marked


def check_loaded(module: torch.nn.Module, marked: list[str], source: str) -> None:
    """Every tensor :func:`expect_loaded` marked holds what the checkpoint gave it (no NaN left of the fill; a
    checkpoint whose values are NaN -- a diverged run's -- reads as unfilled too). Every rank raises if any rank
    found one, so that none goes on into a collective alone."""
    from torch.distributed.tensor import DTensor

    tensors = dict([*module.named_parameters(), *module.named_buffers()])
    # (one still on the meta device is another pipeline stage's: this rank never makes it)
    missed = [n for n in marked if n in tensors and not is_meta(tensors[n]) and bool(torch.isnan(
        tensors[n].to_local() if isinstance(tensors[n], DTensor) else tensors[n]).any())]
    forget_loaded(module)
    from autopar.comm.management import any_rank

    if any_rank(bool(missed)):
        names = ", ".join(missed[:5]) + (" and more" if len(missed) > 5 else "") if missed else "tensors on another rank"
        raise ConfigError(f"{source} did not fill {names}: the network was built on the meta device and these were "
                          "left for the checkpoint -- build it eagerly, or save the checkpoint from this network")


def forget_loaded(module: torch.nn.Module | None = None) -> None:
    """Drop the marks :func:`expect_loaded` left (``module``'s, or every one)."""
    if module is None:
        _to_load.clear()
        return
    for t in [*module.parameters(), *module.buffers()]:
        _to_load.pop(t, None)


def _unset(shape, dtype) -> torch.Tensor:
    return torch.full(tuple(shape), float("nan"), dtype=dtype)


def has_meta(module: torch.nn.Module, recurse: bool = True) -> bool:
    return any(is_meta(t) for t in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)])


_loaded = WeakIdKeyDictionary()  # meta tensor -> the value loaded into it


def assign(t: torch.Tensor, value: torch.Tensor) -> None:
    """A value loaded into a meta tensor (``load_param_into_net`` before the network is laid out): recorded as its
    last write, so that it is what each rank materialises -- its slice only, where the mode slices it."""
    rec = _owner(t) or Recording()
    ref = rec.ref(t)
    value = value.detach()
    rec.add(_Op(torch.Tensor.copy_, (ref, _Real(value)), {}, (ref.sid,), () if rec.covers(ref) else (ref.sid,),
                rec.covers(ref)))
    _loaded[t] = value


def record_initialisers(module: torch.nn.Module, name: str = "network") -> None:
    """Give the meta tensors of a network built under a plain ``torch.device("meta")`` a record: its own
    initialisers run now, recorded -- the root's ``init_weights()`` if it has one (torchtitan, Hugging Face), else
    every module's ``reset_parameters()`` (``reset_running_stats()`` for a norm's buffers). A tensor no
    initialiser writes is an error naming its module."""
    tensors = dict([*module.named_parameters(), *module.named_buffers()])
    unrecorded = {id(t) for t in tensors.values() if is_meta(t) and not is_recorded(t)}
    if not unrecorded:
        return
    built = any(is_recorded(t) and t not in _loaded for t in tensors.values()) or any(
        sub in _pending for sub in module.modules())
    if built:  # a recorded build changed afterwards: its initialisers would draw again, from another random state
        stray = next(k for k, t in tensors.items() if id(t) in unrecorded)
        raise ConfigError(f"'{stray}' is on the meta device without a record, in a network autopar.deferred_init "
                          f"(or no_init_parameters) recorded: a .to(dtype) or a parameter added after the build is "
                          f"not recorded -- do it inside the build (autopar.deferred_init(lambda: "
                          f"Net().to(torch.bfloat16)))")
    with recording() as r:
        init_weights = getattr(module, "init_weights", None)
        if callable(init_weights):
            init_weights()
        else:
            for sub in module.modules():
                own = [t for t in [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
                       if id(t) in unrecorded]
                if not own:
                    continue
                reset = getattr(sub, "reset_parameters", None) or getattr(sub, "reset_running_stats", None)
                if callable(reset):
                    reset()
    for t in [*module.parameters(), *module.buffers()]:  # a value loaded before stays what was loaded
        if t in _loaded:
            assign(t, _loaded[t])
    for sub_name, sub in module.named_modules():
        for attr, t in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
            if id(t) in unrecorded and not r.rec.writers.get(_IDS.get(t.untyped_storage())):
                where = f"'{sub_name}' ({type(sub).__name__})" if sub_name else f"the {name} ({type(sub).__name__})"
                raise ConfigError(
                    f"module {where} was built on the meta device and nothing gives '{attr}' its initial values: "
                    f"give {type(sub).__name__} a reset_parameters() that fills it, or build the network under "
                    f"autopar.deferred_init(...) (MindSpore: nn.utils.no_init_parameters()), which records how it "
                    f"was filled")


def materialize_module(module: torch.nn.Module, buffers_only: bool = False, recurse: bool = True,
                       device: torch.device | None = None, frozen_only: bool = False, made: dict | None = None) -> int:
    """Every recorded meta parameter (and buffer) of ``module`` made real and whole, in place (the same Python
    objects, so optimizers and names made before keep working; where something holds a weak reference to one, a
    new parameter takes its place in every module and optimizers are moved onto it before their next step, as for
    any parameter a parallel mode replaces). ``frozen_only``: buffers and parameters that do not train.
    Returns how many."""
    return _replace_meta(module, lambda t: _whole_value(t, device), recurse=recurse, buffers_only=buffers_only,
                         select=lambda name, t: not (frozen_only and t.requires_grad), made=made)


def _whole_value(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A meta tensor's whole initial value (unset where a checkpoint is about to fill it), on ``device``."""
    value = _unset(t.shape, t.dtype) if t in _to_load else full_value(t)
    return value if device is None else value.to(device)


def _replace_meta(module: torch.nn.Module, value_of: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True,
                  buffers_only: bool = False, select: Callable[[str, torch.Tensor], bool] = lambda name, t: True,
                  made: dict | None = None) -> int:
    """The one walk every materialisation takes: each meta parameter and buffer of ``module`` that ``select(name,
    tensor)`` takes swapped for ``value_of(tensor)``; a tensor tied under several names stays one tensor (``made``:
    id of a meta tensor -> what holds its value now, shared across calls). Returns how many were made."""
    done = 0
    made = {} if made is None else made
    for prefix, sub in (module.named_modules(remove_duplicate=False) if recurse else [("", module)]):
        for table in ([sub._buffers] if buffers_only else [sub._parameters, sub._buffers]):
            for attr, t in list(table.items()):
                if t is None:
                    continue
                if id(t) in made:
                    table[attr] = made[id(t)]
                    continue
                if not is_meta(t) or not select(f"{prefix}.{attr}" if prefix else attr, t):
                    continue
                made[id(t)] = table[attr] = _swap(t, value_of(t))
                done += 1
    return done


def take(network: torch.nn.Module) -> None:
    """A parallel runtime materialises ``network`` itself (a pipeline: each stage only its own pieces' tensors): its
    modules no longer wait for the first call's whole materialisation."""
    for module in network.modules():
        _pending.discard(module)
    if not _pending:
        _remove_hook()


def materialize_named(network: torch.nn.Module, names: set[str], device: torch.device | None = None) -> int:
    """The meta parameters and buffers of ``network`` named in ``names`` made real and whole (a pipeline stage's:
    the rest never is); tied ones stay one tensor. Returns how many."""
    return _replace_meta(network, lambda t: _whole_value(t, device), select=lambda name, t: name in names)


def allocate(module: torch.nn.Module, device: torch.device | None = None) -> int:
    """Storage for every meta parameter and buffer of ``module``, its values left unset (never computed): what is
    about to be overwritten whole -- a pipeline stage receiving the other stages' tensors. Returns how many."""
    return _replace_meta(module, lambda t: torch.empty(tuple(t.shape), dtype=t.dtype, device=device or _CPU))


def make_whole(module: torch.nn.Module, device: torch.device | None = None) -> int:
    """What of ``module`` is still on the meta device made real and whole, on ``device`` (the CPU): a network not
    laid out by a mode that slices (data parallel, a save or load before the first call, a call no mode takes).
    A plain meta build's initialisers are recorded first. Returns how many tensors."""
    if not has_meta(module):
        return 0
    record_initialisers(module)
    return materialize_module(module, device=device)


def _swap(old: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``old`` (a meta tensor or parameter) holding ``value``: the same Python object and attributes where torch
    can swap them, else a new one recorded as its replacement."""
    from autopar.common import replaced

    new = replaced.successor(old, value)
    try:
        torch.utils.swap_tensors(old, new)
        return old
    except RuntimeError:  # something holds a weak reference to it (the registry of replaced parameters)
        replaced.record(old, new)
        return new
