"""MindSpore's module paths and top-level names resolve, the context's comm_fusion is validated and says what the
reducers get, and AutoParallel is a thin front over the context (what it cannot honour raises one line)."""
import importlib
import warnings

import pytest
import torch

import autopar
from autopar import context, context_values
from autopar.errors import ConfigError, UnsupportedError


@pytest.fixture(autouse=True)
def fresh_context():
    autopar.reset_auto_parallel_context()
    context_values.warned.clear()
    yield
    autopar.reset_auto_parallel_context()


@pytest.mark.parametrize("path,names", [
    ("autopar.train.callback", ["LossMonitor", "ModelCheckpoint", "CheckpointConfig", "TimeMonitor", "Callback"]),
    ("autopar.train.serialization", ["load_checkpoint", "save_checkpoint", "load_param_into_net"]),
    ("autopar.communication.management", ["init", "get_rank", "get_group_size"]),
    ("autopar.nn.wrap", ["TrainOneStepCell", "WithLossCell", "DistributedGradReducer"]),
    ("autopar.ops.operations", ["MatMul", "Flatten", "Print", "AllReduce"]),
    ("autopar.common.initializer", ["initializer", "Normal", "One", "Zero", "XavierUniform", "HeUniform",
                                    "HeNormal", "TruncatedNormal", "Uniform", "Constant"]),
    ("autopar.runtime", ["set_memory", "synchronize"]),
    ("autopar.parallel.auto_parallel", ["AutoParallel"]),
    ("autopar.nn.utils", ["no_init_parameters"]),
    ("autopar", ["set_seed", "jit", "lazy_inline", "set_device", "ParameterTuple"]),
])
def test_mindspore_module_paths(path, names):
    module = importlib.import_module(path)
    for name in names:
        assert getattr(module, name) is not None, f"{path}.{name}"


def test_jit_runs_the_function_in_every_spelling():
    def step(x):
        return x + 1

    assert autopar.jit(step) is step and autopar.jit(mode="PSJit")(step) is step
    assert autopar.lazy_inline(step) is step

    class Net(autopar.nn.Cell):
        @autopar.jit
        def construct(self, x):
            return x * 2

    assert torch.equal(Net()(torch.ones(2)), torch.full((2,), 2.0))


def test_runtime_and_set_device_set_the_context():
    autopar.runtime.set_memory(max_size="2GB")
    assert autopar.get_context("max_device_memory") == 2 * 2**30
    with pytest.warns(UserWarning, match="set_memory\\(init_size=...\\) is accepted and not applied"):
        autopar.runtime.set_memory(init_size="1GB")
    autopar.set_device("CPU")
    assert autopar.get_context("device_target") == "CPU"


@pytest.mark.parametrize("fusion,expected", [
    (None, None), ({"allreduce": {"mode": "auto", "config": None}}, None),
    ({"allreduce": {"mode": "size", "config": 32}}, 32.0), ({"openstate": False}, 0.0),
    ({"allreduce": {"mode": "index", "config": [20, 35]}}, None),
])
def test_comm_fusion_tells_the_reducers_their_bucket_size(fusion, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopar.set_auto_parallel_context(comm_fusion=fusion)
    assert context.allreduce_bucket_mb() == expected


def test_comm_fusion_is_validated_and_unhonoured_modes_warn():
    for bad, message in (({"allreduce": {"mode": "size"}}, "fusion size in MB"), ([1], "must be a dict"),
                         ({"alltoall": {}}, "unknown key"), ({"allgather": {"mode": "index", "config": [1]}},
                                                               "'allreduce' only")):
        with pytest.raises(ConfigError, match=message):
            autopar.set_auto_parallel_context(comm_fusion=bad)
    with pytest.warns(UserWarning, match="comm_fusion=.*index.* is accepted but not applied yet"):
        autopar.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "index", "config": [2]}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autopar.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "size", "config": 8}})
    assert autopar.get_auto_parallel_context("comm_fusion") == {"allreduce": {"mode": "size", "config": 8}}


def test_autoparallel_methods_set_the_context():
    from autopar.parallel.auto_parallel import AutoParallel

    net = autopar.nn.Dense(2, 2)
    wrapped = AutoParallel(net, parallel_mode="sharding_propagation")
    get = autopar.get_auto_parallel_context
    assert get("parallel_mode") == "auto_parallel" and get("search_mode") == "sharding_propagation"
    wrapped.hsdp(shard_size=2, optimizer_level="level3")
    assert get("enable_parallel_optimizer") and get("optimizer_weight_shard_size") == 2
    assert get("parallel_optimizer_config") == {"optimizer_level": "level3"}
    wrapped.pipeline(stages=2, scheduler="gpipe")
    assert get("pipeline_stages") == 2 and get("pipeline_config")["pipeline_scheduler"] == "gpipe"
    wrapped.dataset_strategy("full_batch")
    assert get("full_batch")
    wrapped.save_param_strategy_file("/tmp/s.json")
    wrapped.enable_gradients_mean()
    wrapped.comm_fusion({"allreduce": {"mode": "size", "config": 16}})
    assert get("strategy_ckpt_save_file") == "/tmp/s.json" and get("gradients_mean")
    assert context.allreduce_bucket_mb() == 16.0
    x = torch.randn(3, 2)
    assert torch.equal(wrapped(x), net(x))  # a thin Cell around the network
    with pytest.raises(UnsupportedError, match="^AutoParallel.print_local_norm is not available in autopar"):
        wrapped.print_local_norm()
    with pytest.raises(UnsupportedError, match="output_broadcast=True"):
        wrapped.pipeline(stages=2, output_broadcast=True)
    with pytest.raises(ConfigError, match="parallel_mode must be one of semi_auto"):
        AutoParallel(net, parallel_mode="data_parallel")
    assert AutoParallel(lambda a: a + 1)(1) == 2  # a step function works too
    assert get("parallel_mode") == "semi_auto_parallel"
