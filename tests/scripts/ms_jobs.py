"""Worker: MindSpore's distributed sample flows, written here with the same MindSpore names the samples use, each
compared with one process training on the same global batches.

argv: OUT_PREFIX DATA_PATH CASES_JSON. Cases (our own adaptations; the samples themselves are not copied):

- ``dp_functional``  the data-parallel / startup samples: ``ms.set_seed``, ``MnistDataset(num_shards, shard_id)`` with
  ``vision.Rescale/Normalize/HWC2CHW`` and ``TypeCast``, ``nn.SequentialCell`` of ``nn.Dense(weight_init="normal",
  bias_init="zeros")`` and ``nn.ReLU``, ``nn.Flatten``, ``nn.CrossEntropyLoss``, ``value_and_grad(has_aux=True)``,
  ``nn.DistributedGradReducer``, an ``@ms.jit`` step, ``nn.SGD``;
- ``recompute``      the recompute sample: ``ops.ReLU().recompute()`` and ``Cell.recompute()`` on a Dense;
- ``operator``       the operator-parallel sample on 2 ranks: ``ms.Parameter(initializer("normal", ...))``,
  ``ops.Flatten``, ``ops.MatMul().shard``, ``ops.ReLU().shard`` in SEMI_AUTO_PARALLEL;
- ``autoparallel``   the 2.6 sample: ``no_init_parameters`` around the network and its optimizer, ``AutoParallel(train_step,
  parallel_mode="semi_auto")`` wrapping the step function;
- ``quickstart``     the parallel quick start: ``GeneratorDataset`` of a generator function, AUTO_PARALLEL with
  ``search_mode="sharding_propagation"``, ``nn.MSELoss``, ``nn.Momentum``, ``Model.train`` with ``LossMonitor``;
- ``model_generator`` data parallel ``Model.train`` on a random-access ``GeneratorDataset`` sharded per rank, its
  loss lines as MindSpore prints them.

Every case uses ``gradients_mean=True`` (the samples that leave it False sum the ranks' gradients). Writes
{case: {"param": largest difference from one process, ...}} to OUT_PREFIX.<rank>.
"""
import contextlib
import io
import json
import math
import sys
import traceback

import numpy as np
import torch

import autopar as ms
import autopar.dataset as ds
from autopar import nn, ops
from autopar.common.initializer import HeUniform, initializer
from autopar.communication import get_group_size, get_rank, init
from autopar.nn.utils import no_init_parameters
from autopar.parallel.auto_parallel import AutoParallel
from autopar.train import LossMonitor, Model

out_prefix, data_path, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
init()
rank, world = get_rank(), get_group_size()
STEPS, BATCH = 3, 8  # per-rank batch; the global batch is world * BATCH


def mnist(shard: int | None, shards: int | None, batch: int):
    ms.set_seed(1)
    data = ds.MnistDataset(data_path, num_shards=shards, shard_id=shard)
    data = data.map([ds.vision.Rescale(1.0 / 255.0, 0), ds.vision.Normalize(mean=(0.1307,), std=(0.3081,)),
                     ds.vision.HWC2CHW()], "image")
    data = data.map(ds.transforms.TypeCast(ms.int32), "label")
    return data.batch(batch)


def global_batches() -> list:
    """The batches of all ranks' shards, step by step, joined in rank order: what one process sees."""
    per_rank = [list(mnist(r, world, BATCH).create_tuple_iterator())[:STEPS] for r in range(world)]
    return [[torch.cat([per_rank[r][s][c] for r in range(world)]) for c in range(2)] for s in range(STEPS)]


def local_batches() -> list:
    return list(mnist(rank, world, BATCH).create_tuple_iterator())[:STEPS]


def mode(name: str, **kw) -> None:
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode=name, **kw)


def full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach()


def diff(net: torch.nn.Module, ref: dict) -> float:
    return max(float((full(p) - ref[k]).abs().max()) for k, p in net.named_parameters())


# ------------------------------------------------------------------------------------------- the networks
class DenseNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.dense_relu_sequential = nn.SequentialCell(
            nn.Dense(28 * 28, 32, weight_init="normal", bias_init="zeros"), nn.ReLU(),
            nn.Dense(32, 32, weight_init="normal", bias_init="zeros"), nn.ReLU(),
            nn.Dense(32, 10, weight_init="normal", bias_init="zeros"))

    def construct(self, x):
        return self.dense_relu_sequential(self.flatten(x))


class RecomputeNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.layer1, self.relu1 = nn.Dense(28 * 28, 32), ops.ReLU()
        self.layer2, self.relu2 = nn.Dense(32, 32), ops.ReLU()
        self.layer3 = nn.Dense(32, 10)

    def construct(self, x):
        x = self.relu1(self.layer1(self.flatten(x)))
        return self.layer3(self.relu2(self.layer2(x)))


class MatMulNet(nn.Cell):
    def __init__(self, strategies: bool):
        super().__init__()
        self.flatten = ops.Flatten()
        self.fc1_weight = ms.Parameter(initializer("normal", [28 * 28, 32], ms.float32))
        self.fc2_weight = ms.Parameter(initializer(HeUniform(math.sqrt(5)), [32, 32], ms.float32), name="fc2")
        self.fc3_weight = ms.Parameter(initializer("normal", [32, 10], ms.float32))
        self.matmul1, self.relu1 = ops.MatMul(), ops.ReLU()
        self.matmul2, self.relu2 = ops.MatMul(), ops.ReLU()
        self.matmul3 = ops.MatMul()
        if strategies:  # the sample's ((2, 4), (4, 1)) ... for 8 devices, as 2-device strategies
            self.matmul1.shard(((1, world), (world, 1)))
            self.relu1.shard(((world, 1),))
            self.matmul2.shard(((1, world), (world, 1)))
            self.relu2.shard(((world, 1),))

    def construct(self, x):
        x = self.relu1(self.matmul1(self.flatten(x), self.fc1_weight))
        x = self.relu2(self.matmul2(x, self.fc2_weight))
        return self.matmul3(x, self.fc3_weight)


# ------------------------------------------------------------------------------------------- the loops
def functional_train(net, batches, jit: bool, reducer: bool) -> list:
    optimizer = nn.SGD(net.trainable_params(), 1e-2)
    loss_fn = nn.CrossEntropyLoss()

    def forward_fn(data, target):
        logits = net(data)
        return loss_fn(logits, target), logits

    grad_fn = ms.value_and_grad(forward_fn, None, net.trainable_params(), has_aux=True)
    grad_reducer = nn.DistributedGradReducer(optimizer.parameters) if reducer else None

    def train_step(inputs, targets):
        (loss_value, _), grads = grad_fn(inputs, targets)
        if grad_reducer is not None:
            grads = grad_reducer(grads)
        optimizer(grads)
        return loss_value

    step = ms.jit(train_step) if jit else train_step
    return [float(step(x, y)) for x, y in batches]


def reference(build, batches, **kw) -> dict:
    mode("stand_alone")
    ms.set_seed(1)
    net = build()
    functional_train(net, batches, **kw)
    return {k: v.detach().clone() for k, v in net.named_parameters()}


def case_dp_functional() -> dict:
    ref = reference(DenseNet, global_batches(), jit=True, reducer=True)
    mode("data_parallel", gradients_mean=True)
    ms.set_seed(1)
    net = DenseNet()
    functional_train(net, local_batches(), jit=True, reducer=True)
    return {"param": diff(net, ref)}


def case_recompute() -> dict:
    ref = reference(RecomputeNet, global_batches(), jit=False, reducer=False)
    mode("data_parallel", gradients_mean=True)
    ms.set_seed(1)
    net = RecomputeNet()
    net.relu1.recompute()
    net.relu2.recompute()
    net.layer2.recompute()
    functional_train(net, local_batches(), jit=False, reducer=True)
    return {"param": diff(net, ref)}


def case_operator() -> dict:
    ref = reference(lambda: MatMulNet(False), global_batches(), jit=True, reducer=False)
    mode("semi_auto_parallel", gradients_mean=True)
    ms.set_seed(1)
    net = MatMulNet(True)
    functional_train(net, local_batches(), jit=True, reducer=False)
    sliced = [tuple(p.to_local().shape) for p in (net.fc1_weight, net.fc2_weight) if hasattr(p, "to_local")]
    return {"param": diff(net, ref), "local_shapes": sliced}


def case_autoparallel() -> dict:
    ref = reference(lambda: MatMulNet(False), global_batches(), jit=False, reducer=False)
    ms.reset_auto_parallel_context()
    ms.set_seed(1)
    with no_init_parameters():
        net = MatMulNet(True)
        optimizer = nn.SGD(net.trainable_params(), 1e-2)
    meta = net.fc1_weight.device.type
    loss_fn = nn.CrossEntropyLoss()

    def forward_fn(data, target):
        logits = net(data)
        return loss_fn(logits, target), logits

    grad_fn = ms.value_and_grad(forward_fn, None, net.trainable_params(), has_aux=True)

    def train_step(inputs, targets):
        (loss_value, _), grads = grad_fn(inputs, targets)
        optimizer(grads)
        return loss_value

    parallel_net = AutoParallel(train_step, parallel_mode="semi_auto")
    parallel_net.enable_gradients_mean()
    for x, y in local_batches():
        parallel_net(x, y)
    return {"param": diff(net, ref), "device_inside_block": meta}


class Generated(nn.Cell):
    def __init__(self, strategies: bool):
        super().__init__()
        self.weight = ms.Parameter(initializer("normal", [32, 16]), "w")
        self.weight2 = ms.Parameter(initializer("normal", [16, 16]), "w2")
        self.matmul = ops.MatMul()
        if strategies:
            self.matmul.shard(((1, world), (world, 1)))
        self.relu = ops.ReLU()
        self.matmul2 = ops.MatMul()

    def construct(self, x):
        return self.matmul2(self.relu(self.matmul(x, self.weight)), self.weight2)


def quickstart_data():
    rng = np.random.default_rng(1)
    inputs = rng.random((4, 32)).astype(np.float32)
    labels = rng.random((4, 16)).astype(np.float32)

    def generate():
        for _ in range(STEPS):
            yield inputs, labels

    return ds.GeneratorDataset(generate, ["input", "label"])


def model_train(net, loss, data) -> str:
    opt = nn.Momentum(net.trainable_params(), 0.4, 0.1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        Model(net, loss_fn=loss, optimizer=opt).train(1, data, callbacks=[LossMonitor()], dataset_sink_mode=False)
    return printed.getvalue()


def case_quickstart() -> dict:
    mode("stand_alone")
    ms.set_seed(1)
    ref_net = Generated(False)
    model_train(ref_net, nn.MSELoss(), quickstart_data())
    ref = {k: v.detach().clone() for k, v in ref_net.named_parameters()}
    mode("auto_parallel", search_mode="sharding_propagation", full_batch=True, gradients_mean=True)
    ms.set_seed(1)
    net = Generated(True)
    lines = model_train(net, nn.MSELoss(), quickstart_data())
    return {"param": diff(net, ref), "lines": lines.splitlines()}


class Rows:
    """A random-access source (``__getitem__``/``__len__``) of MNIST-sized rows."""

    def __init__(self):
        rng = np.random.default_rng(3)
        self.x = rng.standard_normal((world * BATCH * STEPS, 1, 28, 28)).astype(np.float32)
        self.y = rng.integers(0, 10, len(self.x)).astype(np.int32)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self):
        return len(self.x)


def generator_batches(shard, shards, batch):
    ms.set_seed(1)
    return ds.GeneratorDataset(Rows(), ["image", "label"], num_shards=shards, shard_id=shard).batch(batch)


def case_model_generator() -> dict:
    per_rank = [list(generator_batches(r, world, BATCH).create_tuple_iterator()) for r in range(world)]
    batches = [[torch.cat([per_rank[r][s][c] for r in range(world)]) for c in range(2)] for s in range(STEPS)]
    mode("stand_alone")
    ms.set_seed(1)
    ref_net = DenseNet()
    model_train(ref_net, nn.CrossEntropyLoss(), batches)
    ref = {k: v.detach().clone() for k, v in ref_net.named_parameters()}
    mode("data_parallel", gradients_mean=True)
    ms.set_seed(1)
    net = DenseNet()
    lines = model_train(net, nn.CrossEntropyLoss(), generator_batches(rank, world, BATCH))
    return {"param": diff(net, ref), "lines": lines.splitlines()}


results = {}
for name in cases:
    try:
        results[name] = globals()[f"case_{name}"]()
    except Exception as exc:  # noqa: BLE001 - reported to the test, which names the case
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
with open(f"{out_prefix}.{rank}", "w") as f:
    json.dump(results, f)
