"""The allocator lever: after ``prepare`` a training-like free/re-allocate cycle stops page-faulting (glibc only).

Run in fresh interpreters: the setting is process-wide and could not be undone for the rest of the suite.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, json, os, resource, torch
from autopar.parallel.api import prepare
from autopar.perf.tuning import tune_allocator


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
net = torch.nn.Linear(4, 4, device="meta" if os.environ.get("PROBE_META") else None)  # the FSDP2 idiom
prepare(net, None, torch.optim.SGD(net.parameters(), lr=0.1))
before = libc.mallinfo2().hblkhd
block = torch.ones(5 << 20)  # 20 MB: above glibc's initial mmap threshold (128 KB), below the tuned one (32 MB)
mapped_mb = (libc.mallinfo2().hblkhd - before) / 2**20
del block
before = libc.mallinfo2().hblkhd
block = torch.ones(5 << 20)  # the same again: glibc's own threshold rose past it when the first was unmapped
remapped_mb = (libc.mallinfo2().hblkhd - before) / 2**20
del block
before = libc.mallinfo2().hblkhd
block = torch.ones(16 << 20)  # 64 MB: above the largest mmap threshold glibc accepts (32 MB)
big_mapped_mb = (libc.mallinfo2().hblkhd - before) / 2**20
del block
before = libc.mallinfo2().hblkhd
block = torch.ones(5 << 20)  # the same again: glibc's own threshold rose past it when the first was unmapped
remapped_mb = (libc.mallinfo2().hblkhd - before) / 2**20
del block


def cycle():  # a step's activations: many 1 MB blocks, all freed at its end
    blocks = [torch.ones(256 * 1024) for _ in range(16)]
    del blocks


for _ in range(3):
    cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    cycle()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
print(json.dumps({"mapped_mb": mapped_mb, "remapped_mb": remapped_mb, "big_mapped_mb": big_mapped_mb,
                  "faults_per_cycle": faults, "tuned": tune_allocator(net)}))
"""


def probe(malloc: str, meta: bool = False) -> dict:
    env = dict(os.environ, AUTOPAR_MALLOC=malloc, PROBE_META="1" if meta else "")
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def has_glibc_mallinfo2() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    import ctypes

    return hasattr(ctypes.CDLL(None), "mallinfo2")  # glibc >= 2.33


@pytest.mark.skipif(not has_glibc_mallinfo2(), reason="glibc's mallopt and mallinfo2")
def test_prepare_keeps_freed_memory_instead_of_refaulting_it():
    off, on = probe("0"), probe("1")
    assert not off["tuned"] and on["tuned"]
    # glibc's own thresholds: a 20 MB block is a fresh mapping, unmapped (and faulted in again) on every reuse
    assert off["mapped_mb"] >= 20, off
    # tuned: it comes from the heap, and a free/re-allocate cycle re-faults none of the 16 MB it writes (whether
    # untuned glibc trims its heap there depends on what else sits at its top: ~4,000 faults a cycle or none, run to
    # run). A re-faulted cycle costs one fault per page; the interpreter and torch's threads add a few dozen of their
    # own on a busy host (77 seen in CI), so the bound is a tenth of the cycle's pages, not zero.
    cycle_pages = 16 * (1 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert on["mapped_mb"] == 0 and on["faults_per_cycle"] < cycle_pages / 10, on
    # a block above any threshold glibc accepts (a 64 MB weight's gradient, made anew every step) is mapped untuned
    # and comes from the heap tuned: no mapping at all
    assert off["big_mapped_mb"] >= 64 and on["big_mapped_mb"] == 0, (off, on)


@pytest.mark.skipif(not has_glibc_mallinfo2(), reason="glibc's mallopt and mallinfo2")
def test_lean_hands_every_large_block_back_and_a_meta_built_network_keeps_nothing_freed():
    off, lean, meta = probe("0"), probe("lean", meta=True), probe("1", meta=True)
    # built on the meta device because memory is tight: the default keeps no freed memory for it (glibc's own
    # thresholds, as untuned); lean applies to it (it runs on the CPU here)
    assert meta["mapped_mb"] >= 20 and meta["remapped_mb"] == 0, meta
    # glibc's own threshold rises past a block once it is unmapped, so the same block again comes from the heap --
    # where a ZeRO-3 step's per-layer gathers fragment it (a rank holds ~1.3x what its tensors hold). Lean: a mapping
    # every time, handed back when freed
    assert off["mapped_mb"] >= 20 and off["remapped_mb"] == 0, off
    assert lean["mapped_mb"] >= 20 and lean["remapped_mb"] >= 20 and lean["big_mapped_mb"] >= 64, lean
