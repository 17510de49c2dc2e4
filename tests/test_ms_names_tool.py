"""tools/ms_names.py finds the MindSpore names a script uses -- through its aliases, the objects it makes and the
keywords it passes -- and says which autopar has, refuses or lacks (on a script written here)."""
import sys

from procutil import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import ms_names  # noqa: E402

SCRIPT = '''
import mindspore as ms
from mindspore import nn, ops
from mindspore.common.initializer import initializer

ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, comm_fusion={}, no_such_key=1)

class Net(nn.Cell):
    expansion = 4

    def __init__(self):
        super().__init__()
        self.fc = nn.Dense(4, 2, weight_init="normal")
        self.relu = ops.ReLU()
        self.w = ms.Parameter(initializer("normal", [2, 2]))

    def construct(self, x):
        return self.relu(self.fc(x)) * self.expansion

net = Net()
net.fc.set_comm_fusion(1)
net.relu.recompute()
net.fc.set_param_ps()
ms.NoSuchThing()
'''


def test_the_tool_lists_and_resolves_a_scripts_names(tmp_path):
    (tmp_path / "sample.py").write_text(SCRIPT)
    (tmp_path / "page.md").write_text("text\n```python\nimport mindspore as ms\nms.set_seed(1)\n```\n")
    rep = ms_names.report(tmp_path)
    status = {name: info["status"] for name, info in rep["names"].items()}
    for name in ("mindspore.nn.Dense", "mindspore.nn.Dense(weight_init=)", "mindspore.nn.Dense.set_comm_fusion",
                 "mindspore.ops.ReLU.recompute", "mindspore.common.initializer.initializer",
                 "mindspore.set_auto_parallel_context(comm_fusion=)", "mindspore.ParallelMode.DATA_PARALLEL",
                 "mindspore.set_seed"):
        assert status.get(name) == "ok", name
    assert status["mindspore.nn.Dense.set_param_ps"] == "refused"
    assert status["mindspore.NoSuchThing"] == "missing"
    assert status["mindspore.set_auto_parallel_context(no_such_key=)"] == "missing"
    assert "mindspore.nn.Cell.expansion" not in status  # the script's own class attribute
    assert set(rep["files"]) == {"sample.py", "page.md"}
