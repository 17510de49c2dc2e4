"""Download and unpack the real CIFAR-10 binary archive (machines with internet).

Networking, checksums and archive handling are torchvision's (``torchvision.datasets.utils``); this module only
adds the CIFAR-10 constants, one-line :class:`DatasetError` messages, and a split between the network step
(:func:`download_cifar10`) and the verify-and-extract step (:func:`extract_cifar10_archive`), so the latter is
testable offline on a locally built archive.
"""
from __future__ import annotations

from pathlib import Path

from torchvision.datasets.utils import calculate_md5, check_integrity, download_url, extract_archive

from autopar.dataset.sources import CIFAR10_DIRNAME, CIFAR10_TEST_FILES, CIFAR10_TRAIN_FILES
from autopar.errors import DatasetError

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
CIFAR10_ARCHIVE = "cifar-10-binary.tar.gz"
CIFAR10_MD5 = "c32a1d4ab5d03f1284b67883e8d87530"
CIFAR10_FILES = CIFAR10_TRAIN_FILES + CIFAR10_TEST_FILES


def _complete(directory: Path) -> bool:
    return all((directory / f).is_file() for f in CIFAR10_FILES)


def extract_cifar10_archive(archive_path, out_dir, md5: str | None = CIFAR10_MD5) -> Path:
    """Verify ``archive_path`` against ``md5`` (skipped when None), extract it into ``out_dir`` and check that
    ``out_dir/cifar-10-batches-bin`` holds every expected ``.bin`` file. Returns that directory."""
    archive = Path(archive_path).expanduser()
    if not archive.is_file():
        raise DatasetError(f"extract_cifar10_archive: archive {archive} does not exist")
    if md5 is not None and not check_integrity(str(archive), md5):
        raise DatasetError(f"extract_cifar10_archive: checksum mismatch for {archive}: md5 is "
                           f"{calculate_md5(str(archive))}, expected {md5} (corrupt or partial download; delete it "
                           "and retry)")
    out = Path(out_dir).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        extract_archive(str(archive), str(out))
    except (OSError, EOFError, ValueError, RuntimeError) as exc:
        raise DatasetError(f"extract_cifar10_archive: cannot extract {archive} into {out}: {exc}") from None
    target = out / CIFAR10_DIRNAME
    missing = [f for f in CIFAR10_FILES if not (target / f).is_file()]
    if missing:
        raise DatasetError(f"extract_cifar10_archive: {archive} did not contain {', '.join(missing)} under "
                           f"{CIFAR10_DIRNAME}/ (is it the binary version of CIFAR-10?)")
    return target


def download_cifar10(out_dir, url: str = CIFAR10_URL, md5: str = CIFAR10_MD5) -> Path:
    """Download (unless a verified archive is already there) and extract CIFAR-10 into
    ``out_dir/cifar-10-batches-bin``; returns that directory. Does nothing if the files already exist."""
    out = Path(out_dir).expanduser()
    target = out / CIFAR10_DIRNAME
    if _complete(target):
        return target
    archive = out / CIFAR10_ARCHIVE
    if not check_integrity(str(archive), md5):
        try:
            out.mkdir(parents=True, exist_ok=True)
            download_url(url, str(out), filename=CIFAR10_ARCHIVE, md5=md5)
        except Exception as exc:  # noqa: BLE001 - urllib/http errors of many kinds
            raise DatasetError(f"download_cifar10: cannot download {url} into {out}: {type(exc).__name__}: "
                               f"{exc}") from None
    return extract_cifar10_archive(archive, out, md5=md5)
