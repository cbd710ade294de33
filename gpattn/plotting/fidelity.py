"""The KSVD-fidelity figure of a comparison: does a trained KEP-SVGP / Primal-Attention layer perform a KSVD of its
attention kernel on test sequences?

It reads :attr:`~gpattn.comparison.RunRecord.fidelity` (written by :func:`~gpattn.comparison.model_fidelity`, the
mean over test sequences of :func:`~gpattn.features.ksvd_fidelity` per layer and head) and draws one panel per
quantity, one column of points per (task, attention): every seed, layer and head a point, the mean over them a bar.
At an exact KSVD the relative objective, the largest principal angle and the singular-value error are 0 and the
cosines are 1 (dotted reference lines); the energy (the share of :math:`\\|K\\|_F^2` in the top :math:`s` exact
singular values) is a property of the kernel, not of the learned scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ..comparison.records import RunRecord
from ..validation import InputTypeError

__all__ = ["FIDELITY_PANELS", "fidelity_values", "plot_fidelity", "write_fidelity_figure"]

#: The quantities drawn, their axis label and the value of an exact KSVD.
FIDELITY_PANELS: tuple[tuple[str, str, float], ...] = (
    ("relative_objective", "relative KSVD objective |J| / terms", 0.0),
    ("left_cosine", "mean cosine, left subspace", 1.0),
    ("right_cosine", "mean cosine, right subspace", 1.0),
    ("max_angle", "largest principal angle (degrees)", 0.0),
    ("singular_value_error", "relative error of learned Lambda", 0.0),
    ("energy", "top-s energy of the kernel", 1.0),
)
DPI = 110


def _checked(records: Sequence[RunRecord]) -> list[RunRecord]:
    if isinstance(records, (str, bytes, dict)) or not isinstance(records, Sequence):
        raise InputTypeError(f"records must be a list of RunRecords, got {type(records).__name__}")
    for index, record in enumerate(records):
        if not isinstance(record, RunRecord):
            raise InputTypeError(f"record {index} is a {type(record).__name__}, expected a RunRecord")
    return list(records)


def fidelity_values(records: Sequence[RunRecord]) -> dict[tuple[str, str], dict[str, list[float]]]:
    """The fidelity values of the records that have them, pooled over seeds, layers and heads.

    :param records: Comparison records (:func:`~gpattn.comparison.read_records` of a ``results.json``).
    :return: ``(task, attention)`` -> quantity -> values, in record order; ``{}`` when no record has fidelity.
    """
    groups: dict[tuple[str, str], dict[str, list[float]]] = {}
    for record in _checked(records):
        for fields in record.fidelity.values():
            group = groups.setdefault((record.task, record.attention), {})
            for name, values in fields.items():
                group.setdefault(name, []).extend(float(value) for value in values)
    return groups


def plot_fidelity(records: Sequence[RunRecord]) -> Figure:
    """One panel per quantity of :data:`FIDELITY_PANELS`, one column per (task, attention) with fidelity data:
    a point per seed, layer and head (jittered sideways), a bar at their mean, a dotted line at the exact-KSVD value.

    :param records: Comparison records; those without fidelity (softmax, SGPA, ...) are skipped.
    :return: The figure.
    :raises ValueError: No record has fidelity data.
    """
    groups = fidelity_values(records)
    if not groups:
        raise ValueError("no record has KSVD fidelity data (only KEP-SVGP and Primal-Attention runs have it)")
    names = [f"{task}\n{attention}" for task, attention in groups]
    figure, axes = plt.subplots(2, 3, figsize=(4.2 * 3, 3.4 * 2), squeeze=False)
    rng = np.random.default_rng(0)  # the jitter only
    for axis, (name, label, exact) in zip(axes.ravel(), FIDELITY_PANELS, strict=True):
        for position, values in enumerate(groups.values()):
            points = np.asarray(values.get(name, []), dtype=np.float64)
            points = points[np.isfinite(points)]
            if points.size == 0:
                continue
            jitter = rng.uniform(-0.15, 0.15, points.size)
            axis.scatter(position + jitter, points, s=10, alpha=0.6, color=f"C{position % 10}")
            axis.hlines(points.mean(), position - 0.3, position + 0.3, color="black", lw=2)
        axis.axhline(exact, color="grey", ls=":", lw=1)
        axis.set_xticks(range(len(names)), names, fontsize=7)
        axis.set_title(label, fontsize=9)
        axis.grid(alpha=0.3, axis="y")
    figure.suptitle("KSVD fidelity of the trained layers on test sequences (dotted: an exact KSVD)")
    figure.tight_layout()
    return figure


def write_fidelity_figure(records: Sequence[RunRecord], out_dir: str | Path) -> list[Path]:
    """Write ``fidelity.png`` (:func:`plot_fidelity`, 110 dpi) into ``out_dir`` when a record has fidelity data.

    :return: ``[path]``, or ``[]`` when no record has fidelity data (nothing written).
    """
    if not fidelity_values(records):
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figure = plot_fidelity(records)
    try:
        path = out_dir / "fidelity.png"
        figure.savefig(path, dpi=DPI)
    finally:
        plt.close(figure)
    return [path]
