"""MkDocs hook: render the repository's notebooks (``notebooks/*.ipynb``) without copying them into ``docs/``.

The notebooks live in ``notebooks/`` at the repository root. Each one's source is the jupytext percent-format script
beside it (``notebooks/NN_name.py``, the file people edit); ``make notebooks`` (``scripts/execute_notebooks.py``)
executes the sources at full size and writes the paired ``.ipynb`` with its outputs, and the test suite executes the
sources at smoke size. ``on_files`` adds each ``.ipynb`` to the site as ``notebooks/<name>.ipynb`` (the path the
``nav`` uses), before mkdocs-jupyter turns ``.ipynb`` files into pages (``execute: false``: the committed outputs are
shown; the ``.py`` sources are not pages).

A notebook listed in ``NOTEBOOKS`` that does not exist yet is replaced by a one-cell placeholder page saying so, so
that the strict build stays green while a notebook is being written; the docs test reports the missing notebook.

``GPATTN_DOCS_NOTEBOOKS`` points the hook at another folder named ``notebooks`` (the docs test uses it to build
with stand-in notebooks).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

NOTEBOOKS = (
    "01_asymmetric_kernels_and_ksvd.ipynb",
    "02_kernel_eigen_svgp_regression.ipynb",
    "03_attention_posteriors.ipynb",
    "04_calibration_comparison.ipynb",
    "05_timm_conversion.ipynb",
    "06_mnist1d.ipynb",
)
ENVIRONMENT_VARIABLE = "GPATTN_DOCS_NOTEBOOKS"
PLACEHOLDER_TEXT = "This notebook has not been written yet"


def notebook_folder(config: MkDocsConfig) -> Path:
    """``$GPATTN_DOCS_NOTEBOOKS``, or ``notebooks/`` next to ``mkdocs.yml``."""
    folder = os.environ.get(ENVIRONMENT_VARIABLE)
    return Path(folder) if folder else Path(config.config_file_path).resolve().parent / "notebooks"


_TEMPORARY: list[Path] = []


def _placeholder(name: str, folder: Path) -> Path:
    title = name.removesuffix(".ipynb").split("_", 1)[-1].replace("_", " ").capitalize()
    source = f"# {title}\n\n{PLACEHOLDER_TEXT}: `notebooks/{name}` is missing from this checkout."
    notebook = {
        "cells": [{"cell_type": "markdown", "id": "placeholder", "metadata": {}, "source": source}],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path = folder / name
    path.write_text(json.dumps(notebook))
    return path


def _notebook_file(path: Path, config: MkDocsConfig) -> File:
    # a File rooted at the folder above notebooks/ (mkdocs-jupyter reads notebooks through src_dir, so a
    # File.generated(..., abs_src_path=...) would not do)
    return File(
        f"notebooks/{path.name}",
        src_dir=str(path.parent.parent),
        dest_dir=config.site_dir,
        use_directory_urls=config.use_directory_urls,
    )


@event_priority(100)  # before mkdocs-jupyter's on_files, which wraps .ipynb files as pages
def on_files(files: Files, config: MkDocsConfig) -> Files:
    folder = notebook_folder(config)
    if folder.name != "notebooks":
        raise ValueError(f"${ENVIRONMENT_VARIABLE} must name a folder called 'notebooks', got {folder}")
    placeholders = None
    for name in NOTEBOOKS:
        path = folder / name
        if not path.is_file():
            if placeholders is None:
                placeholders = Path(tempfile.mkdtemp(prefix="gpattn-docs-")) / "notebooks"
                placeholders.mkdir()
                _TEMPORARY.append(placeholders.parent)
            path = _placeholder(name, placeholders)
        files.append(_notebook_file(path, config))
    return files


def on_post_build(config: MkDocsConfig) -> None:
    while _TEMPORARY:
        shutil.rmtree(_TEMPORARY.pop(), ignore_errors=True)
