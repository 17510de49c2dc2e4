"""Checkpoint files: missing, damaged, mixed from different saves, written to a full disk."""
import os
import subprocess

from sweep_core import Verdict, case

# Two ranks, a weight split by rows (SEMI_AUTO), sliced checkpoints of every parameter = k at "steps" 4 and 8, in
# ckpt_<rank>/net-1_<k>.ckpt, and an integrated one at step 8 in integrated/net-1_8.ckpt.
SAVER = """
import torch
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
    ms.save_checkpoint(net, f'ckpt_{rank}/net-1_{k}.ckpt', integrated_save=False)
ms.save_checkpoint(net, 'integrated/net-1_8.ckpt')
print('SAVED', flush=True)
"""

NET = "torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))"


def _saved(ctx):
    script = ctx.script(SAVER)
    logs = ctx.path("saver_logs")
    run = ctx.run(ctx.launch_cmd(2, script, logs=logs), 120, ctx.env())
    if run.rc != 0:
        raise RuntimeError(f"the saver job failed: {run.err[-500:]}")
    return ctx.dir


@case("checkpoint", "ckpt merge of slices from two different saves")
def merge_mixed(ctx):
    d = _saved(ctx)
    run = ctx.cli("ckpt", "merge", str(d / "ckpt_0/net-1_4.ckpt"), str(d / "ckpt_1/net-1_8.ckpt"),
                  "--out", str(d / "merged.ckpt"))
    return Verdict(run, "lost" if run.rc == 0 else None)


@case("checkpoint", "ckpt merge with a rank's slices missing")
def merge_missing_rank(ctx):
    d = _saved(ctx)
    return ctx.cli("ckpt", "merge", str(d / "ckpt_0/net-1_4.ckpt"), "--out", str(d / "merged.ckpt"))


@case("checkpoint", "ckpt merge --out under a file")
def merge_out_under_file(ctx):
    d = _saved(ctx)
    (d / "afile").write_text("x")
    return ctx.cli("ckpt", "merge", str(d / "ckpt_0/net-1_4.ckpt"), str(d / "ckpt_1/net-1_4.ckpt"),
                   "--out", str(d / "afile" / "merged.ckpt"))


@case("checkpoint", "load_distributed_checkpoint into another shape")
def sliced_shape_mismatch(ctx):
    d = _saved(ctx)
    return ctx.python(f"""
        import torch, autopar as ms
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        ms.load_distributed_checkpoint(net, ['{d}/ckpt_0/net-1_8.ckpt', '{d}/ckpt_1/net-1_8.ckpt'])
        print('ACCEPTED')
    """)


@case("checkpoint", "load_distributed_checkpoint with a slice file deleted")
def sliced_file_missing(ctx):
    d = _saved(ctx)
    for f in (d / "ckpt_1/net-1_8.ckpt").glob("*.distcp"):
        f.unlink()
    return ctx.python(f"""
        import torch, autopar as ms
        net = {NET}
        ms.load_distributed_checkpoint(net, ['{d}/ckpt_0/net-1_8.ckpt', '{d}/ckpt_1/net-1_8.ckpt'])
        print('ACCEPTED')
    """)


@case("checkpoint", "load_checkpoint of a missing file")
def load_missing(ctx):
    return ctx.python("import autopar as ms\nms.load_checkpoint('/nonexistent/net.ckpt')\n")


@case("checkpoint", "load_checkpoint of a truncated file")
def load_truncated(ctx):
    d = _saved(ctx)
    data = (d / "integrated/net-1_8.ckpt").read_bytes()
    (d / "cut.ckpt").write_bytes(data[: len(data) // 2])
    return ctx.python(f"import autopar as ms\nms.load_checkpoint('{d}/cut.ckpt')\n")


@case("checkpoint", "load_checkpoint of random bytes")
def load_random(ctx):
    ctx.path("r.ckpt").write_bytes(os.urandom(4096))
    return ctx.python(f"import autopar as ms\nms.load_checkpoint('{ctx.path('r.ckpt')}')\n")


@case("checkpoint", "load_checkpoint into a network of another shape")
def load_wrong_shape(ctx):
    d = _saved(ctx)
    return ctx.python(f"""
        import torch, autopar as ms
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        ms.load_checkpoint('{d}/integrated/net-1_8.ckpt', net)
    """)


@case("checkpoint", "ckpt info of random bytes")
def info_random(ctx):
    ctx.path("r.ckpt").write_bytes(os.urandom(4096))
    return ctx.cli("ckpt", "info", str(ctx.path("r.ckpt")))


@case("checkpoint", "ckpt convert-mindspore of random bytes")
def convert_random(ctx):
    ctx.path("r.ckpt").write_bytes(os.urandom(4096))
    return ctx.cli("ckpt", "convert-mindspore", str(ctx.path("r.ckpt")), "--out", str(ctx.path("o.ckpt")))


@case("checkpoint", "resume a 2-rank checkpoint in one process")
def resume_other_world(ctx):
    d = _saved(ctx)
    return ctx.python(f"""
        import torch
        from autopar.checkpoint.api import resume_state
        net = {NET}
        resume_state('{d}/ckpt_0', net)
    """)


class _Tmpfs:
    """A small tmpfs mounted for one case (root only): a full disk."""

    def __init__(self, path, size="1m"):
        self.path, self.size = path, size

    def __enter__(self):
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path)], check=True)
        return self.path

    def __exit__(self, *exc):
        subprocess.run(["umount", "-l", str(self.path)], check=False)


BIG_SAVE = """
import torch, autopar as ms
net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
ms.save_checkpoint(net, {path!r}, integrated_save={integrated})
print('ACCEPTED')
"""


@case("disk", "integrated save onto a full disk")
def full_disk_integrated(ctx):
    with _Tmpfs(ctx.path("full")) as mnt:
        return ctx.python(BIG_SAVE.format(path=str(mnt / "net.ckpt"), integrated=True))


@case("disk", "sliced save onto a full disk")
def full_disk_sliced(ctx):
    with _Tmpfs(ctx.path("full")) as mnt:
        return ctx.python(BIG_SAVE.format(path=str(mnt / "net.ckpt"), integrated=False))


@case("disk", "ModelCheckpoint onto a full disk during training")
def full_disk_training(ctx):
    with _Tmpfs(ctx.path("full")) as mnt:
        return ctx.launch(2, ctx.script(f"""
            import numpy as np, torch
            import autopar as ms, autopar.dataset as ds
            from autopar.train import Model, ModelCheckpoint, CheckpointConfig
            ms.set_auto_parallel_context(parallel_mode='data_parallel', gradients_mean=True)
            ms.init()
            net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 4))
            x = np.zeros((64, 256), np.float32); y = np.zeros(64, np.int64)
            data = ds.NumpySlicesDataset({{'x': x, 'y': y}}, num_shards=2, shard_id=ms.get_rank()).batch(4)
            ck = ModelCheckpoint('net', {str(mnt)!r} + '/ckpt_' + str(ms.get_rank()),
                                 CheckpointConfig(save_checkpoint_steps=2))
            Model(net, torch.nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), 0.1)).train(1, data,
                                                                                                  callbacks=[ck])
        """))


@case("disk", "launcher --log-dir on a full disk")
def full_disk_logs(ctx):
    with _Tmpfs(ctx.path("full"), "64k") as mnt:
        (mnt / "filler").write_bytes(b"\0" * 60 * 1024)
        script = ctx.script("import autopar\nautopar.init()\nprint('x' * 100000, flush=True)\n")
        return ctx.cli("launch", "-n", "2", "--log-dir", str(mnt / "logs"), str(script))


@case("disk", "a tiny /dev/shm (private mount) under DATA_PARALLEL", expect="ok")
def tiny_shm(ctx):
    script = ctx.script("""
        import torch, autopar as ms
        ms.set_auto_parallel_context(parallel_mode='data_parallel', gradients_mean=True)
        ms.init()
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 4))
        opt = torch.optim.SGD(net.parameters(), 0.1)
        for _ in range(3):
            loss = net(torch.ones(8, 256)).sum(); opt.zero_grad(); loss.backward(); opt.step()
        print('DONE', flush=True)
    """)
    cmd = " ".join(ctx.launch_cmd(2, script, logs=ctx.path("logs")))
    return ctx.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    f"mount -t tmpfs -o size=64k tmpfs /dev/shm && exec {cmd}"], 120, ctx.env())
