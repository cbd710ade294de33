"""The teaching notebooks: in sync with their builder, committed with outputs, and running at smoke size.

Each notebook is executed with nbclient in a temporary copy of ``notebooks/`` (the committed files are never written),
with ``GPATTN_NOTEBOOK_SIZE=smoke`` and a kernel of the interpreter running the tests
(``scripts/build_notebooks.py:execute``).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
CELL_TIMEOUT = 300  # seconds per cell; smoke-size cells take a few seconds


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_notebooks", ROOT / "scripts" / "build_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


builder = _load_builder()
NAMES = list(builder.NOTEBOOKS)


def test_every_notebook_is_built_by_the_script():
    assert sorted(path.name for path in NOTEBOOK_DIR.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_matches_builder_and_carries_outputs(name):
    committed = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    built = builder.build_notebook(name)
    assert [(cell.cell_type, cell.source) for cell in committed.cells] == [
        (cell.cell_type, cell.source) for cell in built.cells
    ], f"{name} is out of date: run scripts/build_notebooks.py --execute"
    code_cells = [cell for cell in committed.cells if cell.cell_type == "code"]
    unexecuted = [index for index, cell in enumerate(code_cells) if cell.execution_count is None]
    assert not unexecuted, f"{name}: code cells {unexecuted} carry no outputs; execute the notebook before committing"
    errors = [output for cell in code_cells for output in cell.outputs if output.output_type == "error"]
    assert not errors, f"{name} was committed with an error output: {errors[0].ename}: {errors[0].evalue}"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_at_smoke_size(name, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the kernel inherits it: temporary output folders land in tmp_path
    for helper in NOTEBOOK_DIR.glob("*.py"):
        shutil.copy(helper, tmp_path / helper.name)
    notebook = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    builder.execute(notebook, tmp_path, size="smoke", timeout=CELL_TIMEOUT)  # raises CellExecutionError on failure
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    assert any("notebook size: smoke" in output.get("text", "") for output in outputs)
    figures = [output for output in outputs if "image/png" in output.get("data", {})]
    assert figures, f"{name} produced no inline figure"
