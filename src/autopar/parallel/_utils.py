"""``mindspore.parallel._utils`` names that MindSpore's own samples reach (r1.3's ``Model_ACCU``): MindSpore
internals for feeding a graph; they load, and stop at first use with one line naming the supported way."""
from autopar.errors import ACCUMULATE_INSTEAD, unsupported

_need_to_full = unsupported("parallel._utils._need_to_full", ACCUMULATE_INSTEAD)
_to_full_tensor = unsupported("parallel._utils._to_full_tensor", ACCUMULATE_INSTEAD)
