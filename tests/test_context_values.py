"""Context values of the wrong type or inconsistent with the job are one-line errors (issue 33, items 4 and 6):
``enable_parallel_optimizer="False"`` turned ZeRO on, ``gradients_mean="no"`` averaged, ``device_num=True`` and
``device_num=4`` on 2 ranks were accepted, ``full_batch`` with a ``dataset_strategy`` kept both -- and an error
raised before ``init()`` printed a traceback."""
import re

import pytest

import autopar
from autopar.errors import ConfigError
from procutil import PYTHON, autopar_cmd


@pytest.fixture(autouse=True)
def fresh_context():
    autopar.reset_auto_parallel_context()
    yield
    autopar.reset_auto_parallel_context()


@pytest.mark.parametrize("kwargs, message", [
    ({"enable_parallel_optimizer": "False"}, "enable_parallel_optimizer must be True or False, got 'False' (str)"),
    ({"gradients_mean": "no"}, "gradients_mean must be True or False, got 'no'"),
    ({"gradients_mean": 1}, "gradients_mean must be True or False, got 1 (int)"),
    ({"parameter_broadcast": "yes"}, "parameter_broadcast must be True or False"),
    ({"full_batch": "True"}, "full_batch must be True or False"),
    ({"mirror_mean": "yes"}, "gradients_mean must be True or False"),
    ({"device_num": True}, "device_num must be a positive integer, got True"),
    ({"device_num": "2"}, "device_num must be a positive integer, got '2'"),
    ({"global_rank": False}, "global_rank must be a non-negative integer, got False"),
    ({"full_batch": True, "dataset_strategy": ((2, 1),)}, "full_batch=True and dataset_strategy=((2, 1),) contradict"),
])
def test_wrong_types_and_contradictions(kwargs, message):
    with pytest.raises(ConfigError) as info:
        autopar.set_auto_parallel_context(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert autopar.context.auto_parallel_context() == autopar.context._AutoParallelContext()  # nothing applied


def test_contradiction_across_calls_and_good_values():
    autopar.set_auto_parallel_context(dataset_strategy=((2, 1),))
    with pytest.raises(ConfigError, match="contradict"):
        autopar.set_auto_parallel_context(full_batch=True)
    autopar.set_auto_parallel_context(dataset_strategy="data_parallel", full_batch=True, gradients_mean=True,
                                      enable_parallel_optimizer=False, device_num=2, global_rank=0)
    assert autopar.get_auto_parallel_context("full_batch") is True
    with pytest.raises(ConfigError, match="device_id must be a non-negative integer, got 'x'"):
        autopar.set_context(device_id="x")
    with pytest.raises(ConfigError, match="enable_ssl must be True or False"):
        autopar.set_ps_context(enable_ssl="no")


def test_errors_before_init_and_against_the_job(procs, tmp_path):
    """Before init(): one line, no traceback (the hook used to be installed by init() only). device_num=4 on a
    2-rank job: refused at init(); device_num set after init() is checked at once."""
    res = procs.run([PYTHON, "-c", "import autopar as ms\nms.set_auto_parallel_context(gradients_mean='no')"],
                    timeout=60)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip() == "autopar: error: gradients_mean must be True or False, got 'no' (str)"
    res = procs.run([PYTHON, "-c", "import autopar as ms\nms.init()\nms.set_auto_parallel_context(device_num=4)"],
                    timeout=60)
    assert res.returncode == 1 and res.stderr.strip() == "autopar: error: device_num=4 but this job has 1 rank(s): " \
        "set device_num to 1 or leave it out (it defaults to the job's size)", res.stderr
    script = tmp_path / "four.py"
    script.write_text("import autopar as ms\n"
                      "ms.set_auto_parallel_context(parallel_mode='data_parallel', device_num=4)\n"
                      "ms.init()\n"
                      "print('ACCEPTED', flush=True)\n")
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"), str(script)), timeout=180)
    assert res.returncode == 1 and "ACCEPTED" not in res.stdout, res.stdout + res.stderr
    # every rank read the same context: one line for both (or rank 0's, where rank 1 was stopped before it got there)
    assert re.search(r"autopar: error: (every rank \(0, 1\)|rank [01]) failed: device_num=4 but this job has 2 "
                     r"rank\(s\)", res.stdout + res.stderr), res.stdout + res.stderr
    assert not procs.wait_no_leftovers()
