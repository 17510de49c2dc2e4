"""Checkpoint faults (issue 33, items 1, 2 and 6): nothing lost when a rank dies while saving, no merge of slices
from two saves, and full disks, other shapes and missing slice files end in one line naming the file."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from autopar.checkpoint import store
from autopar.checkpoint.api import load_distributed_checkpoint, merge_sliced_checkpoints, save_checkpoint
from autopar.errors import CheckpointError
from procutil import SCRIPTS, autopar_cmd

SAVE_KILL = str(SCRIPTS / "save_kill_job.py")

# Two ranks, the first layer's weight split by rows (SEMI_AUTO); two sliced saves with every parameter = 4, then 8,
# in ROOT/ckpt_<rank>/net-1_<k>.ckpt.
SAVER = """
import sys, torch
import autopar as ms
ms.set_auto_parallel_context(parallel_mode='semi_auto_parallel', gradients_mean=True)
ms.init()
rank = ms.get_rank()
net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
ms.shard(net[0], ((1, 1), (2, 1)))
net(torch.ones(4, 8))
for k in (4, 8):
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(float(k))
    ms.save_checkpoint(net, f'{sys.argv[1]}/ckpt_{rank}/net-1_{k}.ckpt', integrated_save=False)
"""


def net(hidden=32):
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))


def test_a_rank_killed_while_saving_loses_nothing(procs, tmp_path):
    """keep_checkpoint_max=1, rank 1 killed while writing step 6 after rank 0 wrote it: rank 0 must not have
    pruned step 4 (the newest both completed), so the restart continues from step 5 -- it restarted at step 1 and
    the new run's pruning deleted the old files. A resume that then finds no step common to all ranks says so."""
    root = tmp_path / "run"
    root.mkdir()
    res = procs.run(autopar_cmd("launch", "-n", "2", "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"),
                                SAVE_KILL, str(root), "1"), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "restart 1 of 1" in res.stderr
    assert json.loads((root / "ran_0_1.json").read_text())[0] == 5  # resumed after step 4, not from scratch
    assert [p.name for p in (root / "ckpt_0").iterdir()] == ["net-1_8.ckpt"]  # keep_checkpoint_max=1 still holds

    # no step in common: one clear line, nothing loaded, nothing removed
    (root / "ckpt_1" / "net-1_8.ckpt").rename(root / "ckpt_1" / "net-1_6.ckpt")
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs2"), SAVE_KILL, str(root),
                                "1"), timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "checkpoints were found but none that every rank completed (rank 0: epoch 1 step 8; rank 1: epoch 1 " \
           "step 6)" in res.stdout + res.stderr
    assert (root / "ckpt_0" / "net-1_8.ckpt").exists() and (root / "ckpt_1" / "net-1_6.ckpt").exists()
    assert not procs.wait_no_leftovers()


def test_sliced_checkpoints_of_two_saves_other_shapes_and_missing_files(procs, tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"), str(script),
                                str(tmp_path)), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    a, b = tmp_path / "ckpt_0" / "net-1_4.ckpt", tmp_path / "ckpt_1" / "net-1_8.ckpt"
    # rows 0-15 from one save and rows 16-31 from another are no checkpoint: refused, in one line
    res = procs.run(autopar_cmd("ckpt", "merge", str(a), str(b), "--out", str(tmp_path / "mixed.ckpt")), timeout=120)
    assert res.returncode == 2 and "autopar: error: the slices come from different saves" in res.stderr, res.stderr
    assert not (tmp_path / "mixed.ckpt").exists()
    with pytest.raises(CheckpointError, match="given twice"):
        merge_sliced_checkpoints([a, a], tmp_path / "twice.ckpt")
    merged = merge_sliced_checkpoints([a, tmp_path / "ckpt_1" / "net-1_4.ckpt"], tmp_path / "merged.ckpt")
    assert all(torch.equal(v, torch.full_like(v, 4.0)) for v in store.read_integrated(merged)["model"].values())

    good = [tmp_path / "ckpt_0" / "net-1_8.ckpt", b]
    # another shape: the parameter, both shapes and the files (was DCP's "Size mismatch ... for model.0.weight")
    with pytest.raises(CheckpointError) as info:
        load_distributed_checkpoint(net(16), good)
    assert str(info.value) == f"'0.weight' has shape (32, 8) in the checkpoint ({good[0]}, {b}) but (16, 8) in the network"
    # a directory of per-rank directories (as `autopar ckpt merge DIR`), given as one path: the newest common save
    fresh = net()
    load_distributed_checkpoint(fresh, str(tmp_path))
    assert all(torch.equal(v, torch.full_like(v, 8.0)) for v in fresh.state_dict().values())
    # ... whose newest save lacks a rank: named, not an older save quietly taken (nor "too many values to unpack")
    shutil.move(str(b), str(tmp_path / "away"))
    with pytest.raises(CheckpointError) as info:
        load_distributed_checkpoint(net(), str(tmp_path))
    assert str(info.value) == (f"{tmp_path}: the newest save net-1_8.ckpt is missing a rank's slices ({tmp_path}/ckpt_1"
                               f" (rank 1 of 2) has no net-1_8.ckpt); give the checkpoints of an older save "
                               f"explicitly (the newest every rank has: net-1_4.ckpt)")
    shutil.move(str(tmp_path / "away"), str(b))
    # a rank's files lost: named with the rank (its .metadata, or a slice file the metadata lists)
    shutil.copy(b / ".metadata", tmp_path / "metadata")
    (b / ".metadata").unlink()
    res = procs.run(autopar_cmd("ckpt", "merge", str(tmp_path), "--out", str(tmp_path / "m.ckpt")), timeout=120)
    assert res.stderr.strip() == (f"autopar: error: checkpoint {b} (rank 1 of 2) has no .metadata: that rank's save "
                                  "did not complete -- give a save every rank completed"), res.stderr
    shutil.copy(tmp_path / "metadata", b / ".metadata")
    for f in b.glob("*.distcp"):
        f.unlink()
    with pytest.raises(CheckpointError) as info:
        load_distributed_checkpoint(net(), good)
    assert str(info.value) == (f"checkpoint {b} (rank 1 of 2) lacks __0_0.distcp, which its .metadata lists: that "
                               "rank's slices are lost -- give a save every rank completed")


def test_a_full_disk_names_the_file_and_the_reason(tmp_path):
    if shutil.which("mount") is None or subprocess.run(["id", "-u"], capture_output=True, text=True).stdout.strip() \
            != "0":
        pytest.skip("needs root to mount a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        big = net(32768)  # 1.7 MB of parameters on a 1 MB disk
        for integrated in (True, False):
            target = disk / f"net_{integrated}.ckpt"
            with pytest.raises(CheckpointError, match="No space left on device") as info:  # was "unexpected pos"
                save_checkpoint(big, target, integrated_save=integrated)
            assert "\n" not in str(info.value) and f"cannot write checkpoint {target}" in str(info.value)
            leftovers = [p.name for p in Path(disk).iterdir() if ".tmp-" in p.name]
            assert not leftovers  # the half-written temporary is gone; an earlier complete file stays
            for p in disk.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    finally:
        subprocess.run(["umount", "-l", str(disk)])
