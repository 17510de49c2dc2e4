"""The speed defaults (fused optimizer, opt-in channels-last), GRAPH_MODE and amp_level keep results, in one process."""
import numpy as np
import pytest
import torch

import autopar
import autopar.dataset as ds
from autopar.errors import ConfigError
from autopar.nn import Momentum, SoftmaxCrossEntropyExpand
from autopar.train import Callback, Model


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    autopar.reset_auto_parallel_context()
    monkeypatch.setenv("AUTOPAR_LOG_DIR", str(tmp_path / "logs"))
    yield
    autopar.set_context(mode=autopar.PYNATIVE_MODE)


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8 * 8 * 8, 4)
        self.dtypes = []

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        out = self.fc(h.flatten(1))
        self.dtypes.append(out.dtype)
        return out


def images(n=64, batch=16):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, 3, 8, 8)).astype(np.float32)
    y = (x[:, 0].mean(axis=(1, 2)) > 0).astype(np.int32) + 2 * (x[:, 1].mean(axis=(1, 2)) > 0).astype(np.int32)
    return ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(batch, drop_remainder=True)


class Losses(Callback):
    def __init__(self):
        self.values = []

    def on_train_step_end(self, run_context):
        self.values.append(float(run_context.original_args().net_outputs))


def train(epochs=2, **model_kw):
    torch.manual_seed(0)
    net = ConvNet()
    opt = Momentum(net.parameters(), 0.05, 0.9)
    losses = Losses()
    model = Model(net, SoftmaxCrossEntropyExpand(sparse=True), opt, **model_kw)
    model.train(epochs, images(), callbacks=[losses])
    return net, opt, losses.values


def test_fused_optimizer_is_the_default_and_changes_nothing(monkeypatch):
    net, opt, fused = train()
    assert opt.param_groups[0]["fused"] is True
    monkeypatch.setenv("AUTOPAR_FUSED_OPTIMIZER", "0")
    ref_net, ref_opt, plain = train()
    assert not ref_opt.param_groups[0].get("fused")
    np.testing.assert_allclose(fused, plain, rtol=1e-5)
    for a, b in zip(net.parameters(), ref_net.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_explicit_optimizer_choice_is_respected():
    torch.manual_seed(0)
    net = ConvNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, foreach=False)
    Model(net, torch.nn.CrossEntropyLoss(), opt).train(1, images())
    assert not opt.param_groups[0].get("fused")


def test_channels_last_is_opt_in_and_exact(monkeypatch):
    net, _, default = train()
    assert net.conv.weight.is_contiguous()
    monkeypatch.setenv("AUTOPAR_CHANNELS_LAST", "1")
    cl_net, _, channels_last = train()
    assert cl_net.conv.weight.is_contiguous(memory_format=torch.channels_last)
    np.testing.assert_allclose(channels_last, default, rtol=1e-4)


def test_graph_mode_compiles_where_asked_and_matches_eager(capfd, monkeypatch):
    _, _, eager = train(epochs=1)
    autopar.set_context(mode=autopar.GRAPH_MODE)
    with pytest.warns(UserWarning, match="GRAPH_MODE runs eagerly on the CPU"):  # measured: compiling does not pay
        _, _, cpu_default = train(epochs=1)
    assert "compiling" not in capfd.readouterr().err
    np.testing.assert_allclose(cpu_default, eager, rtol=1e-6)
    monkeypatch.setenv("AUTOPAR_COMPILE", "1")
    _, _, graph = train(epochs=1)
    err = capfd.readouterr().err
    assert "GRAPH_MODE: compiling the network" in err and "compiled in" in err
    np.testing.assert_allclose(graph, eager, rtol=1e-4)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_amp_levels_autocast_to_bfloat16_on_cpu_and_still_learn(level):
    net, _, fp32 = train(epochs=3)
    assert set(net.dtypes) == {torch.float32}
    amp_net, _, amp = train(epochs=3, amp_level=level)
    assert torch.bfloat16 in set(amp_net.dtypes)
    assert amp_net.conv.weight.dtype == torch.float32  # float32 master weights
    assert amp[-1] < amp[0] * 0.8  # it learns
    np.testing.assert_allclose(amp[0], fp32[0], rtol=3e-2)  # same start, up to bf16 rounding


def test_amp_o3_runs_the_whole_network_in_low_precision():
    net, _, losses = train(epochs=1, amp_level="O3")
    assert net.conv.weight.dtype == torch.bfloat16 and set(net.dtypes) == {torch.bfloat16}
    assert all(np.isfinite(losses))


def test_a_bad_amp_level_is_a_clear_error():
    with pytest.raises(ConfigError, match="amp_level must be one of O0, O1, O2, O3"):
        Model(ConvNet(), torch.nn.CrossEntropyLoss(), None, amp_level="O7")
