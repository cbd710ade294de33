"""gpattn.fused.autocast: the dtype in which precision-critical quantities of a computation are formed."""

from __future__ import annotations

import pytest
import torch

from gpattn.fused import wide_dtype


@pytest.mark.parametrize(
    ("dtype", "wide"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_wide_dtype_is_float32_for_half_precision_and_the_dtype_itself_otherwise(dtype, wide):
    assert wide_dtype(dtype) is wide
    # the type promotion of the dtype with float32, as torch computes it
    assert wide_dtype(dtype) is torch.promote_types(dtype, torch.float32)
