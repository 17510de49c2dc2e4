"""The tutorial job end to end, as the README's first command runs it: ResNet-50 at 32x32 on synthetic CIFAR-10,
DATA_PARALLEL on 2 processes, then the test accuracy."""
import csv
import re
import shlex
from pathlib import Path

from procutil import autopar_cmd

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_first_command() -> list[str]:
    """The arguments of ``autopar`` in the README's install-and-run line (the test follows the README)."""
    line = next(ln for ln in README.read_text().splitlines() if ln.startswith("python3 -m venv") and "autopar train" in ln)
    return shlex.split(re.search(r"\.venv/bin/autopar (.*)$", line).group(1))


def test_readme_command_trains_and_its_accuracy_follows_the_loss(procs, tmp_path):
    args = readme_first_command()
    assert args[:3] == ["train", "-n", "2"] and "--eval" in args, args
    res = procs.run(autopar_cmd(*args, "--log-dir", str(tmp_path)), timeout=500)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[rank 0] epoch: 1 step: 78, loss is" in res.stdout  # every rank streamed, MindSpore's line
    assert "[rank 1] epoch: 1 step: 78, loss is" in res.stdout
    # what ran, said once before the first step; where the metrics went, said at the end
    assert res.stdout.count("[autopar] data_parallel on 2 ranks: mesh dp 2 x tp 1 x pp 1; no ZeRO;") == 1, res.stdout
    assert f"every step: {tmp_path / 'train_metrics.csv'}; its loss curve: {tmp_path / 'loss_curve.png'}" in res.stdout
    losses = [float(r["loss"]) for r in csv.DictReader(open(tmp_path / "train_metrics.csv"))]
    assert len(losses) == 78  # 1000 records x 5 files / 2 ranks / batch 32
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert first > 2.0 and last < 0.75 * first, (first, last)  # from ~ln(10) the loss fell clearly
    assert (tmp_path / "loss_curve.png").stat().st_size > 5000
    acc = re.search(r"test accuracy: ([0-9.]+) \(BatchNorm statistics re-estimated on 512 training images", res.stdout)
    assert acc, res.stdout[-2000:]
    if last < 1.0:  # the network learned: the accuracy must say so (precise BN, not the tutorial's slow moving stats)
        assert float(acc.group(1)) > 0.5, (last, acc.group(0))
