"""Which casts reduce a partial sum before they round (autopar.parallel.tensor.handlers.narrows); the casts on real
ranks are in tests/models/test_hf_transformers.py (the 'lone' cases: a Llama lm_head split on its input features,
whose float64 logits Hugging Face's loss casts to float32, equal to one process)."""
import pytest
import torch

from autopar.parallel.tensor.handlers import narrows


@pytest.mark.parametrize("source, target, expected", [
    (torch.float64, torch.float32, True),  # HF's logits.float() in float64 training
    (torch.float32, torch.bfloat16, True),
    (torch.float16, torch.bfloat16, True),  # same width, fewer mantissa bits
    (torch.bfloat16, torch.float16, True),  # same width, a smaller range
    (torch.float32, torch.int64, True),  # an integer of a sum is not the sum of integers (DTensor reduces too)
    (torch.float32, torch.float64, False),  # widening: the parts' sum is kept exactly
    (torch.float32, torch.float32, False),
    (torch.float32, None, False),  # .to(device) or a layout change: no dtype given
    (torch.int64, torch.float32, False),  # integer partials: DTensor's own rule
])
def test_a_cast_narrows_where_it_can_lose_what_a_sum_holds(source, target, expected):
    assert narrows(source, target) is expected
