"""The KSVD-fidelity figure, from records whose fidelity values are known: trained, initialisation and random
subspaces per layer, and the references (exact KSVD, Eckart-Young optimum, rank s)."""

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


def _fields(offset: float, initial: bool = True) -> dict[str, list[float]]:
    # two heads; the initial model offset by 10, the random subspaces by 20 (cosines, angles, kernel error only)
    fields = {name: [offset + 0.1, offset + 0.2] for name, _, _ in FIDELITY_PANELS}
    fields |= {"optimal_error": [offset + 0.05, offset + 0.05], "energy": [0.64, 0.64], "rank": [5.0, 5.0]}
    if initial:
        fields |= {f"initial_{name}": [offset + 10.1, offset + 10.2] for name, _, _ in FIDELITY_PANELS}
        fields |= {"initial_optimal_error": [offset + 10.0, offset + 10.0], "initial_energy": [0.36, 0.36]}
        for name in ("left_cosine", "right_cosine", "max_angle", "kernel_error"):
            fields[f"random_{name}"] = [offset + 20.1, offset + 20.3]
    return fields


@pytest.fixture
def records() -> list[RunRecord]:
    return [
        _record("kep_svgp", 0, {"layer_2": _fields(0.0)}),
        _record("kep_svgp", 1, {"layer_2": _fields(0.4)}),
        _record("primal", 0, {"layer_1": _fields(1.0, initial=False), "layer_2": _fields(2.0, initial=False)}),
        _record("softmax", 0, {}),
    ]


def test_values_pool_seeds_and_heads_per_layer(records):
    values = fidelity_values(records)
    assert list(values) == [  # softmax has none; one group per layer
        ("mnist1d", "kep_svgp", "layer_2"),
        ("mnist1d", "primal", "layer_1"),
        ("mnist1d", "primal", "layer_2"),
    ]
    np.testing.assert_allclose(values[("mnist1d", "kep_svgp", "layer_2")]["kernel_error"], [0.1, 0.2, 0.5, 0.6])
    kep = values[("mnist1d", "kep_svgp", "layer_2")]
    np.testing.assert_allclose(kep["initial_kernel_error"], [10.1, 10.2, 10.5, 10.6])
    assert "initial_kernel_error" not in values[("mnist1d", "primal", "layer_1")]


def _means(axis) -> list[tuple[float, float]]:
    # (x centre, y) of every horizontal bar of a panel
    bars = []
    for collection in axis.collections:
        if hasattr(collection, "get_segments"):
            for (x0, y), (x1, _) in collection.get_segments():
                bars.append((round((x0 + x1) / 2, 6), round(y, 6)))
    return sorted(bars)


def test_figure_draws_trained_initial_and_random_per_layer(records):
    assert matplotlib.get_backend().lower() == "agg"
    figure = plot_fidelity(records)
    try:
        axes = figure.axes
        assert [axis.get_title() for axis in axes] == [label for _, label, _ in FIDELITY_PANELS]  # 8 panels
        cosine = axes[1]  # left_cosine: kep_svgp layer 2 has all three variants, primal only the trained values
        assert _means(cosine) == [(-0.27, 0.35), (0.0, 10.35), (0.27, 20.4), (0.73, 1.15), (1.73, 2.15)]
        points = np.sort(cosine.collections[0].get_offsets()[:, 1])
        np.testing.assert_allclose(points, [0.1, 0.2, 0.5, 0.6])  # kep_svgp trained: 2 seeds x 2 heads
        objective = axes[0]  # no random baseline of the objective
        assert _means(objective) == [(-0.27, 0.35), (0.0, 10.35), (0.73, 1.15), (1.73, 2.15)]
        kernel = axes[5]  # kernel_error: the bars, then the Eckart-Young optimum of the trained and initial kernels
        bars = _means(kernel)
        # the optima: means of 0.05, 0.45 (trained) and 10.0, 10.4 (initial); the random bar
        assert (-0.27, 0.25) in bars and (0.0, 10.2) in bars and (0.27, 20.4) in bars
        assert (-0.27, 0.35) in bars and (0.73, 1.05) in bars
        scale = axes[6]  # kernel_scale against the size of K_s, sqrt(energy): 0.8 trained, 0.6 initial
        assert (-0.27, 0.8) in _means(scale) and (0.0, 0.6) in _means(scale)
        rank = axes[7]  # effective_rank against s = 5 for every variant that is drawn
        assert sum(y == 5.0 for _, y in _means(rank)) == 4  # kep_svgp trained + initial, primal layers 1 and 2
        labels = [tick.get_text() for tick in cosine.get_xticklabels()]
        assert labels == ["mnist1d\nkep_svgp\nlayer_2", "mnist1d\nprimal\nlayer_1", "mnist1d\nprimal\nlayer_2"]
        (legend,) = figure.legends
        legend = [text.get_text() for text in legend.get_texts()]
        assert legend == [
            "trained",
            "initialisation",
            "random subspaces",
            "exact KSVD",
            "Eckart-Young optimum",
            "size of K_s: sqrt(energy)",
            "rank s",
        ]
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


def test_layers_without_values_are_no_fidelity_data(records, tmp_path):
    empty = [_record("kep_svgp", 2, {"layer_1": {}}), _record("primal", 1, {"layer_3": {"left_cosine": []}})]
    assert fidelity_values(empty) == {}
    open_figures = plt.get_fignums()  # (other tests of this worker may have left some open)
    with pytest.raises(ValueError, match="plot_fidelity: no record has KSVD fidelity data"):
        plot_fidelity(empty)  # it drew 8 empty panels
    assert plt.get_fignums() == open_figures
    assert write_fidelity_figure(empty, tmp_path / "none") == [] and not (tmp_path / "none").exists()
    assert fidelity_values([*records, *empty]) == fidelity_values(records)  # beside layers with values: left out
    figure = plot_fidelity([*records, *empty])
    try:
        labels = [tick.get_text() for tick in figure.axes[1].get_xticklabels()]
        assert labels == ["mnist1d\nkep_svgp\nlayer_2", "mnist1d\nprimal\nlayer_1", "mnist1d\nprimal\nlayer_2"]
    finally:
        plt.close(figure)


def test_write_goes_through_a_temporary_file_and_a_rename(records, tmp_path, monkeypatch):
    # write_comparison_figures promises every figure through a temporary file and a rename; fidelity.png was written in
    # place, so a failed write left half a file over the previous figure (and an open figure)
    from matplotlib.figure import Figure

    (tmp_path / "fidelity.png").write_bytes(b"previous figure")

    def failing_savefig(self, target, *args, **kwargs):
        with open(target, "wb") as stream:
            stream.write(b"\x89PNG half")
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(Figure, "savefig", failing_savefig)
        open_figures = plt.get_fignums()
        with pytest.raises(OSError, match="disk full"):
            write_fidelity_figure(records, tmp_path)
        assert plt.get_fignums() == open_figures
    assert (tmp_path / "fidelity.png").read_bytes() == b"previous figure"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["fidelity.png"]  # no temporary file left
    (path,) = write_fidelity_figure(records, tmp_path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fidelity.png"]


def test_non_finite_values_are_counted_in_their_panel(records):
    # a diverged (inf) relative objective and an undefined (NaN) kernel error were dropped without a word: the
    # panel showed the other head's value as if it were every value
    fields = _fields(0.0)
    fields["relative_objective"] = [float("inf"), 0.2]
    fields["kernel_error"] = [float("nan"), float("nan")]
    figure = plot_fidelity([_record("kep_svgp", 0, {"layer_2": fields})])
    try:
        notes = [[text.get_text() for text in axis.texts if text.get_gid() == "note"] for axis in figure.axes]
        assert notes[0] == ["1 non-finite value (NaN or inf) not drawn"]
        assert notes[5] == ["2 non-finite values (NaN or inf) not drawn"]
        assert all(note == [] for index, note in enumerate(notes) if index not in (0, 5))
        objective = figure.axes[0]
        np.testing.assert_allclose(objective.collections[0].get_offsets()[:, 1], [0.2])  # the finite head only
    finally:
        plt.close(figure)
