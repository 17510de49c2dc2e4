"""Model.train / eval / predict and the callbacks, in one process (stand-alone)."""
import csv
import re
import sys

import numpy as np
import pytest
import torch

import autopar
import autopar.dataset as ds
from autopar.errors import ConfigError, TrainingError
from autopar.nn import Momentum, SoftmaxCrossEntropyExpand
from autopar.train import Callback, LossMonitor, Model, TimeMonitor

LINE = re.compile(r"^epoch: (\d+) step: (\d+), loss is (\d+\.\d+(e-?\d+)?)$")


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    autopar.reset_auto_parallel_context()
    monkeypatch.setenv("AUTOPAR_LOG_DIR", str(tmp_path / "logs"))


def data(n=96, batch=16, shuffle=False, scale=1.0):
    rng = np.random.default_rng(1)
    x = (scale * rng.standard_normal((n, 8))).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)
    return ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=shuffle).batch(batch, drop_remainder=True)


def net_and_opt(lr=0.1):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return net, Momentum(net.parameters(), lr, 0.9)


def test_loss_monitor_prints_mindspore_lines(capsys):
    net, opt = net_and_opt()
    Model(net, SoftmaxCrossEntropyExpand(sparse=True), opt).train(2, data(), callbacks=[LossMonitor()])
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("epoch:")]
    assert len(lines) == 12  # 2 epochs x 6 steps
    parsed = [LINE.match(l) for l in lines]
    assert all(parsed), lines
    assert [(int(m[1]), int(m[2])) for m in parsed[:7]] == [(1, s) for s in range(1, 7)] + [(2, 1)]
    assert float(parsed[-1][3]) < float(parsed[0][3])  # it learns


def test_sink_mode_on_the_cpu_trains_step_by_step_as_mindspore(capsys):
    """MindSpore disables sink mode on a CPU ("The CPU cannot support dataset sink mode currently"): every step
    reports and sink_size has no effect; it sinks on accelerators only (then one report per sink)."""
    from autopar.train.model import sinks

    net, opt = net_and_opt()
    Model(net, torch.nn.CrossEntropyLoss(), opt).train(2, data(), callbacks=[LossMonitor()], dataset_sink_mode=True,
                                                        sink_size=4)
    out = capsys.readouterr()
    lines = [l for l in out.out.splitlines() if l.startswith("epoch:")]
    assert [LINE.match(l).group(1, 2) for l in lines] == [(str(e), str(s)) for e in (1, 2) for s in range(1, 7)]
    assert "trains step by step on the CPU" in out.err and "sink_size has no effect" in out.err
    assert sinks(torch.device("cuda", 0)) and not sinks(torch.device("cpu"))


def test_take_shortens_an_epoch(capsys):
    net, opt = net_and_opt()
    Model(net, torch.nn.CrossEntropyLoss(), opt).train(2, data().take(4), callbacks=[LossMonitor()])
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("epoch:")]
    assert [LINE.match(l).group(1, 2) for l in lines] == [(str(e), str(s)) for e in (1, 2) for s in range(1, 5)]


def test_metrics_csv_and_loss_curve(tmp_path):
    net, opt = net_and_opt()
    Model(net, torch.nn.CrossEntropyLoss(), opt).train(2, data())
    rows = list(csv.DictReader(open(tmp_path / "logs" / "train_metrics.csv")))
    assert len(rows) == 12 and rows[-1]["global_step"] == "12" and float(rows[0]["images_per_s"]) > 0
    png = (tmp_path / "logs" / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_time_monitor_and_custom_callback_protocol(capsys):
    seen = []

    class Recorder(Callback):
        def step_end(self, run_context):  # MindSpore's older hook name
            cb = run_context.original_args()
            seen.append((cb.cur_epoch_num, cb.cur_step_num, cb.batch_num))
            if cb.cur_step_num == 8:
                run_context.request_stop()

    net, opt = net_and_opt()
    Model(net, torch.nn.CrossEntropyLoss(), opt).train(5, data(), callbacks=[Recorder(), TimeMonitor()])
    assert seen[0] == (1, 1, 6) and seen[-1] == (2, 8, 6) and len(seen) == 8
    assert re.search(r"epoch time: [\d.]+ ms, per step time: [\d.]+ ms, [\d.]+ imgs/sec", capsys.readouterr().out)


def test_eval_and_predict():
    net, opt = net_and_opt()
    model = Model(net, torch.nn.CrossEntropyLoss(), opt, metrics={"acc", "loss"})
    before = model.eval(data())
    model.train(4, data(shuffle=True))
    after = model.eval(data())
    assert after["acc"] > max(before["acc"], 0.85) and after["loss"] < before["loss"]
    x = torch.randn(5, 8)
    assert model.predict(x).shape == (5, 2) and net.training


def test_invalid_loss_stops_training():
    net, opt = net_and_opt(lr=1e30)
    with pytest.raises(TrainingError, match=r"epoch: 1 step: \d+\. Invalid loss"):
        Model(net, torch.nn.CrossEntropyLoss(), opt).train(3, data(), callbacks=[LossMonitor()])


def test_bad_arguments_are_clear():
    net, opt = net_and_opt()
    with pytest.raises(ConfigError, match="needs an optimizer"):
        Model(net, torch.nn.CrossEntropyLoss()).train(1, data())
    with pytest.raises(ConfigError, match="grad_accumulation_steps"):
        Model(net, torch.nn.CrossEntropyLoss(), opt, grad_accumulation_steps=0)
    with pytest.raises(ConfigError, match="unknown parallel_mode"):
        autopar.set_auto_parallel_context(parallel_mode="model_parallel")
    with pytest.raises(ConfigError, match="unknown key 'gradient_mean'"):
        autopar.set_auto_parallel_context(gradient_mean=True)


def test_torch_dataloader_works_too():
    x = torch.randn(64, 8)
    y = (x[:, 0] > 0).long()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    net, opt = net_and_opt()
    Model(net, torch.nn.CrossEntropyLoss(), opt).train(2, loader)


class _CrashAfter(Callback):
    def __init__(self, step):
        self.step = step

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num == self.step:
            raise RuntimeError("simulated crash")


def _whole_crashed_resumed(directory, crash, save_steps=2, data_scale=1.0, **model_kwargs):
    """Train one epoch uninterrupted; again with a crash after micro-batch ``crash``; then resume the crashed run."""
    from autopar.train import CheckpointConfig, ModelCheckpoint

    def run(where, crash=None, resume=False):
        net, opt = net_and_opt()
        ckpt = ModelCheckpoint("run", where, CheckpointConfig(save_checkpoint_steps=save_steps, keep_checkpoint_max=10))
        model = Model(net, SoftmaxCrossEntropyExpand(sparse=True), opt, **model_kwargs)
        callbacks = [ckpt] + ([_CrashAfter(crash)] if crash else [])
        model.train(1, data(n=144, scale=data_scale), callbacks=callbacks, resume_from=where if resume else None)
        return net, model, sorted(p.name for p in where.iterdir())

    whole = run(directory / "whole")
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(directory / "crashed", crash=crash)
    resumed = run(directory / "crashed", resume=True)
    for (name, a), b in zip(whole[0].state_dict().items(), resumed[0].state_dict().values()):
        assert torch.equal(a, b), name
    return whole, resumed


def test_resume_inside_a_gradient_accumulation_continues_exactly(tmp_path):
    """Saves every 2 micro-batches with accumulation 3: a checkpoint taken at micro-batch 4 could not hold the
    gradients of micro-batches 3-4, so the save waits for the accumulation's end; resuming after a crash at
    micro-batch 5 then gives the uninterrupted run's parameters bit for bit."""
    whole, _ = _whole_crashed_resumed(tmp_path, crash=5, grad_accumulation_steps=3)
    assert whole[2] == ["run-1_3.ckpt", "run-1_6.ckpt", "run-1_9.ckpt"]  # due at 2, 4(->6), 6, 8(->9) and the end


def test_resume_keeps_the_dynamic_loss_scale(tmp_path, monkeypatch):
    """O2 with float16 (here on the CPU) scales the loss; the scale backs off on overflow. Resumed at its initial
    value instead of the saved one, the run would skip steps again and end with other parameters."""
    monkeypatch.setenv("AUTOPAR_AMP_DTYPE", "float16")
    whole, resumed = _whole_crashed_resumed(tmp_path, crash=5, save_steps=3, data_scale=1000.0,
                                             amp_level="O2")
    scale = whole[1]._precision.scaler.get_scale()
    assert scale < 65536.0  # the test means something only if the scale moved
    assert resumed[1]._precision.scaler.get_scale() == scale


def test_a_reused_checkpoint_prefix_is_renamed_as_mindspore_keeping_both_runs(tmp_path, capsys):
    """The tutorial's data-parallel block reuses its AUTO block's prefix and directory: MindSpore saves the second run
    as ``prefix_1`` (then ``prefix_2`` ...), so nothing of the first run is overwritten or pruned."""
    from autopar.train import CheckpointConfig, ModelCheckpoint

    names = []
    for _ in range(3):
        net, opt = net_and_opt()
        ckpt = ModelCheckpoint("auto_parallel", tmp_path, CheckpointConfig(save_checkpoint_steps=6,
                                                                           keep_checkpoint_max=1))
        Model(net, SoftmaxCrossEntropyExpand(sparse=True), opt).train(1, data(n=96), callbacks=[ckpt])
        names.append(sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".ckpt")))
    assert names[-1] == ["auto_parallel-1_6.ckpt", "auto_parallel_1-1_6.ckpt", "auto_parallel_2-1_6.ckpt"]
    assert "this run saves as 'auto_parallel_1'" in capsys.readouterr().out
    assert ckpt.latest_ckpt_file_name.endswith("auto_parallel_2-1_6.ckpt")


@pytest.mark.parametrize("under_mpirun", [False, True])
def test_a_progress_bar_only_on_a_terminal_of_its_own(capsys, monkeypatch, under_mpirun):
    """mpirun gives each rank a pseudo-terminal whose output goes to mpirun's (a train.log): no bar there to glue
    onto the loss lines."""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    if under_mpirun:
        monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    net, opt = net_and_opt()
    Model(net, SoftmaxCrossEntropyExpand(sparse=True), opt).train(1, data(), callbacks=[LossMonitor()])
    out = capsys.readouterr()
    assert ("epoch 1/1" in out.err) is not under_mpirun
    assert all(line.startswith("epoch: ") for line in out.out.splitlines() if "loss is" in line)
