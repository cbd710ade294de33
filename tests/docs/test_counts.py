"""The documentation's counts and lists checked against the files they describe: the notebooks, the comparison's
figures, the default PyTorch build."""

from __future__ import annotations

import re
from pathlib import Path

from gpattn.comparison import RunRecord
from gpattn.plotting import write_comparison_figures
from gpattn.plotting.fidelity import FIDELITY_PANELS

ROOT = Path(__file__).resolve().parents[2]
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")


def _notebooks() -> list[str]:
    return sorted(path.name for path in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _counted_notebooks(text: str) -> list[str]:
    """Every number word that counts notebooks ("six notebooks", "Six executed teaching notebooks")."""
    pattern = rf"\b({'|'.join(NUMBERS)})\b(?:\s+[a-z]+){{0,2}}\s+notebooks\b"
    return [word.lower() for word in re.findall(pattern, text, flags=re.I)]


def test_the_readmes_count_the_notebooks_there_are() -> None:
    expected = NUMBERS[len(_notebooks())]
    for readme in ("README.md", "notebooks/README.md"):
        counts = _counted_notebooks((ROOT / readme).read_text())
        assert counts and set(counts) == {expected}, f"{readme} counts {counts} notebooks, there are {expected}"


def test_the_notebook_table_lists_every_notebook() -> None:
    table = (ROOT / "notebooks" / "README.md").read_text()
    listed = re.findall(r"^\| `(\d\d_\w+\.ipynb)`", table, flags=re.M)
    assert listed == _notebooks()


def _record_with_every_figure() -> RunRecord:
    test = dict.fromkeys(("accuracy", "confidence", "nll", "ece", "mce", "brier", "aurc", "eaurc", "auroc"), 0.5)
    shift = {"1": {"accuracy": 0.5, "nll": 1.0, "ece": 0.1, "brier": 0.5}}
    ood = dict.fromkeys(("auroc_max_prob", "auroc_entropy", "aupr_max_prob", "fpr95_max_prob"), 0.5)
    bins = {"confidence": [0.25, 0.75], "accuracy": [0.3, 0.7], "count": [10, 10]}
    return RunRecord.from_dict(
        {
            "task": "digits",
            "attention": "kep_svgp",
            "seed": 0,
            "metrics": {"test": {**test, "fpr95": 0.5}, "shift": {"gaussian_noise": shift}, "ood": {"noise": ood}},
            "reliability": bins,
            "ood_scores": {"in": [0.9, 0.8, 0.7], "noise": [0.5, 0.4, 0.6]},
            "spectra": {"layer_2": [[2.0, 1.0]]},
            "fidelity": {"layer_2": {name: [0.5] for name, _, _ in FIDELITY_PANELS}},
        }
    )


def test_the_quickstart_lists_every_file_gpattn_compare_writes(tmp_path) -> None:
    figures = [path.name for path in write_comparison_figures([_record_with_every_figure()], tmp_path)]
    assert figures and all(path.suffix == ".png" for path in tmp_path.iterdir())
    # the per-task figures (reliability_<task>.png, shift_<task>.png, ...) are listed once with <task>
    named = {re.sub(r"_(digits|mnist1d|pointer)\.png$", "_<task>.png", name) for name in figures}
    table = (ROOT / "docs" / "quickstart.md").read_text().split("## 3. `gpattn compare`", 1)[1]
    rows = set(re.findall(r"^\| `([^`]+)` \|", table, flags=re.M))
    assert named <= rows, f"figures missing from the quickstart's table: {sorted(named - rows)}"
    assert {"results.json", "results.csv", "table.md", "runs/<task>-<attention>-<seed>.json"} <= rows


def test_the_index_promises_the_build_the_set_up_installs() -> None:
    setup = (ROOT / "scripts" / "setup_env.sh").read_text()
    default = re.search(r"GPATTN_TORCH_SPEC:-([^}\"]+)", setup).group(1)
    index = (ROOT / "docs" / "index.md").read_text()
    card = " ".join(re.search(r"\*\*\[Installation\]\(installation\.md\)\*\*:(.*?)\n- ", index, flags=re.S)[1].split())
    if "+cpu" not in default:  # PyPI's build: the CUDA one on Linux
        assert "CPU build of PyTorch, in one command" not in card and "CPU index" in card
    assert default in (ROOT / "README.md").read_text() and default in (ROOT / "docs" / "installation.md").read_text()
