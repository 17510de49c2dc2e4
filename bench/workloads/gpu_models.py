"""One GPU, autopar against the hand-written torch loop it replaces, interleaved rounds (bench/gpu_check.py).

argv: resnet SIZE[,SIZE] PRECISION[,PRECISION] eager|compiled ROUNDS STEPS | gpt MODE PRECISION ROUNDS STEPS. Prints
one JSON line per configuration: images/s (resnet) or tokens/s (gpt) per round for ``autopar`` and ``torch``, and
each one's peak
``torch.cuda.max_memory_allocated``. resnet: the tutorial's ResNet-50 on CIFAR-10-shaped batches (32x32 or resized
to 224x224), autopar's ``Model.train`` (GRAPH_MODE when compiled) vs a torch loop (``torch.compile`` when compiled).
gpt: tests/scripts/gpt.py's GPT (12 layers, 768 wide, block 1024) under autopar's MODE (data, zero3, auto) vs a
plain torch loop on the same device.
"""
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..", "..", "tests", "scripts"),
                os.path.join(HERE, "..", "..", "examples")]

import autopar  # noqa: E402

DEVICE = torch.device("cuda", 0)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _timed(run, steps: int, units: int) -> tuple[float, float]:
    """``run(k)`` trains k steps: once as a warm-up (a compile, the optimizer's state), then ``steps`` timed."""
    torch.cuda.reset_peak_memory_stats()
    run(1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    run(steps)
    torch.cuda.synchronize()
    return units * steps / (time.perf_counter() - start), torch.cuda.max_memory_allocated() / 2**20


def resnet(size: int, precision: str, compiled: bool, rounds: int, steps: int) -> dict:
    from resnet import resnet50

    batch = 128 if size == 32 else 32
    x = torch.randn(batch, 3, size, size, device=DEVICE)
    y = torch.randint(0, 10, (batch,), device=DEVICE)
    amp = {"fp32": "O0", "bf16": "O2", "fp16": "O2"}[precision]
    autopar.set_context(mode=autopar.GRAPH_MODE if compiled else autopar.PYNATIVE_MODE, device_target="GPU")

    def ours():
        net = resnet50(batch, 10)
        opt = autopar.nn.Momentum(net.trainable_params(), 0.01, 0.9)
        model = autopar.train.Model(net, loss_fn=autopar.nn.SoftmaxCrossEntropyWithLogits(sparse=True,
                                                                                       reduction="mean"),
                                    optimizer=opt, amp_level=amp)
        return lambda k: model.train(1, [(x, y)] * k, dataset_sink_mode=False)

    def theirs():
        net = resnet50(batch, 10).to(DEVICE)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        fwd = torch.compile(net) if compiled else net
        dtype = DTYPES.get(precision)
        scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")

        def step():
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                loss = torch.nn.functional.cross_entropy(fwd(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return lambda k: [step() for _ in range(k)]

    out = {"autopar": [], "torch": [], "unit": "images/s"}
    runs = {"autopar": ours(), "torch": theirs()}
    for _ in range(rounds):
        for name, step in runs.items():
            rate, peak = _timed(step, steps, batch)
            out[name].append(round(rate, 1))
            out[f"{name}_peak_mib"] = round(peak, 1)
    return out


def gpt(mode: str, precision: str, rounds: int, steps: int) -> dict:
    from gpt import GPT, GPTConfig

    config = GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
    batch = 8
    x = torch.randint(0, config.vocab_size, (batch, config.block_size), device=DEVICE)
    y = torch.randint(0, config.vocab_size, (batch, config.block_size), device=DEVICE)
    dtype = DTYPES.get(precision)
    name = {"auto": "auto_parallel"}.get(mode, "data_parallel")

    def loop(net, opt):
        def step():
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                _, loss = net(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return lambda k: [step() for _ in range(k)]

    def ours():
        autopar.set_auto_parallel_context(parallel_mode=name, gradients_mean=True)
        if mode == "zero3":
            autopar.set_auto_parallel_context(enable_parallel_optimizer=True,
                                              parallel_optimizer_config={"optimizer_level": "level3"})
        net = GPT(config).to(DEVICE)
        return loop(net, torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True))

    def theirs():
        net = GPT(config).to(DEVICE)
        return loop(net, torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True))

    out = {"autopar": [], "torch": [], "unit": "tokens/s"}
    runs = {"torch": theirs()}
    runs["autopar"] = ours()  # after the plain one: autopar's context is set from here on
    for _ in range(rounds):
        for label in ("autopar", "torch"):
            with autopar.context.managed() if label == "torch" else _nothing():
                rate, peak = _timed(runs[label], steps, batch * config.block_size)
            out[label].append(round(rate, 1))
            out[f"{label}_peak_mib"] = round(peak, 1)
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _report(config: str, result: dict) -> None:
    result["config"] = config
    result["ratio"] = round(sorted(result["autopar"])[len(result["autopar"]) // 2]
                            / sorted(result["torch"])[len(result["torch"]) // 2], 3)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    autopar.communication.init("nccl")
    kind, args = sys.argv[1], sys.argv[2:]
    if kind == "resnet":  # every size x precision in one process (one start-up, one CUDA context)
        for size in args[0].split(","):
            for precision in args[1].split(","):
                _report(f"{size}px/{precision}/{args[2]}",
                        resnet(int(size), precision, args[2] == "compiled", int(args[3]), int(args[4])))
    else:
        _report(f"{args[0]}/{args[1]}", gpt(args[0], args[1], int(args[2]), int(args[3])))
