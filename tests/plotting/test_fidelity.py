"""The KSVD-fidelity figure, from records whose fidelity values are known."""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest

from gpattn.experiments import RunRecord
from gpattn.plotting import plot_fidelity, write_fidelity_figure
from gpattn.plotting.fidelity import FIDELITY_PANELS, fidelity_values

TEST = dict(accuracy=0.9, confidence=0.85, nll=0.3, ece=0.05, mce=0.2, brier=0.15, aurc=0.02, eaurc=0.01,
            auroc=0.8, fpr95=0.6)  # fmt: skip


def _record(attention: str, seed: int, fidelity: dict) -> RunRecord:
    return RunRecord.from_dict(
        {"task": "mnist1d", "attention": attention, "seed": seed, "metrics": {"test": TEST}, "fidelity": fidelity}
    )


def _fields(offset: float) -> dict[str, list[float]]:
    return {name: [offset + 0.1, offset + 0.2] for name, _, _ in FIDELITY_PANELS}  # two heads


@pytest.fixture
def records() -> list[RunRecord]:
    return [
        _record("kep_svgp", 0, {"layer_2": _fields(0.0)}),
        _record("kep_svgp", 1, {"layer_2": _fields(0.4)}),
        _record("primal", 0, {"layer_2": _fields(1.0)}),
        _record("softmax", 0, {}),
    ]


def test_values_pool_seeds_layers_and_heads(records):
    values = fidelity_values(records)
    assert list(values) == [("mnist1d", "kep_svgp"), ("mnist1d", "primal")]  # softmax has none
    np.testing.assert_allclose(values[("mnist1d", "kep_svgp")]["energy"], [0.1, 0.2, 0.5, 0.6])


def test_figure_draws_every_point_and_the_mean(records):
    assert matplotlib.get_backend().lower() == "agg"
    figure = plot_fidelity(records)
    try:
        axes = figure.axes
        assert [axis.get_title() for axis in axes] == [label for _, label, _ in FIDELITY_PANELS]
        first = axes[0]
        points = np.concatenate([collection.get_offsets()[:, 1] for collection in first.collections[:1]])
        np.testing.assert_allclose(np.sort(points), [0.1, 0.2, 0.5, 0.6])  # kep_svgp: 2 seeds x 2 heads
        means = sorted(line.get_segments()[0][0][1] for line in first.collections if hasattr(line, "get_segments"))
        np.testing.assert_allclose(means, [0.35, 1.15])  # the bars at the means of kep_svgp and primal
        assert [tick.get_text() for tick in first.get_xticklabels()] == ["mnist1d\nkep_svgp", "mnist1d\nprimal"]
    finally:
        plt.close(figure)


def test_write_only_with_data(records, tmp_path):
    (path,) = write_fidelity_figure(records, tmp_path)
    assert path.name == "fidelity.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_fidelity_figure(records[3:], tmp_path / "none") == [] and not (tmp_path / "none").exists()
    with pytest.raises(ValueError, match="no record has KSVD fidelity"):
        plot_fidelity(records[3:])
    with pytest.raises(TypeError, match="RunRecord"):
        plot_fidelity([{"task": "mnist1d"}])
