"""The tutorial job end to end: ResNet-50 at 32x32 on synthetic CIFAR-10, DATA_PARALLEL on 2 processes."""
import csv

from procutil import autopar_cmd


def test_resnet50_loss_falls_on_two_processes(procs, tmp_path):
    # 500 records x 5 files / 2 ranks / batch 16 = 78 steps in one epoch
    res = procs.run(autopar_cmd("train", "-n", "2", "--synthetic", "--synthetic-records", "500", "--batch-size", "16",
                                "--log-dir", str(tmp_path), "--print-every", "1"), timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "epoch: 1 step: 78, loss is" in res.stdout  # rank 0 streamed, MindSpore's line
    losses = [float(r["loss"]) for r in csv.DictReader(open(tmp_path / "train_metrics.csv"))]
    assert len(losses) == 78
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert first > 2.0 and last < 0.75 * first, (first, last)  # from ~ln(10) the loss fell clearly
    assert (tmp_path / "loss_curve.png").stat().st_size > 5000
