"""No silent result: a context key autopar accepts but does not apply yet warns once when it asks for something."""
import warnings

import pytest

import autopar


@pytest.fixture(autouse=True)
def fresh_context():
    autopar.reset_auto_parallel_context()
    autopar.context_values.warned.clear()
    yield
    autopar.reset_auto_parallel_context()


@pytest.mark.parametrize("key, value", [("comm_fusion", {"allreduce": {"mode": "index", "config": [0, 2]}}),
                                        ("auto_pipeline", True)])
def test_a_key_that_asks_for_something_not_applied_warns(key, value):
    with pytest.warns(UserWarning, match=f"{key}=.* is accepted but not applied yet"):
        autopar.set_auto_parallel_context(**{key: value})


@pytest.mark.parametrize("key, value", [("pipeline_stages", 1), ("enable_parallel_optimizer", False)])
def test_a_neutral_value_is_quiet(key, value):  # (optimizer sharding's keys: tests/parallel/test_optimizer_shard)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autopar.set_auto_parallel_context(**{key: value})


def test_r0_2_ascend_switches_warn_instead_of_failing():  # MindSpore r0.2's tutorial sets them
    keys = ("enable_task_sink", "enable_loop_sink", "enable_mem_reuse")
    autopar.errors._warned.difference_update(f"set_context.{k}" for k in keys)
    with pytest.warns(UserWarning) as record:
        autopar.set_context(enable_task_sink=True, enable_loop_sink=True, enable_mem_reuse=False)
    said = " ".join(str(w.message) for w in record)
    assert all(f"set_context({k}=" in said for k in keys) and "accepted but not applied" in said
