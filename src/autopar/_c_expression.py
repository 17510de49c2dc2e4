"""``mindspore._c_expression`` (MindSpore's C++ graph executor): the names its samples import load, and stop at
first use with one line (r1.3's ``Model_ACCU`` calls ``init_exec_dataset`` to feed a device queue)."""
from autopar.errors import ACCUMULATE_INSTEAD, unsupported

init_exec_dataset = unsupported("_c_expression.init_exec_dataset", ACCUMULATE_INSTEAD)
