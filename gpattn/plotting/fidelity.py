"""The KSVD-fidelity figure of a comparison: does a trained KEP-SVGP / Primal-Attention layer perform a KSVD of its
attention kernel on test sequences, compared with the same layer at initialisation and with random subspaces?

It reads :attr:`~gpattn.comparison.RunRecord.fidelity` (written by :func:`~gpattn.comparison.model_fidelity`, the
mean over test sequences of :func:`~gpattn.features.ksvd_fidelity` per layer and head, for the trained model, the
model at initialisation (``initial_*``) and random subspaces (``random_*``)) and draws one panel per quantity, one
group per (task, attention, layer) and in each group up to three columns of points: trained, initialisation and
random; every seed and head a point, the mean over them a bar. At an exact KSVD the relative objective, the largest
principal angle and the singular-value error are 0 and the cosines are 1 (dotted reference lines); the error of the
learned rank-:math:`s` kernel is bounded below by the Eckart-Young optimum of the same kernel, its size is that of the
truncation :math:`K_s` at a KSVD (near 0: the scores collapsed), and the kernel's effective rank is drawn against the
rank :math:`s` of the layer (black dashes).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ..comparison.fidelity import INITIAL_PREFIX
from ..comparison.records import RunRecord
from ..validation import InputTypeError
from ._records import DPI as _SAVE_DPI
from ._records import save

__all__ = ["FIDELITY_PANELS", "FIDELITY_VARIANTS", "fidelity_values", "plot_fidelity", "write_fidelity_figure"]

#: The quantities drawn, their axis label and the value of an exact KSVD (``None``: a reference of its own, drawn from
#: :data:`REFERENCES`).
FIDELITY_PANELS: tuple[tuple[str, str, float | None], ...] = (
    ("relative_objective", "relative KSVD objective |J| / terms", 0.0),
    ("left_cosine", "mean cosine, left subspace", 1.0),
    ("right_cosine", "mean cosine, right subspace", 1.0),
    ("max_angle", "largest principal angle (degrees)", 0.0),
    ("singular_value_error", "relative error of learned Lambda", 0.0),
    ("kernel_error", "||K - K_hat||_F / ||K||_F, K_hat = e Lambda^-1 r^T", None),
    ("kernel_scale", "size of the learned kernel ||K_hat||_F / ||K||_F", None),
    ("effective_rank", "effective rank of K", None),
)
#: The variants of every quantity: (field prefix, label, colour); a variant without values is not drawn.
FIDELITY_VARIANTS: tuple[tuple[str, str, str], ...] = (
    ("", "trained", "C0"),
    (INITIAL_PREFIX, "initialisation", "C1"),
    ("random_", "random subspaces", "0.55"),
)
#: The reference drawn as black dashes in a panel without an exact value: panel -> (field, label, square root); the
#: field takes the variant's prefix (the Eckart-Young optimum of the trained and of the initial kernel) except ``rank``,
#: and the dashes sit at the mean of its values, or at its square root (the size of :math:`K_s`, :math:`\sqrt{energy}`).
REFERENCES: dict[str, tuple[str, str, bool]] = {
    "kernel_error": ("optimal_error", "Eckart-Young optimum", False),
    "kernel_scale": ("energy", "size of K_s: sqrt(energy)", True),
    "effective_rank": ("rank", "rank s", False),
}
DPI = _SAVE_DPI  # the resolution of fidelity.png (written by _records.save)
OFFSETS = (-0.27, 0.0, 0.27)  # of the variants within a group


def _checked(records: Sequence[RunRecord]) -> list[RunRecord]:
    if isinstance(records, (str, bytes, dict)) or not isinstance(records, Sequence):
        raise InputTypeError(f"records must be a list of RunRecords, got {type(records).__name__}")
    for index, record in enumerate(records):
        if not isinstance(record, RunRecord):
            raise InputTypeError(f"record {index} is a {type(record).__name__}, expected a RunRecord")
    return list(records)


def fidelity_values(records: Sequence[RunRecord]) -> dict[tuple[str, str, str], dict[str, list[float]]]:
    """The fidelity values of the records that have them, pooled over seeds and heads, per layer.

    :param records: Comparison records (:func:`~gpattn.comparison.read_records` of a ``results.json``).
    :return: ``(task, attention, layer)`` -> field -> values, in record order; a layer without any value (no
        fields, or only empty ones) is left out; ``{}`` when no record has fidelity values.
    """
    groups: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    for record in _checked(records):
        for layer, fields in record.fidelity.items():
            group = groups.setdefault((record.task, record.attention, layer), {})
            for name, values in fields.items():
                group.setdefault(name, []).extend(float(value) for value in values)
    return {key: fields for key, fields in groups.items() if any(fields.values())}


def _finite(values: list[float]) -> np.ndarray:
    points = np.asarray(values, dtype=np.float64)
    return points[np.isfinite(points)]


def _draw_panel(axis: Axes, name: str, groups: list[dict[str, list[float]]], rng: np.random.Generator) -> None:
    reference = REFERENCES.get(name)
    left_out = 0  # NaN or infinite values (an undefined or diverged quantity): said in the panel, not dropped silently
    for position, values in enumerate(groups):
        for offset, (prefix, _, colour) in zip(OFFSETS, FIDELITY_VARIANTS, strict=True):
            points = _finite(values.get(prefix + name, []))
            left_out += len(values.get(prefix + name, [])) - points.size
            if points.size == 0:
                continue
            centre = position + offset
            axis.scatter(centre + rng.uniform(-0.07, 0.07, points.size), points, s=9, alpha=0.6, color=colour)
            axis.hlines(points.mean(), centre - 0.11, centre + 0.11, color=colour, lw=2.5)
            if reference is not None:
                field, _, root = reference
                bound = _finite(values.get(field if field == "rank" else prefix + field, []))
                if bound.size:
                    level = np.sqrt(bound.mean()) if root else bound.mean()
                    axis.hlines(level, centre - 0.13, centre + 0.13, color="black", lw=1.2, ls="--")
    if left_out:
        note = f"{left_out} non-finite value{'' if left_out == 1 else 's'} (NaN or inf) not drawn"
        axis.text(0.5, 0.97, note, transform=axis.transAxes, ha="center", va="top", fontsize=7, color="C3", gid="note")


def plot_fidelity(records: Sequence[RunRecord]) -> Figure:
    """One panel per quantity of :data:`FIDELITY_PANELS`, one group per (task, attention, layer) with fidelity data,
    in it a column per variant of :data:`FIDELITY_VARIANTS` that has values: a point per seed and head (jittered
    sideways), a bar at their mean, a dotted line at the exact-KSVD value and black dashes at the reference of
    :data:`REFERENCES`. NaN and infinite values (an undefined or diverged quantity) are not drawn; a panel with any
    says how many (a text with gid ``"note"``).

    :param records: Comparison records; those without fidelity (softmax, SGPA, ...) and layers without values are
        skipped.
    :return: The figure (2 x 4 panels, the legend below them).
    :raises ValueError: No record has fidelity values.
    """
    groups = fidelity_values(records)
    if not groups:
        raise ValueError(
            "plot_fidelity: no record has KSVD fidelity data (only KEP-SVGP and Primal-Attention runs have it; "
            "layers without values do not count)"
        )
    names = [f"{task}\n{attention}\n{layer}" for task, attention, layer in groups]
    columns = 4
    width = max(3.6, 1.1 * len(groups) + 1.2)
    figure, axes = plt.subplots(2, columns, figsize=(width * columns, 3.8 * 2), squeeze=False)
    rng = np.random.default_rng(0)  # the jitter only
    for axis, (name, label, exact) in zip(axes.ravel(), FIDELITY_PANELS, strict=True):
        _draw_panel(axis, name, list(groups.values()), rng)
        if exact is not None:
            axis.axhline(exact, color="grey", ls=":", lw=1)
        axis.set_xticks(range(len(names)), names, fontsize=7)
        axis.set_xlim(-0.6, len(names) - 0.4)
        axis.set_title(label, fontsize=9)
        axis.grid(alpha=0.3, axis="y")
    handles = [Line2D([], [], color=colour, marker="o", lw=2.5, label=label) for _, label, colour in FIDELITY_VARIANTS]
    handles.append(Line2D([], [], color="grey", ls=":", label="exact KSVD"))
    handles += [Line2D([], [], color="black", ls="--", label=label) for _, label, _ in REFERENCES.values()]
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
    figure.suptitle(
        "KSVD fidelity on test sequences: trained vs initialisation vs random subspaces (points: seeds x heads)"
    )
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    return figure


def write_fidelity_figure(records: Sequence[RunRecord], out_dir: str | Path) -> list[Path]:
    """Write ``fidelity.png`` (:func:`plot_fidelity`, PNG at 110 dpi) into ``out_dir`` when a record has fidelity
    data, through a temporary file and a rename as every comparison figure (a failed write leaves an earlier
    ``fidelity.png`` as it was); the figure is closed.

    :return: ``[path]``, or ``[]`` when no record has fidelity values (nothing written).
    """
    if not fidelity_values(records):
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [save(plot_fidelity(records), out_dir / "fidelity.png")]
