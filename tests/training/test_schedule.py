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


@pytest.mark.parametrize(
    ("peak", "floor", "match"),
    [
        (0.0, 0.0, r"lr \(the peak\) to be a finite number > 0, got 0\.0"),  # was a ZeroDivisionError
        (0.1, 0.2, r"min_lr to be a finite number >= 0 and <= 0\.1, got 0\.2"),  # was a "decay" rising to 0.2
        (0.1, -0.1, r"min_lr to be .*, got -0\.1"),  # was a decay below zero, to a negative rate
        (0.1, math.nan, r"min_lr to be .*, got nan"),  # was a NaN rate after the warm-up
    ],
    ids=["zero_peak", "floor_above_peak", "negative_floor", "nan_floor"],
)
def test_a_peak_or_floor_that_cannot_decay_is_refused(peak, floor, match):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    with pytest.raises(ValueError, match=r"warmup_cosine_schedule: expected .*" + match):
        warmup_cosine_schedule(optimizer, 10, 0, floor)
    assert optimizer.param_groups[0]["lr"] == peak  # untouched


def test_a_floor_equal_to_the_peak_holds_the_rate():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = warmup_cosine_schedule(optimizer, 4, 0, 0.1)
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([0.1] * 6, rel=1e-15)
