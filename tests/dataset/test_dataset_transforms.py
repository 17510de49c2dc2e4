"""Every vectorised transform equals a plain per-image numpy (or per-image torch) reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import autopar.dataset.transforms as transforms
import autopar.dataset.vision as vision
from autopar.errors import DatasetError


def images(n=6, h=10, w=12, c=3, seed=0, dtype=np.uint8):
    return np.random.default_rng(seed).integers(0, 256, size=(n, h, w, c)).astype(dtype)


# ------------------------------------------------------------------------------------------------ references
def ref_random_crop(batch, size, pad, fill, mode, seed):
    """Per image: pad with numpy, slice at offsets drawn as documented (all tops, then all lefts)."""
    n, h, w, c = batch.shape
    left, top, right, bottom = pad
    hp, wp = h + top + bottom, w + left + right
    rng = np.random.default_rng(seed)
    tops = rng.integers(0, hp - size[0] + 1, size=n)
    lefts = rng.integers(0, wp - size[1] + 1, size=n)
    out = []
    for i in range(n):
        img = batch[i]
        if mode == "constant":
            padded = np.empty((hp, wp, c), dtype=batch.dtype)
            padded[...] = np.asarray(fill, dtype=batch.dtype)
            padded[top:top + h, left:left + w] = img
        else:
            padded = np.pad(img, ((top, bottom), (left, right), (0, 0)), mode=mode)
        out.append(padded[tops[i]:tops[i] + size[0], lefts[i]:lefts[i] + size[1]])
    return np.stack(out)


def ref_flip(batch, prob, seed, axis):
    mask = np.random.default_rng(seed).random(batch.shape[0]) < prob
    return np.stack([np.flip(img, axis=axis) if m else img for img, m in zip(batch, mask)])


def ref_resize(batch, size, mode="bilinear"):
    out = []
    for img in batch:
        t = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)[None].float()
        kw = {"align_corners": False, "antialias": False} if mode == "bilinear" else {}
        y = F.interpolate(t, size=size, mode=mode, **kw)[0].permute(1, 2, 0)
        if img.dtype == np.uint8:
            y = y.round().clamp(0, 255).to(torch.uint8)
        out.append(y.numpy())
    return np.stack(out)


# ------------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("padding,expect_pad", [
    ((4, 4, 4, 4), (4, 4, 4, 4)),
    ((1, 2, 3, 0), (1, 2, 3, 0)),  # (left, top, right, bottom)
    ((2, 3), (2, 3, 2, 3)),  # (left/right, top/bottom)
    (3, (3, 3, 3, 3)),
    (None, (0, 0, 0, 0)),
])
def test_random_crop_matches_reference(padding, expect_pad):
    x = images()
    op = vision.RandomCrop((8, 9), padding)
    got = op.apply_batch(x, np.random.default_rng(7))
    assert got.shape == (6, 8, 9, 3) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, ref_random_crop(x, (8, 9), expect_pad, 0, "constant", 7))


@pytest.mark.parametrize("mode", [vision.Border.EDGE, vision.Border.REFLECT, vision.Border.SYMMETRIC])
def test_random_crop_padding_modes(mode):
    x = images()
    got = vision.RandomCrop(10, (3, 2, 1, 4), padding_mode=mode).apply_batch(x, np.random.default_rng(1))
    np.testing.assert_array_equal(got, ref_random_crop(x, (10, 10), (3, 2, 1, 4), 0, mode.value, 1))


def test_random_crop_fill_value_per_channel_and_grayscale():
    x = images()
    got = vision.RandomCrop(12, 5, fill_value=(10, 20, 30)).apply_batch(x, np.random.default_rng(2))
    np.testing.assert_array_equal(got, ref_random_crop(x, (12, 12), (5,) * 4, (10, 20, 30), "constant", 2))
    gray = x[..., 0]
    got = vision.RandomCrop(8, 2).apply_batch(gray, np.random.default_rng(3))
    np.testing.assert_array_equal(got, ref_random_crop(gray[..., None], (8, 8), (2,) * 4, 0, "constant", 3)[..., 0])


def test_random_crop_pad_if_needed_and_errors():
    x = images(h=6, w=6)
    out = vision.RandomCrop(8, pad_if_needed=True).apply_batch(x, np.random.default_rng(0))
    assert out.shape == (6, 8, 8, 3)
    with pytest.raises(DatasetError, match="RandomCrop: crop size 8x8 is larger"):
        vision.RandomCrop(8).apply_batch(x, np.random.default_rng(0))
    with pytest.raises(DatasetError, match="padding"):
        vision.RandomCrop(8, (1, 2, 3))


@pytest.mark.parametrize("cls,axis", [(vision.RandomHorizontalFlip, 1), (vision.RandomVerticalFlip, 0)])
def test_flips_match_reference(cls, axis):
    x = images(n=40)
    got = cls(0.5).apply_batch(x, np.random.default_rng(5))
    np.testing.assert_array_equal(got, ref_flip(x, 0.5, 5, axis))
    np.testing.assert_array_equal(cls(0.0).apply_batch(x, np.random.default_rng(5)), x)
    np.testing.assert_array_equal(cls(1.0).apply_batch(x, np.random.default_rng(5)), np.flip(x, axis=axis + 1))


def test_random_ops_deterministic_under_generator_seed():
    x = images(n=32)
    for op in (vision.RandomCrop(8, 4), vision.RandomHorizontalFlip()):
        a = op.apply_batch(x, np.random.default_rng(11))
        b = op.apply_batch(x, np.random.default_rng(11))
        c = op.apply_batch(x, np.random.default_rng(12))
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)


@pytest.mark.parametrize("size,expect", [((16, 20), (16, 20)), ((7, 5), (7, 5)), (6, (6, 7))])
def test_resize_matches_per_image_torch(size, expect):
    x = images(h=10, w=12)
    got = vision.Resize(size).apply_batch(x)
    assert got.shape == (6, *expect, 3) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, ref_resize(x, expect))


def test_resize_float_nearest_identity_and_int_shorter_side():
    x = images(h=10, w=12).astype(np.float32) / 255
    got = vision.Resize((20, 24)).apply_batch(x)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref_resize(x, (20, 24)), rtol=0, atol=1e-6)
    u = images(h=10, w=12)
    np.testing.assert_array_equal(vision.Resize((5, 5), vision.Inter.NEAREST).apply_batch(u),
                                  ref_resize(u, (5, 5), "nearest"))
    assert vision.Resize((10, 12)).apply_batch(u) is u  # identity size: no-op
    assert vision.Resize(5).output_size(10, 12) == (5, 6)
    assert vision.Resize(5).output_size(30, 10) == (15, 5)


def test_rescale_normalize_hwc2chw_centercrop_match_reference():
    x = images(n=4, h=9, w=11)
    mean, std = (0.4465, 0.4822, 0.4914), (0.2010, 0.1994, 0.2023)
    resc = vision.Rescale(1.0 / 255.0, 0.5).apply_batch(x)
    assert resc.dtype == np.float32
    np.testing.assert_allclose(resc, np.stack([img.astype(np.float32) / 255 + 0.5 for img in x]), rtol=1e-6)
    norm = vision.Normalize(mean, std).apply_batch(resc)
    ref = np.stack([(img - np.array(mean)) / np.array(std) for img in resc.astype(np.float64)])
    assert norm.dtype == np.float32
    np.testing.assert_allclose(norm, ref, rtol=1e-5, atol=1e-5)
    # Non-contiguous input takes the broadcasting path: same numbers.
    np.testing.assert_allclose(vision.Normalize(mean, std).apply_batch(resc[:, :, ::2]), ref[:, :, ::2], rtol=1e-5,
                               atol=1e-5)
    chw = vision.HWC2CHW().apply_batch(norm)
    np.testing.assert_array_equal(chw, np.stack([img.transpose(2, 0, 1) for img in norm]))
    assert chw.flags.c_contiguous
    cc = vision.CenterCrop((4, 6)).apply_batch(x)
    np.testing.assert_array_equal(cc, np.stack([img[2:6, 2:8] for img in x]))
    big = vision.CenterCrop(12).apply_batch(x)  # larger than the image: zero padded
    assert big.shape == (4, 12, 12, 3) and big[:, 0].max() == 0
    np.testing.assert_array_equal(big[:, 1:10, 0:11], x)


def test_call_on_single_image_batch_and_torch():
    x = images(n=3)
    op = vision.Resize((5, 6))
    single = op(x[1])
    assert single.shape == (5, 6, 3)
    np.testing.assert_array_equal(single, op(x)[1])
    t = op(torch.from_numpy(x[1]))
    assert isinstance(t, torch.Tensor) and torch.equal(t, torch.from_numpy(single))
    assert vision.HWC2CHW()(x[0]).shape == (3, 10, 12)
    assert vision.RandomCrop(4)(x[0]).shape == (4, 4, 3)
    assert vision.RandomHorizontalFlip()(x).shape == x.shape
    with pytest.raises(DatasetError, match="HWC2CHW"):
        vision.HWC2CHW()(np.zeros(3))


def test_typecast_accepts_torch_numpy_and_string_dtypes():
    x = np.arange(5, dtype=np.uint32)
    for dtype in (torch.int32, np.int32, "int32", "mstype.int32"):
        out = transforms.TypeCast(dtype)(x)
        assert out.dtype == np.int32 and out.tolist() == [0, 1, 2, 3, 4]
    assert transforms.TypeCast(torch.float16)(x).dtype == np.float16
    with pytest.raises(DatasetError, match="TypeCast"):
        transforms.TypeCast(torch.bfloat16)
    with pytest.raises(DatasetError, match="TypeCast"):
        transforms.TypeCast("not-a-type")


def test_compose_and_import_aliases():
    import autopar.dataset.transforms.c_transforms as C
    import autopar.dataset.transforms.py_transforms as P
    import autopar.dataset.transforms.vision.c_transforms as v02
    import autopar.dataset.vision.c_transforms as vc
    import autopar.dataset.vision.py_transforms as vp

    assert vc.RandomCrop is vp.RandomCrop is v02.RandomCrop is vision.RandomCrop
    assert C.TypeCast is P.TypeCast is transforms.TypeCast
    x = images(n=2)
    comp = transforms.Compose([vision.Rescale(2.0, 0.0), lambda a: a + 1, vision.HWC2CHW()])
    np.testing.assert_allclose(comp(x[0]), x[0].transpose(2, 0, 1) * 2.0 + 1)
    np.testing.assert_allclose(comp.apply_batch(x, np.random.default_rng(0)), x.transpose(0, 3, 1, 2) * 2.0 + 1)
    with pytest.raises(DatasetError, match="Normalize"):
        vision.Normalize((0.5, 0.5), (0.1, 0.1, 0.1))
    with pytest.raises(DatasetError, match="Normalize: 3 mean/std values"):
        vision.Normalize((0.5,) * 3, (0.2,) * 3).apply_batch(np.zeros((2, 3, 4, 4), np.float32), None)
