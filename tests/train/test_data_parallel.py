"""Data parallelism is numerically one process on the global batch (the heart of the feature)."""
import re
import sys

import pytest
import torch

import autopar
import autopar.dataset as ds
from autopar.nn import Momentum
from autopar.train import Model
from procutil import SCRIPTS, autopar_cmd

sys.path.insert(0, str(SCRIPTS))
from dp_common import make_data, make_net  # noqa: E402


class ScaledLoss(torch.nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, logits, labels):
        return torch.nn.functional.cross_entropy(logits, labels) * self.scale


def reference(batch: int, steps: int = 3, scale: float = 1.0, accum: int = 1):
    """One process, stand-alone, on the unsharded data."""
    autopar.reset_auto_parallel_context()
    x, y = make_data()
    data = ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(batch, drop_remainder=True)
    torch.manual_seed(0)
    net = make_net()
    model = Model(net, ScaledLoss(scale), Momentum(net.parameters(), 0.1, 0.9), grad_accumulation_steps=accum)
    model.train(1, data.take(steps * accum))
    return net.state_dict()


def run_dp(procs, tmp_path, mean: bool, accum: int, batch: int, world: int = 2, engine: str = "shared_memory"):
    """Returns rank 0's parameters and how many times it summed gradients through the engine's transport (buckets
    all-reduced on gloo; ranges of the shared segment), and through the other one."""
    out = tmp_path / "params.pt"
    env = procs.env(AUTOPAR_SHARED_MEMORY="1" if engine == "shared_memory" else "0")
    res = procs.run(autopar_cmd("launch", "-n", str(world), "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "dp_train.py"), str(out), "1" if mean else "0", str(accum), str(batch)),
                    timeout=180, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    log = (tmp_path / "logs" / "worker_0.log").read_text()
    hook, host = (int(c) for c in re.search(r"GROUP_SUMS (\d+) SHARED_MEMORY_SUMS (\d+)", log).groups())
    return torch.load(out), (host if engine == "shared_memory" else hook), (hook if engine == "shared_memory" else host)


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


ENGINES = ["shared_memory", "gloo"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mean", [True, False], ids=["gradients_mean", "gradients_sum"])
def test_two_ranks_equal_one_process_on_the_global_batch(procs, tmp_path, mean, engine):
    params, calls, other = run_dp(procs, tmp_path, mean=mean, accum=1, batch=4, engine=engine)
    # mean: the average of the ranks' gradients = the gradient of the global-batch mean loss.
    # sum (MindSpore's default): the sum of 2 ranks' mean-loss gradients = twice the global-batch gradient.
    ref = reference(batch=8, scale=1.0 if mean else 2.0)
    assert max_diff(params, ref) <= 1e-5
    # one bucket per step, through the engine's transport; the other one idle
    assert calls == 3 and other == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_gradient_accumulation_communicates_only_on_the_last_micro_batch(procs, tmp_path, engine):
    params, calls, _ = run_dp(procs, tmp_path, mean=False, accum=2, batch=4, engine=engine)
    assert calls == 3  # 3 optimizer steps x 1 bucket, nothing on the 3 non-final micro-batches
    ref = reference(batch=16, scale=2.0)  # 2 ranks x 2 micro-batches x 4 samples per step
    assert max_diff(params, ref) <= 1e-5


def test_accumulation_in_one_process_equals_the_k_times_batch():
    accumulated = reference(batch=4, accum=4)
    big = reference(batch=16)
    assert max_diff(accumulated, big) <= 1e-5
    assert max_diff(reference(batch=4), big) > 1e-3  # the comparison can fail
