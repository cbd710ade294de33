"""The teaching notebooks: one source each, committed with outputs, and running at smoke size.

Every ``notebooks/NN_name.ipynb`` is paired with its source ``notebooks/NN_name.py`` (jupytext percent format, read
here with jupytext) and must hold the same cells. Each source is executed with nbclient in a temporary copy of the
notebooks' helpers (the committed files are never written), with ``GPATTN_NOTEBOOK_SIZE=smoke`` and a kernel of the
interpreter running the tests (``scripts/execute_notebooks.py:execute``).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
jupytext = pytest.importorskip("jupytext")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
CELL_TIMEOUT = 300  # seconds per cell; smoke-size cells take a few seconds


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runner = _load("execute_notebooks", ROOT / "scripts" / "execute_notebooks.py")
SOURCES = runner.notebook_sources(NOTEBOOK_DIR)
HELPERS = sorted(NOTEBOOK_DIR.glob("_*.py"))


def test_every_notebook_source_is_a_page_of_the_docs():
    pytest.importorskip("mkdocs")
    hook = _load("gpattn_docs_notebook_pages", ROOT / "docs" / "hooks" / "notebook_pages.py")
    assert list(hook.NOTEBOOKS) == [source.with_suffix(".ipynb").name for source in SOURCES]


def test_every_notebook_is_paired_with_its_source_and_every_python_file_is_a_source_or_helper():
    assert sorted(path.stem for path in NOTEBOOK_DIR.glob("*.ipynb")) == [source.stem for source in SOURCES]
    assert sorted(NOTEBOOK_DIR.glob("*.py")) == sorted(SOURCES + HELPERS), (
        "notebooks/ holds a .py that is neither a source (NN_name.py) nor a helper (_name.py)"
    )
    assert [helper.name for helper in HELPERS] == ["_notebook_size.py"]


@pytest.mark.parametrize("source", SOURCES, ids=lambda path: path.stem[:2])
def test_committed_notebook_matches_its_source_and_carries_outputs(source):
    committed = nbformat.read(source.with_suffix(".ipynb"), as_version=4)
    paired = jupytext.read(source)
    assert [(cell.cell_type, cell.source) for cell in committed.cells] == [
        (cell.cell_type, cell.source) for cell in paired.cells
    ], (
        f"{source.with_suffix('.ipynb').name} is out of date: make notebooks NOTEBOOKS=notebooks/{source.name} "
        f"(text-only edits: jupytext --sync notebooks/{source.name})"
    )
    assert committed.metadata["jupytext"]["formats"] == "ipynb,py:percent"
    code_cells = [cell for cell in committed.cells if cell.cell_type == "code"]
    unexecuted = [index for index, cell in enumerate(code_cells) if cell.execution_count is None or not cell.outputs]
    assert not unexecuted, f"{source.stem}: code cells {unexecuted} carry no outputs; execute the notebook"
    errors = [output for cell in code_cells for output in cell.outputs if output.output_type == "error"]
    assert not errors, f"{source.stem} was committed with an error output: {errors[0].ename}: {errors[0].evalue}"
    assert any("notebook size: full" in output.get("text", "") for cell in code_cells for output in cell.outputs)


@pytest.mark.parametrize("source", SOURCES, ids=lambda path: path.stem[:2])
def test_notebook_runs_at_smoke_size(source, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the kernel inherits it: temporary output folders land in tmp_path
    for helper in HELPERS:
        shutil.copy(helper, tmp_path / helper.name)
    notebook = runner.read_source(source)
    runner.execute(notebook, tmp_path, size="smoke", timeout=CELL_TIMEOUT)  # raises CellExecutionError on failure
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    assert any("notebook size: smoke" in output.get("text", "") for output in outputs)
    figures = [output for output in outputs if "image/png" in output.get("data", {})]
    assert figures, f"{source.stem} produced no inline figure"
