"""The MindSpore tutorials' create_dataset, with ``mindspore`` replaced by ``autopar``, runs unchanged.

The functions below are copied from the tutorial texts (CPU tutorial and r1.7 Ascend tutorial, section
"Loading the Dataset"); only the imports and the 224x224 resize (64 here, to keep the test fast) differ, and
``get_rank``/``get_group_size`` are supplied by the test so the copy needs no process group.
"""
from __future__ import annotations

import numpy as np
import torch

RANK = {"id": 0, "size": 1}


def get_rank():
    return RANK["id"]


def get_group_size():
    return RANK["size"]


# ---- copied from the CPU tutorial (import mindspore as ms / mindspore.dataset as ds ...) --------------------
import autopar.dataset as ds  # noqa: E402
import autopar.dataset.transforms as transforms  # noqa: E402
import autopar.dataset.vision as vision  # noqa: E402

ms_int32 = torch.int32  # the user writes ms.int32, i.e. autopar.int32, which is torch.int32


def create_dataset(data_path, repeat_num=1, batch_size=32):
    """Create training dataset"""
    resize_height = 64
    resize_width = 64
    rescale = 1.0 / 255.0
    shift = 0.0

    # get rank_id and rank_size
    rank_size = get_group_size()
    rank_id = get_rank()
    data_set = ds.Cifar10Dataset(data_path, num_shards=rank_size, shard_id=rank_id)

    # define map operations
    random_crop_op = vision.RandomCrop((32, 32), (4, 4, 4, 4))
    random_horizontal_op = vision.RandomHorizontalFlip()
    resize_op = vision.Resize((resize_height, resize_width))
    rescale_op = vision.Rescale(rescale, shift)
    normalize_op = vision.Normalize((0.4465, 0.4822, 0.4914), (0.2010, 0.1994, 0.2023))
    changeswap_op = vision.HWC2CHW()
    type_cast_op = transforms.TypeCast(ms_int32)

    c_trans = [random_crop_op, random_horizontal_op]
    c_trans += [resize_op, rescale_op, normalize_op, changeswap_op]

    # apply map operations on images
    data_set = data_set.map(operations=type_cast_op, input_columns="label")
    data_set = data_set.map(operations=c_trans, input_columns="image")

    # apply shuffle operations
    data_set = data_set.shuffle(buffer_size=10)

    # apply batch operations
    data_set = data_set.batch(batch_size=batch_size, drop_remainder=True)

    # apply repeat operations
    data_set = data_set.repeat(repeat_num)

    return data_set


def test_cpu_tutorial_create_dataset(cifar_small):
    data_set = create_dataset(str(cifar_small / "cifar-10-batches-bin"), repeat_num=2)
    assert data_set.get_dataset_size() == 2 * (384 // 32)  # usage None reads train + test (384 rows), as MindSpore
    assert data_set.get_col_names() == ["image", "label"]
    assert data_set.output_shapes() == [[32, 3, 64, 64], [32]]
    n = 0
    for image, label in data_set.create_tuple_iterator():
        assert image.dtype == torch.float32 and image.shape == (32, 3, 64, 64)
        assert label.dtype == torch.int32 and label.shape == (32,)
        assert 0 <= int(label.min()) and int(label.max()) <= 9
        assert -3.0 < float(image.mean()) < 3.0
        n += 1
    assert n == 24


def test_tutorial_on_two_ranks_gives_disjoint_equal_shards(cifar_small):
    seen = []
    for rank in range(2):
        RANK.update(id=rank, size=2)
        data_set = create_dataset(cifar_small, batch_size=16)
        assert data_set.get_dataset_size() == 12
        labels = [label for _, label in data_set.iter_epoch(0, output_numpy=True)]
        seen.append(np.concatenate(labels))
    RANK.update(id=0, size=1)
    assert len(seen[0]) == len(seen[1]) == 192
    counts = np.bincount(np.concatenate(seen), minlength=10)
    files = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    expected = np.bincount(np.concatenate([np.fromfile(cifar_small / "cifar-10-batches-bin" / name,
                                                       np.uint8).reshape(-1, 3073)[:, 0] for name in files]),
                           minlength=10)
    np.testing.assert_array_equal(counts, expected)  # together the two shards are exactly the data


def test_older_import_styles(cifar_small):
    """r1.x (``dataset.vision.c_transforms``, ``transforms.c_transforms as C``) and r0.2
    (``dataset.transforms.vision.c_transforms``) import paths, as written in those tutorials."""
    import autopar.dataset as ds
    import autopar.dataset.transforms.c_transforms as C
    import autopar.dataset.transforms.vision.c_transforms as vision_r02
    import autopar.dataset.vision.c_transforms as vision_r1

    for vis in (vision_r1, vision_r02):
        data_set = ds.Cifar10Dataset(cifar_small, num_shards=1, shard_id=0)
        c_trans = [vis.RandomCrop((32, 32), (4, 4, 4, 4)), vis.RandomHorizontalFlip(),
                   vis.Rescale(1.0 / 255.0, 0.0), vis.Normalize((0.4465, 0.4822, 0.4914), (0.2010, 0.1994, 0.2023)),
                   vis.HWC2CHW()]
        data_set = data_set.map(operations=C.TypeCast(torch.int32), input_columns="label")
        data_set = data_set.map(operations=c_trans, input_columns="image")
        data_set = data_set.shuffle(buffer_size=10).batch(batch_size=32, drop_remainder=True).repeat(1)
        image, label = next(iter(data_set))
        assert image.shape == (32, 3, 32, 32) and image.dtype == torch.float32 and label.dtype == torch.int32
