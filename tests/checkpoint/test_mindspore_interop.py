"""A model trained with MindSpore continues in autopar: its .ckpt (written here in MindSpore's format) loads through
``load_checkpoint`` + ``load_param_into_net`` and through ``autopar ckpt convert-mindspore``, with equal outputs and
the Momentum state carried over; any other network's .ckpt converts generically, every tensor exact."""
import torch

from autopar import load_checkpoint, load_param_into_net
from autopar.checkpoint.mindspore_ckpt import write_mindspore_checkpoint
from autopar.checkpoint.mindspore_names import torch_to_mindspore_names
from autopar.checkpoint.store import read_integrated
from autopar.cli.main import main as cli
from autopar.models import resnet50


def mindspore_file(tmp_path):
    torch.manual_seed(3)
    net = resnet50(num_classes=10)
    with torch.no_grad():  # make the BN statistics non-trivial, as after training
        for name, buf in net.named_buffers():
            if "running" in name:
                buf.uniform_(0.5, 1.5)
    names = torch_to_mindspore_names(net)
    state = net.state_dict()
    tensors = {names[k]: v for k, v in state.items() if k in names}
    tensors.update({f"moments.{names[k]}": torch.full_like(p, 0.5) for k, p in net.named_parameters()})
    tensors.update(learning_rate=torch.tensor([0.01]), momentum=torch.tensor([0.9]), global_step=torch.tensor([42]))
    path = tmp_path / "resnet-10_156.ckpt"
    write_mindspore_checkpoint(path, tensors)
    return net.eval(), path


def test_load_checkpoint_reads_mindspore_files(tmp_path):
    ref, path = mindspore_file(tmp_path)
    params = load_checkpoint(path)
    assert "bn1.gamma" in params and "moments.fc.weight" in params
    net = resnet50(num_classes=10).eval()
    not_loaded = load_param_into_net(net, params)
    assert not_loaded == []
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(net(x), ref(x), atol=1e-5)


def test_convert_mindspore_cli_carries_model_and_momentum(tmp_path):
    ref, path = mindspore_file(tmp_path)
    out = tmp_path / "converted.ckpt"
    assert cli(["ckpt", "convert-mindspore", str(path), "--out", str(out), "--model", "resnet50"]) == 0
    obj = read_integrated(out)
    assert obj["meta"]["global_step"] == 42
    assert torch.equal(obj["optimizer"]["state"]["fc.weight"]["momentum_buffer"], torch.full((10, 2048), 0.5))
    assert obj["optimizer"]["param_groups"][0]["lr"] == 0.01
    net = resnet50(num_classes=10).eval()
    load_param_into_net(net, load_checkpoint(out))
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(net(x), ref(x), atol=1e-5)


def small_net() -> torch.nn.Module:
    torch.manual_seed(5)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(4 * 6 * 6, 5), torch.nn.LayerNorm(5))
    with torch.no_grad():
        net[1].running_mean.uniform_(-1, 1)
        net[1].running_var.uniform_(0.5, 1.5)
    return net.eval()


def test_convert_mindspore_any_network_keeps_every_tensor(tmp_path, capsys):
    """A conv/batch-norm/dense checkpoint (not the tutorial ResNet-50) with int32, float16 and a parameter named
    'beta' that is no norm's: generic by default (names and dtypes kept), torch's names with --torch-names."""
    ref = small_net()
    names = torch_to_mindspore_names(ref)
    tensors = {names[k]: v for k, v in ref.state_dict().items() if k in names}
    extra = {"moments.0.weight": torch.full((4, 3, 3, 3), 0.25), "step_counts": torch.tensor([7, 8], dtype=torch.int32),
             "half_table": torch.linspace(0, 1, 6, dtype=torch.float16), "gate.beta": torch.tensor([0.5]),
             "global_step": torch.tensor([3], dtype=torch.int32)}
    write_mindspore_checkpoint(tmp_path / "small.ckpt", {**tensors, **extra})
    out = tmp_path / "kept.ckpt"
    assert cli(["ckpt", "convert-mindspore", str(tmp_path / "small.ckpt"), "--out", str(out)]) == 0
    assert f"converted {len(tensors) + len(extra)} tensors" in capsys.readouterr().out
    obj = read_integrated(out)
    assert obj["meta"]["global_step"] == 3
    for name, value in {**tensors, **extra}.items():  # every tensor, bit-exact, in its own dtype
        got = obj["model"][name]
        assert got.dtype == value.dtype and torch.equal(got, value), name
    net = small_net()
    for p in net.parameters():
        torch.nn.init.zeros_(p)
    load_param_into_net(net, load_checkpoint(out))  # MindSpore's norm names mapped on loading
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(net(x), ref(x))

    torch_out = tmp_path / "torch_names.ckpt"
    assert cli(["ckpt", "convert-mindspore", str(tmp_path / "small.ckpt"), "--out", str(torch_out),
                "--torch-names"]) == 0
    model = read_integrated(torch_out)["model"]
    assert "gate.beta" in model and "moments.0.weight" in model and "1.gamma" not in model
    fresh = torch.nn.Sequential(*small_net()).eval()
    fresh.load_state_dict({k: v for k, v in model.items() if k in fresh.state_dict()}, strict=True)
    assert torch.equal(fresh(x), ref(x))
    assert torch.equal(model["5.weight"], ref[5].weight.detach()) and torch.equal(model["1.running_var"],
                                                                                 ref[1].running_var)
