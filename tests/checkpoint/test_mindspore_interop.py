"""A model trained with MindSpore continues in autopar: its .ckpt (written here in MindSpore's format) loads through
``load_checkpoint`` + ``load_param_into_net`` and through ``autopar ckpt convert-mindspore``, with equal outputs and
the Momentum state carried over."""
import torch

from autopar import load_checkpoint, load_param_into_net
from autopar.checkpoint.mindspore_ckpt import torch_to_mindspore_names, write_mindspore_checkpoint
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
    assert cli(["ckpt", "convert-mindspore", str(path), "--out", str(out)]) == 0
    obj = read_integrated(out)
    assert obj["meta"]["global_step"] == 42
    assert torch.equal(obj["optimizer"]["state"]["fc.weight"]["momentum_buffer"], torch.full((10, 2048), 0.5))
    assert obj["optimizer"]["param_groups"][0]["lr"] == 0.01
    net = resnet50(num_classes=10).eval()
    load_param_into_net(net, load_checkpoint(out))
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(net(x), ref(x), atol=1e-5)
