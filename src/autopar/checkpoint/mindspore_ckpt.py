"""Read and write MindSpore ``.ckpt`` files without MindSpore, and map them onto torch modules.

Why: users arrive with checkpoints from ``mindspore.save_checkpoint`` / ``ModelCheckpoint`` and expect
``load_checkpoint`` to work; MindSpore itself is not installable everywhere autopar runs.

The format (MindSpore ``mindspore/ccsrc/utils/checkpoint.proto``, proto2, no package)::

    message Checkpoint {
        message Value {
            required string tag = 1;
            oneof value { TensorProto tensor = 2; MapTensorProto maptensor = 3; }
        }
        repeated Value value = 1;
    }
    message TensorProto {
        repeated int64 dims = 1;
        required string tensor_type = 2;   // "Float32", "Int64", "BFloat16", "Bool", "str", ...
        required bytes tensor_content = 3; // raw little-endian C-order bytes
    }
    message MapTensorProto { repeated TensorProto tensor = 1; }

How MindSpore uses it (``mindspore/python/mindspore/train/serialization.py``):

* ``save_checkpoint`` writes one serialized ``Checkpoint`` holding ONE ``Value`` per write and appends them to
  the file; protobuf concatenation is message merge, so the file parses as one ``Checkpoint``.
* A tensor larger than 512 MiB (``chunk_size = 1024 * SLICE_SIZE`` bytes, ``SLICE_SIZE = 512 * 1024`` KB) is
  written as several consecutive ``Value`` s with the same tag and the full ``dims`` each;
  ``load_checkpoint`` joins consecutive same-tag contents (``b"".join(param_data_list)``) before decoding.
* ``dims == [0]`` is read as a scalar (``if dims == [0]: dims = []``); strings use ``tensor_type "str"``.
* ``crc_check=True`` appends ``b"crc_num" + crc32.to_bytes(10, "big")``; the loader strips it.
* ``enc_key`` files are AES-GCM/CBC encrypted blocks starting with the little-endian int32 magic
  ``0x7F3A5ED8`` / ``0x7F3A5ED9`` (``mindspore/core/utils/crypto.h``); we detect and refuse them.

The message classes are built at run time from a ``FileDescriptorProto`` in a private descriptor pool, so no
generated ``_pb2`` file is needed and nothing clashes with other protos named ``Checkpoint``.
"""
from __future__ import annotations

import binascii
import math
import os
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from autopar.errors import CheckpointError

__all__ = ["read_mindspore_checkpoint", "write_mindspore_checkpoint"]

#: MindSpore's split size for one ``Value`` (``_write_parameter_bytes_data``: ``1024 * SLICE_SIZE`` bytes).
MINDSPORE_CHUNK_BYTES = 512 * 1024 * 1024

# tensor_type strings of serialization.py's ``tensor_to_np_type`` (+ "BFloat16", decoded through torch).
_NUMPY_TYPES: dict[str, np.dtype] = {
    name: np.dtype(code) for name, code in (
        ("Bool", "?"), ("Int8", "i1"), ("Int16", "<i2"), ("Int32", "<i4"), ("Int64", "<i8"),
        ("UInt8", "u1"), ("UInt16", "<u2"), ("UInt32", "<u4"), ("UInt64", "<u8"),
        ("Float16", "<f2"), ("Float32", "<f4"), ("Float64", "<f8"),
    )
}
_TENSOR_TYPE_OF_KIND = {(dt.kind, dt.itemsize): name for name, dt in _NUMPY_TYPES.items()}
_SUPPORTED = ", ".join([*_NUMPY_TYPES, "BFloat16", "str"])

_CIPHER_MAGICS = {(0x7F3A5ED8).to_bytes(4, "little"), (0x7F3A5ED9).to_bytes(4, "little")}  # AES-GCM, CBC
_CRC_MARK = b"crc_num"

# --------------------------------------------------------------------------------------------- protobuf
@lru_cache(maxsize=1)
def _checkpoint_class() -> type:
    """The ``Checkpoint`` message class, built once from a descriptor matching checkpoint.proto."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="autopar/mindspore_checkpoint.proto", syntax="proto2")
    tensor = fdp.message_type.add(name="TensorProto")
    tensor.field.add(name="dims", number=1, label=F.LABEL_REPEATED, type=F.TYPE_INT64)
    tensor.field.add(name="tensor_type", number=2, label=F.LABEL_REQUIRED, type=F.TYPE_STRING)
    tensor.field.add(name="tensor_content", number=3, label=F.LABEL_REQUIRED, type=F.TYPE_BYTES)
    map_tensor = fdp.message_type.add(name="MapTensorProto")
    map_tensor.field.add(name="tensor", number=1, label=F.LABEL_REPEATED, type=F.TYPE_MESSAGE,
                         type_name=".TensorProto")
    ckpt = fdp.message_type.add(name="Checkpoint")
    value = ckpt.nested_type.add(name="Value")
    value.oneof_decl.add(name="value")
    value.field.add(name="tag", number=1, label=F.LABEL_REQUIRED, type=F.TYPE_STRING)
    value.field.add(name="tensor", number=2, label=F.LABEL_OPTIONAL, type=F.TYPE_MESSAGE,
                    type_name=".TensorProto", oneof_index=0)
    value.field.add(name="maptensor", number=3, label=F.LABEL_OPTIONAL, type=F.TYPE_MESSAGE,
                    type_name=".MapTensorProto", oneof_index=0)
    ckpt.field.add(name="value", number=1, label=F.LABEL_REPEATED, type=F.TYPE_MESSAGE,
                   type_name=".Checkpoint.Value")

    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    descriptor = pool.FindMessageTypeByName("Checkpoint")
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)  # pragma: no cover (protobuf 4.21)


# ----------------------------------------------------------------------------------------------- reading
def read_mindspore_checkpoint(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a MindSpore ``.ckpt`` into ``{tag: numpy array}`` in file order.

    Consecutive entries sharing a tag (MindSpore's split of >512 MiB tensors) are joined. ``BFloat16`` tensors
    come back as ``float32`` (numpy has no bfloat16); ``str`` entries as 0-d numpy unicode arrays. Every
    problem raises :class:`CheckpointError` naming the file.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"MindSpore checkpoint {path} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read MindSpore checkpoint {path}: {exc.strerror or exc}") from None

    if data[:4] in _CIPHER_MAGICS:
        raise CheckpointError(f"{path} is an encrypted MindSpore checkpoint (saved with enc_key); decryption is "
                              "not supported, re-save it without enc_key")
    data = _strip_crc(path, data)

    from google.protobuf.message import DecodeError

    message = _checkpoint_class()()
    try:
        message.ParseFromString(data)
    except DecodeError:
        raise CheckpointError(f"{path} is not a MindSpore checkpoint, or it is truncated or corrupt "
                              "(protobuf decoding failed)") from None
    if not message.value:
        raise CheckpointError(f"{path} is not a MindSpore checkpoint (it holds no tensors)")

    out: dict[str, np.ndarray] = {}
    values = message.value
    i = 0
    while i < len(values):
        head = values[i]
        tag = head.tag
        if head.WhichOneof("value") != "tensor":
            kind = "a MapParameter (maptensor)" if head.HasField("maptensor") else "no tensor"
            raise CheckpointError(f"{path}: entry {tag!r} holds {kind}, which is not supported")
        chunks = [head.tensor.tensor_content]
        i += 1
        while i < len(values) and values[i].tag == tag:  # a split tensor: same tag, same dims and type
            part = values[i]
            if (part.WhichOneof("value") != "tensor" or part.tensor.tensor_type != head.tensor.tensor_type
                    or list(part.tensor.dims) != list(head.tensor.dims)):
                raise CheckpointError(f"{path} is corrupt: the parts of split tensor {tag!r} disagree on "
                                      "dims or tensor_type")
            chunks.append(part.tensor.tensor_content)
            i += 1
        if tag in out:
            raise CheckpointError(f"{path} is corrupt: tensor {tag!r} appears twice, not in consecutive parts")
        out[tag] = _decode(path, tag, head.tensor.tensor_type, list(head.tensor.dims), b"".join(chunks))
    return out


def _strip_crc(path: str, data: bytes) -> bytes:
    """Remove (and verify) the ``crc_num`` trailer that ``save_checkpoint(crc_check=True)`` appends."""
    if len(data) < 17 or data[-17:-10] != _CRC_MARK:
        return data
    body, stored = data[:-17], int.from_bytes(data[-10:], "big")
    if binascii.crc32(body) != stored:
        raise CheckpointError(f"{path} is corrupt: its CRC32 does not match the crc_num it was saved with")
    return body


def _decode(path: str, tag: str, tensor_type: str, dims: list[int], content: bytes) -> np.ndarray:
    """Turn one (joined) TensorProto into a writable, native-endian numpy array."""
    if tensor_type == "str":  # numpy "U" data (UCS-4), as MindSpore's ``np.frombuffer(data, "U<n>")``
        if len(content) % 4:
            raise CheckpointError(f"{path} is corrupt: string entry {tag!r} is not UCS-4 data")
        text = content.decode("utf-32-le", errors="replace").rstrip("\x00")
        return np.array(text)
    if tensor_type == "BFloat16":
        itemsize = 2
    elif tensor_type in _NUMPY_TYPES:
        itemsize = _NUMPY_TYPES[tensor_type].itemsize
    else:
        raise CheckpointError(f"{path}: tensor {tag!r} has unknown tensor_type {tensor_type!r} "
                              f"(supported: {_SUPPORTED})")
    if any(d < 0 for d in dims):
        raise CheckpointError(f"{path} is corrupt: tensor {tag!r} has negative dims {dims}")
    shape = tuple(dims)
    if shape == (0,) and len(content) == itemsize:  # older MindSpore writes scalars with dims [0]
        shape = ()
    expected = math.prod(shape) * itemsize
    if len(content) != expected:
        raise CheckpointError(f"{path} is truncated or corrupt: tensor {tag!r} has {len(content)} bytes, but "
                              f"dims {list(dims)} of {tensor_type} need {expected}")
    if tensor_type == "BFloat16":
        if expected == 0:
            return np.zeros(shape, dtype=np.float32)
        bf16 = torch.frombuffer(bytearray(content), dtype=torch.bfloat16)
        return bf16.reshape(shape).float().numpy()
    dtype = _NUMPY_TYPES[tensor_type]
    return np.frombuffer(content, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="), copy=True)


# ----------------------------------------------------------------------------------------------- writing
def write_mindspore_checkpoint(path: str | os.PathLike, tensors: Mapping[str, Any], *, crc_check: bool = False,
                               chunk_bytes: int = MINDSPORE_CHUNK_BYTES) -> None:
    """Write ``{name: array}`` as a MindSpore ``.ckpt`` that ``mindspore.load_checkpoint`` reads.

    Values may be numpy arrays/scalars, Python numbers, ``torch.Tensor`` (any device or memory format;
    bfloat16 is stored as ``BFloat16``) or ``str``. As MindSpore does, every entry is its own serialized
    ``Checkpoint`` appended to the file and tensors over ``chunk_bytes`` are split into same-tag parts.
    ``crc_check`` appends MindSpore's ``crc_num`` trailer. The file is written to ``<path>.tmp`` and renamed.
    """
    path = os.fspath(path)
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    checkpoint = _checkpoint_class()
    tmp = path + ".tmp"
    crc = 0
    try:
        with open(tmp, "wb") as f:
            for name, value in tensors.items():
                if not isinstance(name, str) or not name:
                    raise CheckpointError(f"cannot write {path}: tensor names must be non-empty str, got {name!r}")
                dims, tensor_type, content = _encode(path, name, value)
                for start in range(0, max(len(content), 1), chunk_bytes):
                    message = checkpoint()
                    entry = message.value.add()
                    entry.tag = name
                    entry.tensor.dims.extend(dims)
                    entry.tensor.tensor_type = tensor_type
                    entry.tensor.tensor_content = content[start:start + chunk_bytes]
                    blob = message.SerializeToString()
                    crc = binascii.crc32(blob, crc)
                    f.write(blob)
            if crc_check:
                f.write(_CRC_MARK + crc.to_bytes(10, "big"))
        os.replace(tmp, path)
    except OSError as exc:
        raise CheckpointError(f"cannot write MindSpore checkpoint {path}: {exc.strerror or exc}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _encode(path: str, name: str, value: Any) -> tuple[list[int], str, bytes]:
    """(dims, tensor_type, little-endian bytes) of one value, as MindSpore's save_checkpoint lays it out."""
    if isinstance(value, str):  # MindSpore: dims [0], tensor_type "str", np.array(text).tobytes()
        return [0], "str", np.array(value).astype("<U").tobytes()
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
        if tensor.dtype == torch.bfloat16:
            return list(tensor.shape), "BFloat16", tensor.view(torch.int16).numpy().astype("<i2").tobytes()
        value = tensor.numpy()
    array = np.asarray(value)
    if array.dtype.kind == "U" and array.ndim == 0:
        return _encode(path, name, str(array))
    tensor_type = _TENSOR_TYPE_OF_KIND.get((array.dtype.kind, array.dtype.itemsize))
    if tensor_type is None:
        raise CheckpointError(f"cannot write {path}: tensor {name!r} has dtype {array.dtype}, which MindSpore "
                              "checkpoints cannot hold")
    little = np.ascontiguousarray(array, dtype=_NUMPY_TYPES[tensor_type])
    return list(array.shape), tensor_type, little.tobytes()
