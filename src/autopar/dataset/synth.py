"""Synthetic CIFAR-10 in the exact binary layout, for machines without internet (tests, CI, demos).

Why synthetic rather than random bytes: training examples and tests must show the loss going down. Each class
gets a fixed random low-frequency colour template; an image is its class template, randomly shifted (with wrap),
with random contrast and brightness, plus uniform pixel noise, clipped to uint8. A small conv net separates the
classes within a few hundred steps, yet single pixels are noisy enough that the task is not a lookup.
Everything is vectorised (60000 images in a few seconds) and determined by ``seed``.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from autopar.dataset.sources import (
    CIFAR10_CLASSES,
    CIFAR10_DIRNAME,
    CIFAR10_RECORD,
    CIFAR10_TEST_FILES,
    CIFAR10_TRAIN_FILES,
)
from autopar.errors import DatasetError

_SIZE = 32
_MAX_SHIFT = 4
_NOISE_HALF_WIDTH = 42.0  # uniform noise in [-42, 42]: std ~24


def _templates(rng: np.random.Generator) -> np.ndarray:
    """(10, 3, 32, 32) float32 class templates: a base colour plus a few random low-frequency waves."""
    yy, xx = np.meshgrid(np.arange(_SIZE), np.arange(_SIZE), indexing="ij")
    waves = 4
    freq = rng.integers(0, 4, size=(10, waves, 2))  # cycles per image along y and x
    freq[:, :, 0][(freq == 0).all(axis=2)] = 1  # no constant "wave"
    phase = rng.uniform(0, 2 * np.pi, size=(10, waves))
    amp = rng.uniform(-1, 1, size=(10, waves, 3))  # per-channel amplitude
    arg = 2 * np.pi * (freq[..., 0, None, None] * yy + freq[..., 1, None, None] * xx) / _SIZE + phase[..., None, None]
    pattern = np.einsum("kwc,kwyx->kcyx", amp, np.cos(arg))  # (10, 3, 32, 32)
    pattern /= np.abs(pattern).max(axis=(1, 2, 3), keepdims=True)
    base = rng.uniform(70, 185, size=(10, 3, 1, 1))
    return (base + 60.0 * pattern).astype(np.float32)


def _shifted(templates: np.ndarray) -> np.ndarray:
    """All wrap-around shifts of every template: (10, 2s+1, 2s+1, 3, 32, 32)."""
    shifts = range(-_MAX_SHIFT, _MAX_SHIFT + 1)
    return np.stack([np.stack([np.roll(templates, (dy, dx), axis=(2, 3)) for dx in shifts], axis=1)
                     for dy in shifts], axis=1)


def synth_records(n: int, shifted: np.ndarray, rng: np.random.Generator, chunk: int = 1000) -> np.ndarray:
    """``n`` CIFAR-10 records (n, 3073) uint8 with balanced labels (exactly when n is a multiple of 10).

    Pixel noise is uniform (std ~24) drawn as bytes: several times cheaper than Gaussian draws and just as
    good at making single pixels unreliable. Work is done in chunks that stay in cache.
    """
    labels = rng.permutation(np.arange(n) % 10)
    k = shifted.shape[1]
    dy, dx = rng.integers(0, k, size=n), rng.integers(0, k, size=n)
    contrast = rng.uniform(0.6, 1.4, size=(n, 1, 1, 1)).astype(np.float32)
    bright = rng.uniform(-30, 30, size=(n, 1, 1, 1)).astype(np.float32)
    noise_scale = np.float32(2 * _NOISE_HALF_WIDTH / 255.0)
    rec = np.empty((n, CIFAR10_RECORD), dtype=np.uint8)
    rec[:, 0] = labels
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        img = shifted[labels[s:e], dy[s:e], dx[s:e]]  # (m, 3, 32, 32) float32, CHW as in the files
        img -= 128.0
        img *= contrast[s:e]
        img += bright[s:e] + np.float32(128.0 - _NOISE_HALF_WIDTH)
        img += rng.integers(0, 256, size=img.shape, dtype=np.uint8) * noise_scale
        np.clip(img, 0, 255, out=img)
        np.rint(img, out=img)
        rec[s:e, 1:] = img.reshape(e - s, -1)
    return rec


def _write_atomic(path: Path, data: bytes | np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if isinstance(data, np.ndarray):
            data.tofile(f)
        else:
            f.write(data)
    os.replace(tmp, path)


def synthetic_records(out_dir) -> int | None:
    """Records per file of the synthetic CIFAR-10 already in ``out_dir`` (every file complete and of one size),
    or None when there is none, or a damaged one -- so that a caller asking for another size rewrites it instead
    of silently training on the old one."""
    target = Path(out_dir).expanduser() / CIFAR10_DIRNAME
    sizes = set()
    for name in CIFAR10_TRAIN_FILES + CIFAR10_TEST_FILES:
        try:
            sizes.add((target / name).stat().st_size)
        except OSError:
            return None
    size = sizes.pop() if len(sizes) == 1 else 0
    return size // CIFAR10_RECORD if size and size % CIFAR10_RECORD == 0 else None


def write_synthetic_cifar10(out_dir, records_per_file: int = 10000, seed: int = 0) -> Path:
    """Write ``out_dir/cifar-10-batches-bin/`` (``data_batch_1..5.bin``, ``test_batch.bin``,
    ``batches.meta.txt``) with ``records_per_file`` records per file; returns that directory."""
    if isinstance(records_per_file, bool) or not isinstance(records_per_file, (int, np.integer)) \
            or records_per_file < 1:
        raise DatasetError(f"write_synthetic_cifar10: records_per_file must be a positive integer, "
                           f"got {records_per_file!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DatasetError(f"write_synthetic_cifar10: seed must be a non-negative integer, got {seed!r}")
    target = Path(out_dir).expanduser() / CIFAR10_DIRNAME
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DatasetError(f"write_synthetic_cifar10: cannot create {target}: {exc}") from None
    files = CIFAR10_TRAIN_FILES + CIFAR10_TEST_FILES
    seqs = np.random.SeedSequence(int(seed)).spawn(1 + len(files))
    shifted = _shifted(_templates(np.random.default_rng(seqs[0])))
    try:
        for name, ss in zip(files, seqs[1:]):
            _write_atomic(target / name, synth_records(int(records_per_file), shifted, np.random.default_rng(ss)))
        _write_atomic(target / "batches.meta.txt", ("\n".join(CIFAR10_CLASSES) + "\n").encode())
    except OSError as exc:
        raise DatasetError(f"write_synthetic_cifar10: cannot write into {target}: {exc}") from None
    return target
