"""``mindspore.runtime`` (2.5+): device memory and synchronisation settings, on the existing context.

``set_memory(max_size="28GB")`` is ``set_context(max_device_memory=...)`` (the AUTO planner's memory bound);
``synchronize()`` waits for the accelerator (nothing to wait for on the CPU). MindSpore's allocator tuning
(``init_size``, ``increase_size``, ``optimize_level``, ``huge_page_reserve_size``) and its thread/affinity knobs are
accepted and warned about once: torch's allocator and thread pools decide those.
"""
from __future__ import annotations

from typing import Any

import torch

from autopar import context
from autopar.errors import warn_once


def set_memory(init_size: Any = None, increase_size: Any = None, max_size: Any = None, optimize_level: Any = None,
               huge_page_reserve_size: Any = None) -> None:
    if max_size is not None:
        context.set_context(max_device_memory=max_size)
    others = {"init_size": init_size, "increase_size": increase_size, "optimize_level": optimize_level,
              "huge_page_reserve_size": huge_page_reserve_size}
    given = [k for k, v in others.items() if v is not None]
    if given:
        warn_once("runtime.set_memory", f"runtime.set_memory({', '.join(given)}=...) is accepted and not applied: "
                  f"torch's allocator sizes its own pools")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _accepted(name: str):
    def fn(*args: Any, **kwargs: Any) -> None:
        warn_once(f"runtime.{name}", f"runtime.{name}(...) is accepted and not applied: torch manages its threads "
                  f"and streams")

    fn.__name__ = name
    return fn


set_cpu_affinity = _accepted("set_cpu_affinity")
launch_blocking = _accepted("launch_blocking")
dispatch_threads_num = _accepted("dispatch_threads_num")
set_kernel_launch_group = _accepted("set_kernel_launch_group")
