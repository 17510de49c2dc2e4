"""MindSpore .ckpt interop: the protobuf layout, round trips, mapping onto resnet50, and error messages."""
import numpy as np
import pytest
import torch

from autopar.checkpoint.mindspore_ckpt import _checkpoint_class, read_mindspore_checkpoint, write_mindspore_checkpoint
from autopar.checkpoint.mindspore_names import mindspore_to_torch_state, torch_to_mindspore_names
from autopar.errors import CheckpointError
from autopar.models import resnet50

MS_EXTRAS = ["learning_rate", "momentum", "global_step"]


def _raw_entries(path):
    message = _checkpoint_class()()
    message.ParseFromString(open(path, "rb").read())
    return [(v.tag, list(v.tensor.dims), v.tensor.tensor_type, v.tensor.tensor_content) for v in message.value]


def _write_raw(path, entries):
    """Entries (tag, dims, tensor_type, content) as MindSpore lays them out: one Checkpoint message each."""
    with open(path, "wb") as f:
        for tag, dims, tensor_type, content in entries:
            message = _checkpoint_class()()
            value = message.value.add()
            value.tag = tag
            value.tensor.dims.extend(dims)
            value.tensor.tensor_type = tensor_type
            value.tensor.tensor_content = content
            f.write(message.SerializeToString())


# ----------------------------------------------------------------------------------------------- format
def test_wire_layout_matches_checkpoint_proto(tmp_path):
    """Field numbers/types of checkpoint.proto, checked byte by byte (proto2: dims unpacked)."""
    path = tmp_path / "a.ckpt"
    write_mindspore_checkpoint(path, {"a": np.zeros(2, np.float32), "b": np.array([7], np.int8)})
    tensor_a = b"\x08\x02" + b"\x12\x07Float32" + b"\x1a\x08" + bytes(8)  # dims=1, tensor_type=2, content=3
    value_a = b"\x0a\x01a" + b"\x12" + bytes([len(tensor_a)]) + tensor_a  # tag=1, tensor=2
    tensor_b = b"\x08\x01" + b"\x12\x04Int8" + b"\x1a\x01\x07"
    value_b = b"\x0a\x01b" + b"\x12" + bytes([len(tensor_b)]) + tensor_b
    expected = b"".join(b"\x0a" + bytes([len(v)]) + v for v in (value_a, value_b))  # Checkpoint.value=1
    assert path.read_bytes() == expected


def test_round_trip_every_tensor_type(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "f16": rng.standard_normal((3, 2)).astype(np.float16),
        "f32": rng.standard_normal((4, 1, 2)).astype(np.float32),
        "f64": rng.standard_normal(5),
        "i8": np.array([-3, 4], np.int8), "i16": np.array([-300], np.int16),
        "i32": np.array([[1, -2]], np.int32), "i64": np.array([2**40], np.int64),
        "u8": np.array([255], np.uint8), "u16": np.array([65535], np.uint16),
        "u32": np.array([2**32 - 1], np.uint32), "u64": np.array([2**64 - 1], np.uint64),
        "bool": np.array([True, False, True]),
        "scalar": np.float32(0.5), "empty": np.zeros((0, 3), np.float32),
        "big_endian": np.arange(3, dtype=">i4"),
    }
    path = tmp_path / "all.ckpt"
    bf16 = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    write_mindspore_checkpoint(path, {**tensors, "text": "hello", "bf16": bf16})
    back = read_mindspore_checkpoint(path)
    assert list(back) == [*tensors, "text", "bf16"]
    for name, array in tensors.items():
        assert back[name].dtype == array.dtype.newbyteorder("="), name
        assert back[name].shape == np.shape(array) and np.array_equal(back[name], array), name
        assert back[name].flags.writeable
    assert str(back["text"]) == "hello"
    assert back["bf16"].dtype == np.float32 and back["bf16"].tolist() == [1.5, -2.0]  # BFloat16 widened
    types = {tag: ttype for tag, _, ttype, _ in _raw_entries(path)}
    assert types["bf16"] == "BFloat16" and types["bool"] == "Bool" and types["u64"] == "UInt64"
    assert types["text"] == "str" and types["f16"] == "Float16"


def test_scalar_written_with_dims_zero_reads_as_scalar(tmp_path):
    path = tmp_path / "old.ckpt"  # older MindSpore stored scalars as dims [0]; load_checkpoint maps [0] -> []
    _write_raw(path, [("learning_rate", [0], "Float32", np.float32(0.1).tobytes()),
                      ("empty", [0], "Float32", b"")])
    back = read_mindspore_checkpoint(path)
    assert back["learning_rate"].shape == () and back["learning_rate"] == np.float32(0.1)
    assert back["empty"].shape == (0,)


def test_split_tensor_is_concatenated(tmp_path):
    """MindSpore splits tensors > 512 MiB into consecutive same-tag entries; a small chunk size shows it."""
    weight = np.arange(1000, dtype=np.float32).reshape(10, 100)
    odd = np.arange(37, dtype=np.int64)
    path = tmp_path / "split.ckpt"
    write_mindspore_checkpoint(path, {"w": weight, "odd": odd, "tail": np.ones(1, np.float32)}, chunk_bytes=1000)
    raw = _raw_entries(path)
    assert [tag for tag, *_ in raw].count("w") == 4 and [tag for tag, *_ in raw].count("odd") == 1
    assert all(dims == [10, 100] for tag, dims, _, _ in raw if tag == "w")  # every part carries the full dims
    write_mindspore_checkpoint(path, {"odd": odd}, chunk_bytes=7)  # parts need not align with items
    assert len(_raw_entries(path)) == 43
    assert np.array_equal(read_mindspore_checkpoint(path)["odd"], odd)
    write_mindspore_checkpoint(path, {"w": weight, "tail": np.ones(1, np.float32)}, chunk_bytes=1000)
    back = read_mindspore_checkpoint(path)
    assert list(back) == ["w", "tail"] and np.array_equal(back["w"], weight)


def test_crc_trailer(tmp_path):
    path = tmp_path / "crc.ckpt"
    write_mindspore_checkpoint(path, {"x": np.arange(6, dtype=np.float32)}, crc_check=True)
    data = path.read_bytes()
    assert data[-17:-10] == b"crc_num"
    assert np.array_equal(read_mindspore_checkpoint(path)["x"], np.arange(6, dtype=np.float32))
    corrupt = bytearray(data)
    corrupt[-20] ^= 0xFF  # a byte of the tensor content
    path.write_bytes(bytes(corrupt))
    with pytest.raises(CheckpointError, match=r"crc\.ckpt.*CRC"):
        read_mindspore_checkpoint(path)


# ------------------------------------------------------------------------------------ resnet50 interop
@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """resnet50(10) with random weights, saved under MindSpore names with optimizer state, as MindSpore would."""
    torch.manual_seed(0)
    model = resnet50(num_classes=10)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("running_var"):
                tensor.uniform_(0.5, 2.0)
            elif tensor.is_floating_point():
                tensor.normal_(0.0, 0.05)
    names = torch_to_mindspore_names(model)
    ms = {names[k]: v.numpy().copy() for k, v in model.state_dict().items() if k in names}
    rng = np.random.default_rng(1)
    moments = {f"moments.{names[k]}": rng.standard_normal(tuple(p.shape)).astype(np.float32)
               for k, p in model.named_parameters()}
    extras = {"learning_rate": np.float32(0.1), "momentum": np.float32(0.9),
              "global_step": np.array([42], np.int32)}
    tensors = {**ms, **moments, **extras}
    path = tmp_path_factory.mktemp("ckpt") / "resnet50-1_42.ckpt"
    write_mindspore_checkpoint(path, tensors)
    return model.eval(), tensors, path


def test_torch_to_mindspore_names(written):
    model, _, _ = written
    names = torch_to_mindspore_names(model)
    assert names["bn1.weight"] == "bn1.gamma" and names["bn1.bias"] == "bn1.beta"
    assert names["layer1.a.bn_down_sample.running_mean"] == "layer1.a.bn_down_sample.moving_mean"
    assert names["layer4.c.bn3.running_var"] == "layer4.c.bn3.moving_variance"
    assert names["conv1.weight"] == "conv1.weight" and names["fc.bias"] == "fc.bias"
    assert not any(k.endswith("num_batches_tracked") for k in names)
    assert len(set(names.values())) == len(names)


def test_read_back_identical(written):
    _, tensors, path = written
    back = read_mindspore_checkpoint(path)
    assert list(back) == list(tensors)
    for name, array in tensors.items():
        assert back[name].dtype == np.asarray(array).dtype and np.array_equal(back[name], array), name


def test_mapped_into_fresh_resnet_gives_identical_outputs(written):
    model, _, path = written
    fresh = resnet50(num_classes=10)
    model_state, momentum_state, unmapped = mindspore_to_torch_state(read_mindspore_checkpoint(path), fresh)
    assert unmapped == MS_EXTRAS
    fresh.load_state_dict(model_state)  # strict: every key, num_batches_tracked included
    fresh.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))
    assert set(momentum_state) == {name for name, _ in fresh.named_parameters()}


def test_momentum_buffers_continue_mindspore_momentum(written):
    """Momentum: v = m*v + g; p -= lr*v  ==  torch SGD(momentum=m) seeded with momentum_buffer = moments.*"""
    _, tensors, path = written
    ckpt = read_mindspore_checkpoint(path)
    model = resnet50(num_classes=10)
    model_state, momentum_state, _ = mindspore_to_torch_state(ckpt, model)
    model.load_state_dict(model_state)
    assert torch.equal(momentum_state["layer2.a.bn1.weight"],
                       torch.from_numpy(tensors["moments.layer2.a.bn1.gamma"]))
    lr, m = float(ckpt["learning_rate"]), float(ckpt["momentum"])
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=m)
    for name, param in model.named_parameters():
        opt.state[param]["momentum_buffer"] = momentum_state[name].clone()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}  # any gradient will do
    for name, param in model.named_parameters():
        param.grad = grads[name].clone()
    opt.step()
    for name, param in model.named_parameters():
        v = m * momentum_state[name] + grads[name]
        torch.testing.assert_close(param.detach(), before[name] - lr * v)


def test_rename_prefix_for_pipeline_tutorial_stem(written):
    """distributed_training_cpu/resnet.py wraps the stem in ``head``: head.conv1.weight, head.bn1.gamma ..."""
    _, tensors, _ = written
    renamed = {(f"head.{k}" if k.startswith(("conv1.", "bn1.")) else
                f"moments.head.{k[8:]}" if k.startswith(("moments.conv1.", "moments.bn1.")) else k): v
               for k, v in tensors.items()}
    model_state, momentum_state, unmapped = mindspore_to_torch_state(renamed, resnet50(10), rename={"head.": ""})
    assert unmapped == MS_EXTRAS and "bn1.running_var" in model_state and "conv1.weight" in momentum_state


# ----------------------------------------------------------------------------------------------- errors
def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"nope\.ckpt does not exist"):
        read_mindspore_checkpoint(tmp_path / "nope.ckpt")


def test_truncated_file_names_the_file(written, tmp_path):
    _, _, path = written
    data = path.read_bytes()
    cut = tmp_path / "cut.ckpt"
    for size in (len(data) // 2, len(data) - 3, 7):
        cut.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match=r"cut\.ckpt .*(truncated|corrupt)"):
            read_mindspore_checkpoint(cut)


@pytest.mark.parametrize("content", [np.random.default_rng(0).bytes(4096), b"", b"hello world\n" * 20],
                         ids=["random", "empty", "text"])
def test_not_a_checkpoint(tmp_path, content):
    path = tmp_path / "garbage.ckpt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=r"garbage\.ckpt .*not a MindSpore checkpoint"):
        read_mindspore_checkpoint(path)


def test_encrypted_checkpoint(tmp_path):
    path = tmp_path / "enc.ckpt"
    path.write_bytes((0x7F3A5ED8).to_bytes(4, "little") + np.random.default_rng(0).bytes(256))
    with pytest.raises(CheckpointError, match=r"enc\.ckpt is an encrypted.*decryption is not supported"):
        read_mindspore_checkpoint(path)


def test_unknown_tensor_type_and_size_mismatch(tmp_path):
    path = tmp_path / "bad.ckpt"
    _write_raw(path, [("w", [2], "Complex64", bytes(16))])
    with pytest.raises(CheckpointError, match=r"bad\.ckpt: tensor 'w' has unknown tensor_type 'Complex64'"):
        read_mindspore_checkpoint(path)
    _write_raw(path, [("w", [3], "Float32", bytes(8))])
    with pytest.raises(CheckpointError, match=r"bad\.ckpt is truncated or corrupt: tensor 'w' has 8 bytes"):
        read_mindspore_checkpoint(path)
    _write_raw(path, [("w", [1], "Float32", bytes(4)), ("v", [1], "Float32", bytes(4)),
                      ("w", [1], "Float32", bytes(4))])
    with pytest.raises(CheckpointError, match=r"bad\.ckpt is corrupt: tensor 'w' appears twice"):
        read_mindspore_checkpoint(path)


def test_shape_mismatch_names_parameter_and_shapes(written):
    _, tensors, _ = written
    bad = dict(tensors, **{"fc.weight": np.zeros((5, 2048), np.float32)})
    with pytest.raises(CheckpointError, match=r"'fc\.weight' has shape \(5, 2048\).*\(10, 2048\)"):
        mindspore_to_torch_state(bad, resnet50(10))
    bad = dict(tensors, **{"moments.layer1.a.bn1.gamma": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match=r"moments\.layer1\.a\.bn1\.gamma' has shape \(3,\)"):
        mindspore_to_torch_state(bad, resnet50(10))


def test_missing_entries_are_reported_unless_not_strict(written):
    _, tensors, _ = written
    partial = {k: v for k, v in tensors.items() if not k.startswith("fc.")}
    with pytest.raises(CheckpointError, match=r"lacks 2 tensor\(s\) of the module: 'fc\.weight', 'fc\.bias'"):
        mindspore_to_torch_state(partial, resnet50(10))
    model_state, _, _ = mindspore_to_torch_state(partial, resnet50(10), strict=False)
    assert "fc.weight" not in model_state and "conv1.weight" in model_state


def test_write_rejects_unsupported_dtype(tmp_path):
    with pytest.raises(CheckpointError, match=r"c\.ckpt: tensor 'z' has dtype complex64"):
        write_mindspore_checkpoint(tmp_path / "c.ckpt", {"z": np.zeros(2, np.complex64)})
    assert not (tmp_path / "c.ckpt").exists() and not (tmp_path / "c.ckpt.tmp").exists()
