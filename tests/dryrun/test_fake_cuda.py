"""``autopar launch --dry-run --dry-run-device cuda``: the GPU path of a user's unmodified script runs on this CPU,
each simulated rank with a GPU of its own -- ``set_device``, ``.cuda()``, NCCL, ``torch.autocast("cuda")`` with
bf16 and with fp16 + ``GradScaler``, fused AdamW, SDPA's fused kernels -- in every mode, through both doors: a
plain PyTorch GPT loop and a Hugging Face Llama (tests/scripts/cuda_gpt.py), and the MindSpore tutorial's ResNet-50
script with ``device_target="GPU"``, and torchrun-style scripts without autopar (DDP, FSDP2). Each case ends with its GPU memory per rank. The mistakes a GPU run meets are
one line here: a batch left on the host, a rank on a device its host does not have, a GPU script dry-run on CPU."""
import json
import subprocess
import sys

import pytest
import torch

from autopar.dataset.synth import write_synthetic_cifar10
from procutil import ROOT, SCRIPTS, autopar_cmd

pytestmark = pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="a CPU-only torch: no CUDA kernels to "
                                "simulate (the dry run says so in one line)")
ENV = {"AUTOPAR_SHARED_MEMORY": "0", "AUTOPAR_AUTO_TRIALS": "0", "AUTOPAR_MEASURE_OPS": "0"}
# (mode, precision): every mode once, every precision in several modes
GPT_CASES = [("dp", "fp32"), ("zero1", "fp16"), ("zero2", "bf16"), ("zero3", "fp16"), ("semi_megatron", "fp16"),
             ("pipeline", "bf16"), ("auto", "bf16")]
LLAMA_CASES = [("dp", "bf16"), ("zero3", "bf16"), ("semi_megatron", "bf16"), ("auto", "fp16")]


def _dry(procs, tmp_path, n, script, *args, ok=True, env=None, flags=()):
    logs = tmp_path / f"dry{n}_{'_'.join(args) or 'script'}"
    res = procs.run(autopar_cmd("launch", "--dry-run", "--dry-run-device", "cuda", "-n", str(n), *flags,
                                "--log-dir", str(logs), str(script), *args), env=procs.env(**ENV, **(env or {})),
                    timeout=300)
    if ok:
        assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((logs / "dryrun.json").read_text()) if (logs / "dryrun.json").exists() else None
    return res, report


def _rows(report) -> dict:
    return {r: v["steady"] for r, v in report["ranks"].items()}


def test_the_plain_pytorch_gpt_loop_runs_its_gpu_path_in_every_mode(procs, tmp_path, n=2):
    steps = {}
    for mode, precision in GPT_CASES:
        res, report = _dry(procs, tmp_path, n, SCRIPTS / "cuda_gpt.py", mode, precision)
        assert report["device"] == "cuda" and "GPU memory per rank (each rank on a simulated NVIDIA H100" in res.stdout
        for rank, v in report["ranks"].items():
            assert v["error"] is None and v["steps"] == 2, (mode, rank, v)
            assert v["device"]["name"].startswith("NVIDIA H100") and v["steady"]["peak_bytes"] > 0, (mode, v)
        steps[(mode, precision)] = _rows(report)["0"]
        if mode == "pipeline":  # a simulated rank per stage
            assert sorted(report["ranks"]) == ["0", str(n // 2)], report["ranks"].keys()
    whole = steps[("dp", "fp32")]["parameters"]
    # what each mode keeps of the 2-layer GPT's parameters on a GPU (fp32 master weights under AMP too)
    assert steps[("zero3", "fp16")]["parameters"] == pytest.approx(whole / n, rel=0.05)
    assert steps[("zero1", "fp16")]["optimizer"] == pytest.approx(2 * whole / n, rel=0.05)
    assert steps[("semi_megatron", "fp16")]["parameters"] < 0.7 * whole


def test_a_torchrun_script_runs_its_gpu_path(procs, tmp_path):
    """No autopar in the script: nanoGPT's way (DDP with ``device_ids=[local_rank]``, bf16 autocast, fused AdamW,
    clipping), compiled too, and torchtitan's (FSDP2 on the meta device, a bf16 ``MixedPrecisionPolicy``,
    ``to_empty(device="cuda")``) -- FSDP2's default mesh is the GPUs' (torch asks its accelerator)."""
    steps = {}
    for args in (("ddp",), ("ddp", "compile"), ("fsdp",)):
        _, report = _dry(procs, tmp_path, 2, SCRIPTS / "torchrun_gpu.py", *args)
        v = report["ranks"]["0"]
        assert v["error"] is None and v["steps"] == 2, (args, v)
        steps[args] = v["steady"]
    assert steps[("fsdp",)]["parameters"] == pytest.approx(steps[("ddp",)]["parameters"] / 2, rel=0.05), steps
    assert steps[("ddp",)]["other"] >= steps[("ddp",)]["parameters"]  # DDP's gradient buckets


def test_a_hugging_face_llama_runs_its_gpu_path(procs, tmp_path):
    for mode, precision in LLAMA_CASES:
        _, report = _dry(procs, tmp_path, 2, SCRIPTS / "cuda_gpt.py", mode, precision, "-", "llama")
        v = report["ranks"]["0"]
        assert v["error"] is None and v["steps"] == 2 and v["steady"]["peak_bytes"] > 0, (mode, v)


def test_the_mindspore_gpu_tutorial_script_dry_runs_on_simulated_gpus(procs, tmp_path):
    """The tutorial's ResNet-50 script as its GPU page writes it: ``device_target="GPU"``, GRAPH_MODE (compiled, as
    on a GPU), ``init()``, Model.train on the CIFAR-10 reader sharded per rank -- data parallel at each ``amp_level``
    (bf16 on an H100; O2 in fp16 with its loss scale), and the page's AUTO_PARALLEL."""
    data = write_synthetic_cifar10(tmp_path / "cifar", records_per_file=256)
    source = (ROOT / "examples" / "resnet50_distributed_training.py").read_text()
    assert 'device_target="CPU"' in source and "Model(net, loss_fn=loss, optimizer=opt)" in source
    env = {"IMAGE_SIZE": "32", "BATCH_SIZE": "16", "EPOCH_SIZE": "1", "DATA_PATH": str(data)}
    parameters = {}
    for mode, level, dtype in (("DATA", "O1", None), ("DATA", "O2", "float16"), ("DATA", "O3", None),
                               ("AUTO", "O2", None)):
        case = tmp_path / f"{mode}_{level}_{dtype}"
        case.mkdir()
        script = case / "resnet50_distributed_training_gpu.py"
        script.write_text(source.replace('device_target="CPU"', 'device_target="GPU"')
                          .replace("Model(net, loss_fn=loss, optimizer=opt)",
                                   f'Model(net, loss_fn=loss, optimizer=opt, amp_level="{level}")')
                          .replace("ParallelMode.DATA_PARALLEL", f"ParallelMode.{mode}_PARALLEL"))
        (case / "resnet.py").write_text((ROOT / "examples" / "resnet.py").read_text())
        res, report = _dry(procs, case, 2, script, env={**env, **({"AUTOPAR_AMP_DTYPE": dtype} if dtype else {})})
        v = report["ranks"]["0"]
        assert v["error"] is None and v["steps"] == 2, (mode, level, v)
        assert "GRAPH_MODE: compiled" in (case / "dry2_script" / "dryrun_rank0.log").read_text()
        parameters[level] = v["steady"]["parameters"]
        if mode == "AUTO":  # planned for the simulated H100s (h100-ib), not for this host
            assert report["predicted_step_s"] > 0 and "(AUTO_PARALLEL's cost model, on h100-ib)" in res.stdout, \
                res.stdout
    # ResNet-50's 23.5e6 parameters, whole on each rank: fp32 (O1, O2: fp32 master weights), bf16 at O3
    assert 85 * 2**20 < parameters["O1"] < 100 * 2**20 and parameters["O2"] == parameters["O1"], parameters
    assert parameters["O3"] == pytest.approx(parameters["O1"] / 2, rel=0.05), parameters
    # a CPU dry run of the same GPU script says in one line how to simulate its GPUs
    res = procs.run(autopar_cmd("launch", "--dry-run", "-n", "2", "--log-dir", str(tmp_path / "cpu"), str(script)),
                    env=procs.env(**ENV, **env), timeout=300)
    assert res.returncode == 1 and "device_target='GPU' in a dry run on the CPU: simulate the GPUs with autopar " \
        "launch --dry-run --dry-run-device cuda" in res.stderr and "Traceback" not in res.stderr, res.stderr


MS_LOOP = """import os
import autopar as ms
import autopar.dataset as ds
from autopar import nn
from autopar.communication import init, get_rank, get_group_size

ms.set_context(mode=ms.GRAPH_MODE)  # no device named: a GPU host's
ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
init()
assert int(os.getenv("RANK_ID")) == get_rank() and int(os.getenv("DEVICE_ID")) == get_rank() % 2


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.dense = nn.SequentialCell(nn.Dense(28 * 28, 64), nn.ReLU(), nn.Dense(64, 10))

    def construct(self, x):
        return self.dense(self.flatten(x))


net = Network()
data = ds.MnistDataset(os.getenv("DATA_PATH"), num_shards=get_group_size(), shard_id=get_rank())
data = data.map([ds.vision.Rescale(1.0 / 255.0, 0), ds.vision.HWC2CHW()], "image")
data = data.map(ds.transforms.TypeCast(ms.int32), "label").batch(16)
optimizer = nn.SGD(net.trainable_params(), 1e-2)
loss_fn = nn.CrossEntropyLoss()


def forward_fn(x, y):
    logits = net(x)
    return loss_fn(logits, y), logits


grad_fn = ms.value_and_grad(forward_fn, None, net.trainable_params(), has_aux=True)
grad_reducer = nn.DistributedGradReducer(optimizer.parameters)
for image, label in data:
    assert image.device.type == "cuda", image.device  # a dataset feeds the device, as MindSpore's does
    (loss, _), grads = grad_fn(image, label)
    optimizer(grad_reducer(grads))
"""


def test_a_mindspore_loop_gets_its_batches_on_the_gpu(procs, tmp_path):
    """MindSpore's data-parallel sample's loop (a dataset, ``value_and_grad``, ``DistributedGradReducer``): its batches
    arrive on the rank's GPU, as a MindSpore dataset feeds the device -- the samples never move a batch, and on a GPU
    job autopar's CPU batches met the network on the GPU (7 of MindSpore's 15 samples stopped there)."""
    from autopar.dataset.mnist import write_synthetic_mnist

    data = write_synthetic_mnist(tmp_path / "MNIST_Data" / "train", train=64, test=16)
    script = tmp_path / "ms_loop.py"
    script.write_text(MS_LOOP)
    _, report = _dry(procs, tmp_path, 2, script, env={"DATA_PATH": str(data)})
    v = report["ranks"]["0"]
    assert v["error"] is None and v["steps"] == 2 and v["steady"]["parameters"] > 200e3, v


WRONG_DEVICE = """import os
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
torch.cuda.set_device(dist.get_rank())  # the global rank: a device this host has only on a one-node job
net = torch.nn.Linear(8, 8).cuda()
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for _ in range(3):
    net(torch.randn(4, 8, device="cuda")).sum().backward()
    opt.step()
"""


def test_the_mistakes_a_gpu_run_meets_are_one_line_before_it_is_booked(procs, tmp_path):
    res, report = _dry(procs, tmp_path, 2, SCRIPTS / "cuda_gpt.py", "dp", "fp32", "mixup", ok=False)
    line = [e for e in res.stderr.splitlines() if e.startswith("autopar: error:")]
    assert res.returncode == 1 and len(line) == 1 and "Expected all tensors to be on the same device" in line[0] \
        and "cuda:0 and cpu" in line[0] and "(at cuda_gpt.py:" in line[0], res.stderr
    script = tmp_path / "wrong_device.py"
    script.write_text(WRONG_DEVICE)
    res, report = _dry(procs, tmp_path, 2, script, flags=("--nnodes", "2", "--dry-run-ranks", "1,3"), ok=False)
    assert res.returncode == 1 and "rank 3 of 4: RuntimeError: CUDA error: invalid device ordinal (device 3 on a " \
        "host of 2 GPUs" in res.stderr and "(at wrong_device.py:6)" in res.stderr, res.stderr
    assert report["ranks"]["1"]["error"] is None  # rank 1 is device 1 of node 0: fine
    res = procs.run(autopar_cmd("launch", "--dry-run-device", "cuda", "-n", "1", "--log-dir", str(tmp_path / "l"),
                                str(script)), env=procs.env(**ENV), timeout=120)
    assert "--dry-run-device act only with --dry-run: ignored" in res.stderr, res.stderr


SDPA = """import os
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from autopar.dryrun import fake_cuda
from autopar.dryrun.tracker import StorageTracker

fake_cuda.install(1, StorageTracker("cuda"))
F = torch.nn.functional


class Kernels(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in str(func) or "bmm" in str(func):
            seen.append(str(func).split(".")[1])
        return func(*args, **(kwargs or {}))


with FakeTensorMode(allow_non_fake_inputs=True):
    for dtype, mask, head in ((torch.bfloat16, None, 64), (torch.float16, True, 64), (torch.float32, None, 64),
                              (torch.bfloat16, None, 6)):
        q = torch.randn(2, 4, 128, head, device="cuda", dtype=dtype, requires_grad=True)
        m = torch.ones(128, 128, dtype=torch.bool, device="cuda").tril() if mask else None
        seen = []
        with Kernels():
            F.scaled_dot_product_attention(q, q, q, attn_mask=m, is_causal=m is None).sum().backward()
        print(sorted(set(seen)))
# ended as the dry run's runner ends (autopar/dryrun/runner.py): the fake device's autograd threads can race the
# interpreter's teardown ("terminate called without an active exception", pytorch/pytorch#50893), once in a full run
sys.stdout.flush()
os._exit(0)
"""


def test_attention_runs_the_kernel_torch_picks_on_the_gpu(tmp_path):
    """Flash attention for bf16/fp16 without a mask, memory-efficient attention with a mask or in fp32, the math
    path (whose score matrix the fused kernels never store) for a head of 6 features -- as torch picks on an H100,
    and its backward."""
    script = tmp_path / "sdpa.py"
    script.write_text(SDPA)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    flash, masked, fp32, odd = [eval(line) for line in res.stdout.splitlines()]  # noqa: S307 - our own print
    assert flash == ["_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"], flash
    assert masked == fp32 == ["_efficient_attention_backward", "_scaled_dot_product_efficient_attention"] or \
        masked == fp32 == ["_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"], \
        (masked, fp32)
    assert odd == ["bmm"], odd


def test_the_gpu_check_runs_end_to_end_with_its_gpu_steps_skipped(procs, tmp_path):
    """``bench/gpu_check.sh``, the one command for a lent GPU: here its GPU steps say they were skipped, the fake-CUDA
    dry run runs, the benchmark workloads the GPU would run are rehearsed once on simulated GPUs, and one JSON
    records it all."""
    out = tmp_path / "gpu_check.json"
    res = procs.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--out", str(out)],
                    env=procs.env(PYTHON=sys.executable, **ENV), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(out.read_text())
    gpu = torch.cuda.is_available()
    assert report["device"] is None or gpu
    assert set(report["steps"]) == {"gpu_tests", "readme_job", "resnet50", "gpt", "dryrun", *(() if gpu else
                                                                                             ("rehearsal",))}
    for name in ("gpu_tests", "readme_job", "resnet50", "gpt"):
        assert gpu or report["steps"][name] == {"skipped": "no CUDA device here"}, report["steps"][name]
    dry = report["steps"]["dryrun"]
    assert dry["ok"] and dry["predicted_peak_mib"]["0"] > 0, dry
    if not gpu:  # the benchmark workloads the GPU will run, run once on simulated GPUs
        for label, step in report["steps"]["rehearsal"].items():
            assert step["ok"] and step["workload_ran"] and step["predicted_peak_mib"]["autopar_peak_mib"] > 0, \
                (label, step)
