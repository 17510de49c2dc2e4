"""The tutorials' job: ResNet-50 on CIFAR-10 with Momentum(0.01, 0.9), batch 32 per rank, LossMonitor.

Run by ``autopar train`` on every worker (``python resnet_cifar.py --data DIR ...``); usable alone too (one
process = stand-alone). Everything here goes through the public API a user script would call.
"""
from __future__ import annotations

import argparse
import random

import numpy as np
import torch

import autopar.dataset as ds
import autopar.dataset.transforms as transforms
import autopar.dataset.vision as vision
from autopar import context
from autopar import dtype as mstype
from autopar.communication import get_group_size, get_rank, init
from autopar.models import resnet50
from autopar.nn import Momentum, SoftmaxCrossEntropyExpand
from autopar.train import CheckpointConfig, LossMonitor, Model, ModelCheckpoint, TimeMonitor

MEAN = (0.4465, 0.4822, 0.4914)
STD = (0.2010, 0.1994, 0.2023)


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    ds.config.set_seed(seed)


def create_dataset(data_path: str, batch_size: int = 32, image_size: int = 32, repeat_num: int = 1,
                   usage: str = "train", augment: bool = True):
    """The tutorial's create_dataset, with the image size as a parameter (224 in the tutorial)."""
    data_set = ds.Cifar10Dataset(data_path, usage=usage, num_shards=get_group_size(), shard_id=get_rank(),
                                 shuffle=augment)
    trans = [vision.RandomCrop((32, 32), (4, 4, 4, 4)), vision.RandomHorizontalFlip()] if augment else []
    trans += [vision.Resize((image_size, image_size)), vision.Rescale(1.0 / 255.0, 0.0),
              vision.Normalize(MEAN, STD), vision.HWC2CHW()]
    data_set = data_set.map(operations=transforms.TypeCast(mstype.int32), input_columns="label")
    data_set = data_set.map(operations=trans, input_columns="image")
    if augment:
        data_set = data_set.shuffle(buffer_size=10)
    data_set = data_set.batch(batch_size=batch_size, drop_remainder=True)
    return data_set.repeat(repeat_num)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True, help="directory holding cifar-10-batches-bin")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--mode", default="data_parallel")
    p.add_argument("--grad-accumulation", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--steps-per-epoch", type=int, default=-1, help="cut epochs to this many steps (Dataset.take)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--print-every", type=int, default=1)
    p.add_argument("--eval", action="store_true", help="report test accuracy after training")
    p.add_argument("--bn-images", type=int, default=512,
                   help="with --eval: re-estimate BatchNorm statistics on this many training images first (precise "
                        "BN; 0: evaluate with the moving statistics, as MindSpore)")
    p.add_argument("--ckpt-dir", default=None, help="save checkpoints to CKPT_DIR/ckpt_<rank>")
    p.add_argument("--ckpt-steps", type=int, default=0, help="save every N steps (and at the end)")
    p.add_argument("--sliced", action="store_true", help="save each rank's slices (integrated_save=False)")
    p.add_argument("--resume", action="store_true", help="continue after the newest checkpoint in --ckpt-dir")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    context.set_context(mode=context.PYNATIVE_MODE)
    context.set_auto_parallel_context(parallel_mode=args.mode, gradients_mean=True)
    init()
    set_seed(args.seed)
    dataset = create_dataset(args.data, args.batch_size, args.image_size)
    net = resnet50(args.batch_size, 10)
    loss = SoftmaxCrossEntropyExpand(sparse=True)
    opt = Momentum(filter(lambda x: x.requires_grad, net.parameters()), args.lr, args.momentum)
    model = Model(net, loss_fn=loss, optimizer=opt, metrics={"acc"}, grad_accumulation_steps=args.grad_accumulation)
    if args.steps_per_epoch > 0:
        dataset = dataset.take(args.steps_per_epoch)
    callbacks = [LossMonitor(args.print_every), TimeMonitor()]
    resume_from = None
    if args.ckpt_dir:
        directory = f"{args.ckpt_dir}/ckpt_{get_rank()}"
        config = CheckpointConfig(save_checkpoint_steps=args.ckpt_steps, integrated_save=not args.sliced)
        callbacks.append(ModelCheckpoint("resnet50", directory, config))
        resume_from = directory if args.resume else None
    model.train(args.epochs, dataset, callbacks=callbacks, resume_from=resume_from)
    if args.eval:
        how = "BatchNorm moving statistics"
        if args.bn_images > 0:
            train = create_dataset(args.data, args.batch_size, args.image_size, augment=False)
            images = model.recompute_bn_statistics(train, args.bn_images)
            how = f"BatchNorm statistics re-estimated on {images} training images: precise BN; --bn-images 0 uses the moving ones"
        test = create_dataset(args.data, args.batch_size, args.image_size, usage="test", augment=False)
        acc = model.eval(test)["acc"]
        if get_rank() == 0:
            print(f"test accuracy: {acc:.4f} ({how})", flush=True)


if __name__ == "__main__":
    main()
