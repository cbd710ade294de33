"""The warm-up + cosine learning-rate schedule against its closed form."""

from __future__ import annotations

import math

import pytest
import torch

from gpattn.training import warmup_cosine_lr, warmup_cosine_schedule


def _closed_form(step, total, warmup, peak, floor):
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    return floor + (peak - floor) * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup)))) / 2


def test_schedule_is_warmup_then_cosine():
    total, warmup, peak, floor = 20, 5, 0.1, 0.01
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    scheduler = warmup_cosine_schedule(optimizer, total, warmup, floor)
    for step in range(total + 3):
        expected = _closed_form(step, total, warmup, peak, floor)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert warmup_cosine_lr(step, total, warmup, peak, floor) == pytest.approx(expected, rel=1e-12)
        optimizer.step()
        scheduler.step()
    assert _closed_form(warmup, total, warmup, peak, floor) == pytest.approx(peak)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(floor)


def test_without_warmup_the_first_step_is_the_peak():
    assert warmup_cosine_lr(0, 10, 0, 0.5, 0.1) == 0.5
    assert warmup_cosine_lr(5, 10, 0, 0.5, 0.1) == pytest.approx(0.1 + 0.4 * 0.5)  # half way: cos(pi / 2) = 0
    assert warmup_cosine_lr(99, 10, 0, 0.5, 0.1) == pytest.approx(0.1)


@pytest.mark.parametrize(("total", "warmup", "match"), [(0, 0, "total_steps"), (10, -1, "warmup_steps")])
def test_bad_step_counts_are_refused(total, warmup, match):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=match):
        warmup_cosine_schedule(optimizer, total, warmup)
