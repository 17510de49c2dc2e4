"""Strategy validation (every error names the operator) and the Layout value type, without processes."""
import pytest

from autopar.errors import StrategyError
from autopar.layout import spec as S
from autopar.layout.layout import Layout
from autopar.layout.strategy import data_parallel_strategy, derive_plan
from autopar.ops.math import MatMul, OneHot, ReduceSum, Softmax

MM = S.matmul(2, 2)


def plan(strategy, shapes=((8, 16), (16, 4)), n=4, spec=MM, op="MatMul 'fc'"):
    return derive_plan(op, spec, tuple(tuple(s) for s in strategy), tuple(shapes), n)


def test_column_split_layout():
    p = plan(((1, 1), (1, 2)), n=2)
    assert p.device_matrix == (1, 2)
    assert p.inputs[0].tensor_map == (-1, -1) and p.inputs[1].tensor_map == (-1, 1)
    assert p.output_map == (-1, 1) and p.partial_axes == ()


def test_contracted_split_is_partial_and_repeat_axis_first():
    p = plan(((1, 2), (2, 1)), n=4)
    assert p.device_matrix == (2, 2)  # 2 replicas (data-parallel axis) x 2 parts of k
    assert p.partial_axes == (1,) and p.output_map == (-1, -1)
    assert p.inputs[0].num_replicas == 2


def test_two_dimensional_strategy():
    p = plan(((2, 2), (2, 1)), n=4)
    assert p.device_matrix == (1, 2, 2)
    assert p.inputs[0].tensor_map == (1, 2) and p.inputs[1].tensor_map == (2, -1)
    assert p.output_map == (1, -1) and p.partial_axes == (2,)


@pytest.mark.parametrize("strategy, shapes, n, message", [
    (((1, 1),), ((8, 16), (16, 4)), 2, "MatMul 'fc': strategy ((1, 1),) has 1 entries but the operator has 2"),
    (((1, 1, 1), (1, 2)), ((8, 16), (16, 4)), 2, "strategy entry (1, 1, 1) for input 0 has 3 values but that "
                                                  "input has rank 2"),
    (((1, 1), (1, 3)), ((8, 16), (16, 4)), 3, "dimension 1 of input 1 has size 4, which cannot be split into 3"),
    (((2, 2), (2, 2)), ((8, 16), (16, 4)), 4, "needs 8 devices but there are only 4"),
    (((1, 1), (1, 2)), ((8, 16), (16, 4)), 3, "splits into 2 parts, which does not divide the 3 devices"),
    (((1, 2), (1, 1)), ((8, 16), (16, 4)), 2, "contracted dimensions are split differently: input 0 dimension 1 "
                                              "into 2 parts but input 1 dimension 0 into 1"),
])
def test_validation_errors_name_the_operator(strategy, shapes, n, message):
    with pytest.raises(StrategyError, match="^MatMul 'fc': ") as err:
        plan(strategy, shapes, n)
    assert message.split("MatMul 'fc': ")[-1] in str(err.value)


def test_unsplittable_and_broadcast_dimensions():
    with pytest.raises(StrategyError, match="cannot be split"):
        plan(((1, 2),), ((8, 16),), 2, Softmax().spec(_T(8, 16)), "Softmax 'sm'")
    add = S.elementwise(2, 2)
    with pytest.raises(StrategyError, match="broadcast"):
        plan(((2, 1), (2, 1)), ((8, 16), (1, 16)), 2, add, "Add 'add'")


def test_default_data_parallel_strategy():
    assert data_parallel_strategy(MM, [(8, 16), (16, 4)], 4) == ((4, 1), (1, 1))
    assert data_parallel_strategy(MM, [(6, 16), (16, 4)], 4) == ((1, 1), (1, 1))  # 6 rows: not divisible
    red = ReduceSum().spec(_T(8,), -1)
    assert data_parallel_strategy(red, [(8,)], 2) == ((2,),)
    assert OneHot().spec(_T(8), 10, _T(), _T()).inputs == ("ab", "", "")


def test_shard_checks_the_form():
    with pytest.raises(StrategyError, match="split counts must be positive"):
        MatMul().shard(((1, 0), (1, 1)))
    with pytest.raises(StrategyError, match="tuple of tuples"):
        MatMul().shard((1, 2))


def test_layout_geometry():
    lay = Layout((2, 4), (1, -1), (512, 128))
    assert lay.splits == (4, 1) and lay.slice_shape == (128, 128) and lay.num_replicas == 2
    assert lay.coordinates(5) == (1, 1) and lay.slice_index(5) == (1, 0) and lay.offsets(6) == (256, 0)
    assert Layout.from_dict(lay.to_dict()) == lay
    assert str(lay) == "[S1,R] on (2, 4)"
    with pytest.raises(StrategyError, match="cannot be split into 4"):
        Layout((4,), (0,), (6,))


class _T:
    """A stand-in with a shape, enough for OpSpec builders."""

    def __init__(self, *shape):
        self.shape = shape

    def dim(self):
        return len(self.shape)
