r"""The learning-rate schedule of the training loop: a linear warm-up, then a cosine decay to a floor."""

from __future__ import annotations

import math

import torch

from ..validation import check_float, check_int

__all__ = ["warmup_cosine_lr", "warmup_cosine_schedule"]


def warmup_cosine_lr(step: int, total_steps: int, warmup_steps: int, lr: float, min_lr: float = 0.0) -> float:
    r"""The learning rate of optimiser step ``step`` (from 0): linear warm-up, then cosine decay to ``min_lr``.

    With :math:`W` = ``warmup_steps`` and :math:`S` = ``total_steps``,

    .. math::

        \eta_s = \begin{cases}
            \eta \, \frac{s + 1}{W + 1} & s < W, \\
            \eta_{\min} + \frac{\eta - \eta_{\min}}{2} \big(1 + \cos(\pi \min(1, \frac{s - W}{\max(1, S - W)}))\big)
            & s \geq W,
        \end{cases}

    so the warm-up never uses a zero rate, the peak :math:`\eta` is reached at step :math:`W` and :math:`\eta_{\min}`
    at step :math:`S` (after the last step), where it stays.
    """
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, min_lr: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :func:`warmup_cosine_lr` (``scheduler.step()`` once per optimiser step); the peak of
    every parameter group is its initial ``lr`` and ``min_lr`` is relative to the first group's.

    :raises ValueError: ``total_steps < 1``, ``warmup_steps < 0``, a first group's ``lr`` that is not positive, or a
        ``min_lr`` outside ``[0, lr]`` (the "decay" would rise) or not finite.

    .. note:: O(1) per step.
    """
    check_int("total_steps", total_steps)
    check_int("warmup_steps", warmup_steps, minimum=0)
    where = "warmup_cosine_schedule"
    peak = check_float(
        "the optimiser's lr (the peak)", optimizer.param_groups[0]["lr"], 0.0, strict_minimum=True, where=where
    )
    ratio = check_float("min_lr", min_lr, 0.0, peak, where=where) / peak

    def factor(step: int) -> float:
        return warmup_cosine_lr(step, total_steps, warmup_steps, 1.0, ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
