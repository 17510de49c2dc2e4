"""``common.initializer``: MindSpore's distributions (not torch's defaults), its names, and reproducibility."""
import math
import random

import numpy as np
import pytest
import torch

import autopar
import autopar.dataset as ds
from autopar.common.initializer import (
    Constant,
    HeNormal,
    HeUniform,
    Normal,
    One,
    TruncatedNormal,
    Uniform,
    XavierUniform,
    Zero,
    initializer,
)
from autopar.errors import ConfigError

SHAPE = [400, 300]  # fan_in 300, fan_out 400 (MindSpore's fans of a 2-D shape)


@pytest.mark.parametrize("init,mean,std,bound", [
    ("normal", 0.0, 0.01, None), (Normal(sigma=0.5, mean=1.0), 1.0, 0.5, None),
    ("uniform", 0.0, 0.07 / math.sqrt(3), 0.07), (Uniform(scale=2.0), 0.0, 2 / math.sqrt(3), 2.0),
    ("XavierUniform", 0.0, math.sqrt(6 / 700) / math.sqrt(3), math.sqrt(6 / 700)),
    ("he_uniform", 0.0, math.sqrt(2 / 300), math.sqrt(6 / 300)), (HeNormal(), 0.0, math.sqrt(2 / 300), None),
    (HeUniform(math.sqrt(5)), 0.0, 1 / math.sqrt(300) / math.sqrt(3), 1 / math.sqrt(300)),
])
def test_distributions_match_mindspores_definitions(init, mean, std, bound):
    torch.manual_seed(0)
    t = initializer(init, SHAPE, autopar.float32)
    assert t.shape == tuple(SHAPE) and t.dtype == torch.float32
    assert abs(float(t.mean()) - mean) < 4 * std / math.sqrt(t.numel()) + 1e-6
    assert abs(float(t.std()) - std) < 0.02 * std
    if bound is not None:
        assert float(t.abs().max()) <= bound and float(t.abs().max()) > 0.98 * bound


def test_truncated_normal_cuts_at_absolute_bounds():
    torch.manual_seed(0)
    t = initializer(TruncatedNormal(sigma=1.0, a=-0.5, b=0.5), [20000])
    assert float(t.min()) >= -0.5 and float(t.max()) <= 0.5
    default = initializer("truncatedNormal", [20000])  # sigma 0.01, cut at +-2 (never reached)
    assert abs(float(default.std()) - 0.01) < 0.0005


def test_constants_names_and_tensors():
    assert torch.equal(initializer("ones", [2, 3]), torch.ones(2, 3))
    assert torch.equal(initializer(Zero(), (2,)), torch.zeros(2))
    assert torch.equal(initializer(One, 3, autopar.int32), torch.ones(3, dtype=torch.int32))
    assert torch.equal(initializer(Constant(2.5), [2]), torch.full((2,), 2.5))
    assert torch.equal(initializer(0.5, [2]), torch.full((2,), 0.5))
    src = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert torch.equal(initializer(src, [2, 3]), torch.from_numpy(src))
    with pytest.raises(ConfigError, match="unknown initializer 'gaussian'"):
        initializer("gaussian", [2])
    with pytest.raises(ConfigError, match="shape"):
        initializer(src, [3, 2])
    with pytest.raises(ConfigError, match="at least 2 dimensions"):
        initializer(XavierUniform(), [5])


def test_parameter_of_an_initializer_keeps_its_name():
    p = autopar.Parameter(initializer("normal", [3, 4], autopar.float32), name="fc1.weight")
    assert isinstance(p, torch.nn.Parameter) and p.name == "fc1.weight" and p.requires_grad
    p.set_data(torch.zeros(3, 4))
    assert float(p.detach().abs().max()) == 0.0 and torch.equal(p.value(), torch.zeros(3, 4))


def test_set_seed_seeds_torch_numpy_python_and_the_data_pipeline():
    def draw():
        data = ds.NumpySlicesDataset(np.arange(50), shuffle=True)
        order = [int(v) for (v,) in data.create_tuple_iterator(output_numpy=True)]
        return initializer("normal", [4]), np.random.rand(), random.random(), order

    autopar.set_seed(7)
    first = draw()
    autopar.set_seed(7)
    second = draw()
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]
    assert ds.config.get_seed() == 7 and autopar.get_seed() == 7
    with pytest.raises(ConfigError, match="seed must be"):
        autopar.set_seed(-1)
