"""A GPU per rank that is not there: ``autopar launch --dry-run --dry-run-device cuda``.

The script runs its CUDA path as rank r of N would on a cluster -- ``torch.cuda.set_device(local_rank)``,
``.cuda()`` / ``.to(device)``, NCCL as the backend, ``torch.autocast("cuda")`` and loss scaling, FSDP2's streams --
on this CPU: every tensor it puts on ``cuda:k`` is a fake tensor of that device (shape, dtype and device, no storage),
so a CPU/CUDA mix-up, a rank on another rank's device or a CPU-only call fails here as it would there, before a GPU
is booked. What this takes, since torch without a GPU refuses a CUDA call it would answer with one:

- ``torch.cuda`` answers as a host with ``local_size`` GPUs of the simulated machine (``--dry-run-machine``, else an
  H100): its name, memory, capability, streams and events (which order nothing: nothing runs), its random seeds and
  its memory statistics -- ``max_memory_allocated`` is the dry run's own count of the fake device's tensors.
- ``Tensor.cuda`` becomes ``.to("cuda:k")``, ``pin_memory`` keeps the tensor (no page-locked memory here).
- The autograd engine asks the CUDA hooks whether device k has a context before a backward (to sync streams
  afterwards); with no GPU that question raises ("hasPrimaryContext expects a valid device index"), torch's own
  FakeTensor work-around allocating a real tensor on the GPU first (pytorch#92627). The hooks object's table of
  virtual functions is copied with that one entry answering "no context": nothing to sync, which is true.

A torch whose hooks do not take the patch makes the dry run stop with one line, found by a backward tried at once.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
from dataclasses import dataclass

import torch

from autopar.errors import ConfigError

# AcceleratorHooksInterface's virtual functions, in declaration order (ATen/detail/AcceleratorHooksInterface.h):
# the destructor (two entries in the Itanium ABI: complete and deleting), isBuilt, isAvailable, hasPrimaryContext
_HAS_PRIMARY_CONTEXT_SLOT = 4
_VTABLE_COPY = 64  # entries copied: more than the interface has (the copy's tail is never read)


# compute capability by the device's name (NVIDIA's CUDA GPUs table), first match wins; another name: 8.0
_CAPABILITY = (("B200", (10, 0)), ("H100", (9, 0)), ("H200", (9, 0)), ("H800", (9, 0)), ("A100", (8, 0)),
               ("A800", (8, 0)), ("L40", (8, 9)), ("L4", (8, 9)), ("A10", (8, 6)), ("V100", (7, 0)), ("T4", (7, 5)))


@dataclass(frozen=True)
class DeviceProperties:
    """What ``torch.cuda.get_device_properties`` says of the simulated device."""
    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int
    is_integrated: bool = False
    is_multi_gpu_board: bool = False


def device_properties(machine: str | None) -> DeviceProperties:
    """The simulated GPU: the device of ``--dry-run-machine`` (a preset or a cluster file), else an H100 80 GB."""
    from autopar.planner.cluster import load_cluster

    spec = load_cluster(machine or "h100-ib")
    name = spec.device_name
    major, minor = next((cc for part, cc in _CAPABILITY if part in name.upper()), (8, 0))
    return DeviceProperties(name=f"NVIDIA {name}", total_memory=int(spec.memory), major=major, minor=minor,
                            multi_processor_count=int(spec.sms or 108))


class _World:
    """This simulated process's GPUs: how many, which is current, the seeds, the memory count."""

    def __init__(self, local_size: int, props: DeviceProperties, tracker) -> None:
        self.current = 0  # as on a GPU host: device 0 until the script sets another
        self.count = local_size
        self.props = props
        self.tracker = tracker
        self.seed = 0

    def index(self, device=None) -> int:
        if device is None:
            return self.current
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            device = self.current if device.index is None else device.index
        if not 0 <= int(device) < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal (device {int(device)} on a host of {self.count} "
                               "GPUs, as the dry run simulates them: one per local rank)")
        return int(device)


class Stream:
    """A CUDA stream that orders nothing (nothing runs): FSDP2's and the user's waits and records pass."""

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        self.device = torch.device("cuda", _WORLD.index(device)) if _WORLD else torch.device("cuda", 0)
        self.device_index, self.device_type = self.device.index, 1  # torch's DeviceType.CUDA
        self.priority, self.stream_id, self.cuda_stream = priority, 0, 0

    def is_capturing(self) -> bool:  # a CUDA graph being captured: never
        return False

    def wait_stream(self, stream) -> None: ...
    def wait_event(self, event) -> None: ...
    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None: ...


class Event:
    """A CUDA event: recorded at once, complete at once, 0 ms after any other (a dry run times nothing)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 **kwargs) -> None:
        self.enable_timing = enable_timing

    def record(self, stream=None) -> None: ...
    def wait(self, stream=None) -> None: ...
    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event) -> float:
        return 0.0


_WORLD: _World | None = None
_KEEP: list = []  # what C++ points at (the copied table, the callback) lives as long as the process


def _no_primary_context() -> None:
    """Point the CUDA hooks' ``hasPrimaryContext`` at an answer of "no" (see the module's docstring)."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        get_hooks = lib._ZN2at6detail12getCUDAHooksEv  # at::detail::getCUDAHooks()
    except (OSError, AttributeError) as exc:
        raise ConfigError(f"--dry-run-device cuda: this torch ({torch.__version__}) does not expose its CUDA hooks "
                          f"({exc}); dry-run on the CPU instead") from None
    get_hooks.restype = ctypes.c_void_p
    hooks = get_hooks()
    vptr = ctypes.c_void_p.from_address(hooks)
    # the table with its two ABI words before the first entry (offset to top, type info)
    old = (ctypes.c_void_p * (_VTABLE_COPY + 2)).from_address(vptr.value - 2 * ctypes.sizeof(ctypes.c_void_p))
    table = (ctypes.c_void_p * (_VTABLE_COPY + 2))(*old)
    answer = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_int8)(lambda this, index: False)
    table[2 + _HAS_PRIMARY_CONTEXT_SLOT] = ctypes.cast(answer, ctypes.c_void_p).value
    _KEEP.extend((table, answer))
    original = vptr.value
    vptr.value = ctypes.addressof(table) + 2 * ctypes.sizeof(ctypes.c_void_p)
    # the copy is Python's memory, freed as the interpreter ends -- before C++ destroys the hooks object through
    # its table: the hooks get their own back first
    atexit.register(lambda: setattr(vptr, "value", original))


def _as_cuda(device=None) -> torch.device:
    return torch.device("cuda", _WORLD.index(device))


def _tensor_methods() -> None:
    def cuda(self, device=None, non_blocking: bool = False, memory_format=torch.preserve_format):
        return self.to(_as_cuda(device), non_blocking=non_blocking, memory_format=memory_format)

    def pin_memory(self, device=None):
        return self

    torch.Tensor.cuda = cuda
    torch.Tensor.pin_memory = pin_memory
    torch.Tensor.record_stream = lambda self, stream: None


def _rng_state(device=None) -> torch.Tensor:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return torch.zeros(16, dtype=torch.uint8)


def _memory(device=None) -> int:
    return int(_WORLD.tracker.current_device_bytes)


def _peak(device=None) -> int:
    return int(_WORLD.tracker.user_peak)


def _reset_peak(device=None) -> None:
    _WORLD.tracker.user_peak = _WORLD.tracker.current_device_bytes


def _memory_stats(device=None) -> dict:
    return {"allocated_bytes.all.current": _memory(), "allocated_bytes.all.peak": _peak(),
            "reserved_bytes.all.current": _memory(), "reserved_bytes.all.peak": _peak(), "num_alloc_retries": 0,
            "num_ooms": 0}


@contextlib.contextmanager
def _device(device):
    before = _WORLD.current
    if device is not None and device != -1:
        _WORLD.current = _WORLD.index(device)
    try:
        yield
    finally:
        _WORLD.current = before


def _set_device(device) -> None:
    _WORLD.current = _WORLD.index(device)


def _own(value):
    """A function of its own for each name it answers under: torch.compile's rules map each torch function object
    to one name, and refuse an object found under two."""
    if isinstance(value, type):
        return value

    def answer(*args, **kwargs):
        return value(*args, **kwargs)

    return answer


def _cuda_module(props: DeviceProperties) -> None:
    cuda = torch.cuda
    nothing = (lambda *a, **k: None)
    answers = {
        "is_available": lambda: True, "is_initialized": lambda: True, "_lazy_init": nothing, "init": nothing,
        "device_count": lambda: _WORLD.count, "current_device": lambda: _WORLD.current, "set_device": _set_device,
        "device": _device, "device_of": lambda t: _device(t.device if t.device.type == "cuda" else None),
        "get_device_name": lambda device=None: props.name,
        "get_device_properties": lambda device=None: props,
        "get_device_capability": lambda device=None: (props.major, props.minor),
        "is_bf16_supported": lambda including_emulation=True: props.major >= 8,
        "synchronize": nothing, "empty_cache": nothing, "ipc_collect": nothing,
        "manual_seed": lambda seed: setattr(_WORLD, "seed", int(seed)),
        "manual_seed_all": lambda seed: setattr(_WORLD, "seed", int(seed)),
        "seed": nothing, "seed_all": nothing, "initial_seed": lambda: _WORLD.seed,
        "get_rng_state": _rng_state, "get_rng_state_all": lambda: [_rng_state() for _ in range(_WORLD.count)],
        "set_rng_state": nothing, "set_rng_state_all": nothing,
        "memory_allocated": _memory, "max_memory_allocated": _peak, "memory_reserved": _memory,
        "max_memory_reserved": _peak, "reset_peak_memory_stats": _reset_peak, "reset_max_memory_allocated": _reset_peak,
        "reset_accumulated_memory_stats": nothing, "memory_stats": _memory_stats,
        "mem_get_info": lambda device=None: (max(0, props.total_memory - _memory()), props.total_memory),
        "Stream": Stream, "Event": Event, "stream": lambda stream=None: contextlib.nullcontext(),
        "current_stream": lambda device=None: Stream(device), "default_stream": lambda device=None: Stream(device),
        "set_stream": nothing, "is_current_stream_capturing": lambda: False,
    }
    for name, value in answers.items():
        setattr(cuda, name, _own(value))
    for name in ("range_push", "range_pop", "mark"):
        setattr(cuda.nvtx, name, _own(nothing))
    cuda.nvtx.range = _own(lambda *a, **k: contextlib.nullcontext())
    # torch's own default device (FSDP2's default mesh, a DeviceMesh's device) asks the accelerator
    torch._C._get_accelerator = _own(lambda: torch.device("cuda"))
    accel = torch.accelerator
    for name, value in {"is_available": lambda: True, "device_count": lambda: _WORLD.count,
                        "current_accelerator": lambda check_available=False: torch.device("cuda"),
                        "current_device_index": lambda: _WORLD.current, "current_device_idx": lambda: _WORLD.current,
                        "set_device_index": _set_device, "set_device_idx": _set_device,
                        "current_stream": lambda device=None: Stream(device), "set_stream": nothing,
                        "synchronize": nothing, "empty_cache": nothing, "memory_allocated": _memory,
                        "max_memory_allocated": _peak, "reset_peak_memory_stats": _reset_peak}.items():
        if hasattr(accel, name):
            setattr(accel, name, _own(value))


def _fused_attention() -> None:
    """``scaled_dot_product_attention`` on a simulated GPU runs the kernel torch picks there (its sdp_utils, for
    sm80 and newer): flash attention for fp16/bf16 without a mask and heads of at most 256 features in multiples of
    8, else memory-efficient attention (masks too, fp32 too), else the math path -- each where the user's
    ``torch.backends.cuda`` / ``sdpa_kernel`` leaves it enabled. torch's own choice needs the device's properties,
    so with no GPU it takes the math path, whose fp32 score matrix a cluster never stores."""
    import torch.nn.functional as F

    math = F.scaled_dot_product_attention
    backends = torch.backends.cuda

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        head = query.shape[-1] if query.dim() == 4 else 0
        if query.device.type != "cuda" or not head or query.is_nested or (attn_mask is not None and is_causal):
            return math(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if enable_gqa and key.shape[-3] != query.shape[-3]:  # each query head's keys, as the kernels read them
            key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
            value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
        low = query.dtype in (torch.float16, torch.bfloat16)
        if backends.flash_sdp_enabled() and low and attn_mask is None and head <= 256 and head % 8 == 0:
            return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                      scale=scale)[0]
        if backends.mem_efficient_sdp_enabled() and head % (8 if low else 4) == 0:
            bias = None if attn_mask is None else attn_mask.expand(*query.shape[:-1], key.shape[-2])
            if bias is not None and bias.dtype == torch.bool:  # a boolean mask: what it keeps adds 0, the rest -inf
                bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill(~bias, -float("inf"))
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, grad, dropout_p,
                                                                          is_causal, scale=scale)[0]
        return math(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = scaled_dot_product_attention


def _backward_runs() -> None:
    """A backward on a fake CUDA tensor, tried at once: the patch took, or the dry run says in one line why not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode():
            w = torch.ones(2, device="cuda", requires_grad=True)
            (w * 2).sum().backward()
    except RuntimeError as exc:
        raise ConfigError(f"--dry-run-device cuda: torch {torch.__version__} refused a backward on a simulated GPU "
                          f"({str(exc).splitlines()[0]}); dry-run on the CPU instead") from None


def install(local_size: int, tracker, machine: str | None = None) -> DeviceProperties:
    """Make this process a host of ``local_size`` simulated GPUs; ``tracker`` counts their memory."""
    global _WORLD
    if not torch.backends.cuda.is_built():
        raise ConfigError(f"--dry-run-device cuda needs a torch built with CUDA (this one is {torch.__version__}): "
                          "its kernels' shapes and autocast rules are what the dry run runs")
    props = device_properties(machine)
    _WORLD = _World(local_size, props, tracker)
    from torch._subclasses.fake_tensor import FakeTensorMode

    # the fake mode's own GPU-less set-up (a no-op CUDA device guard, tensors lifted on the host), which it skips
    # when torch.cuda says it has GPUs -- as it now will
    FakeTensorMode.avoid_device_init = property(lambda self: True)
    _no_primary_context()
    _tensor_methods()
    _cuda_module(props)
    _fused_attention()
    _backward_runs()
    return props
