"""The documentation site builds in strict mode, documents every public name, renders the notebooks, and its code runs.

One ``mkdocs build --strict`` (any warning fails: broken links, missing pages, unresolved cross-references) into a
temporary folder serves every check on the built site. The ``python`` blocks of the quick start and of the user
guide are executed as written, except that a line ``steps = <n>`` (the length of a training loop) is set to
``steps = 3`` to keep the suite fast.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
import time
from html import unescape
from pathlib import Path
from types import SimpleNamespace

import pytest

import gpattn

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
MKDOCS = Path(sys.executable).parent / "mkdocs"
# every public subpackage of gpattn (a new one must get an API page and documented names)
SUBPACKAGES = tuple(
    sorted(module.name for module in pkgutil.iter_modules(gpattn.__path__) if module.ispkg and module.name[0] != "_")
)
NOTEBOOKS = (
    "01_asymmetric_kernels_and_ksvd.ipynb",
    "02_kernel_eigen_svgp_regression.ipynb",
    "03_attention_posteriors.ipynb",
    "04_calibration_comparison.ipynb",
    "05_timm_conversion.ipynb",
    "06_mnist1d.ipynb",
)
# reST that the Griffe extension (docs/hooks/griffe_rst.py) must have turned into Markdown before rendering
REST_LEFTOVERS = (
    ":param ",
    ":return:",
    ":ivar ",
    ":math:`",
    ":class:`",
    ":func:`",
    ":meth:`",
    ".. math::",
    ".. note::",
)
STEPS = re.compile(r"^(\s*)steps = \d+(?=\s|$)", flags=re.M)
BUILD_SECONDS: dict[str, float] = {}


def _load_hook():
    spec = importlib.util.spec_from_file_location("gpattn_docs_notebooks_hook", DOCS / "hooks" / "notebook_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.S | re.M)


def _run(block: str, name: str) -> dict:
    namespace: dict = {"__name__": f"docs_block_{name}"}
    exec(compile(STEPS.sub(r"\1steps = 3", block), name, "exec"), namespace)  # noqa: S102 (our own docs)
    return namespace


def _text(html: str) -> str:
    """The visible text of a page's article (tags, scripts and styles removed)."""
    article = html[html.index("<article") : html.index("</article>")]
    article = re.sub(r"<(script|style)\b.*?</\1>", " ", article, flags=re.S)
    return unescape(re.sub(r"<[^>]+>", " ", article))


# -- the build ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not MKDOCS.is_file():
        pytest.skip(
            f"mkdocs is not installed next to {sys.executable}: install the docs extra (pip install -e .[docs])"
        )
    out = tmp_path_factory.mktemp("site")
    env = {key: value for key, value in os.environ.items() if key != "GPATTN_DOCS_NOTEBOOKS"}
    env["NO_MKDOCS_2_WARNING"] = "1"
    start = time.perf_counter()
    result = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    BUILD_SECONDS["build"] = time.perf_counter() - start
    assert result.returncode == 0, (
        f"mkdocs build --strict failed after {BUILD_SECONDS['build']:.1f} s:\n{result.stdout[-6000:]}\n"
        f"{result.stderr[-6000:]}"
    )
    return out


def test_site_builds_strictly_and_quickly(site: Path) -> None:
    assert (site / "index.html").is_file() and (site / "search" / "search_index.json").is_file()
    print(f"mkdocs build --strict: {BUILD_SECONDS['build']:.1f} s")
    # about 8 s on 2 busy cores; a generous bound that still catches a build gone pathological
    assert BUILD_SECONDS["build"] < 120, f"the docs build took {BUILD_SECONDS['build']:.0f} s"


def test_every_page_of_the_nav_is_built(site: Path) -> None:
    for page in ("installation", "quickstart", "guide", "guide/attention", "guide/benchmarks", "api", "api/kernels"):
        assert (site / page / "index.html").is_file(), f"{page}/index.html was not built"


# -- the API reference -------------------------------------------------------------------------------------------------
def _anchor_ids(page: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', page.read_text()))


@pytest.mark.parametrize("subpackage", SUBPACKAGES)
def test_api_page_documents_every_public_name(site: Path, subpackage: str) -> None:
    module = importlib.import_module(f"gpattn.{subpackage}")
    ids = _anchor_ids(site / "api" / subpackage / "index.html")
    missing = []
    for name in module.__all__:
        value = getattr(module, name)
        # rendered under its public path, or (names exported lazily through __getattr__) under its defining module
        defining_module = (
            getattr(value, "__module__", None) if inspect.isroutine(value) or inspect.isclass(value) else None
        )
        candidates = {f"gpattn.{subpackage}.{name}", f"{defining_module}.{name}"}
        if not candidates & ids:
            missing.append(name)
    assert not missing, f"api/{subpackage}.md does not render {missing}"


@pytest.mark.parametrize("subpackage", SUBPACKAGES)
def test_api_page_has_no_leftover_rest(site: Path, subpackage: str) -> None:
    text = _text((site / "api" / subpackage / "index.html").read_text())
    for markup in REST_LEFTOVERS:
        assert markup not in text, (
            f"api/{subpackage}: unconverted reST {markup!r} near {text[text.index(markup) - 80 :][:200]!r}"
        )
    assert "MATH.md" not in text, f"api/{subpackage}: a reference to the design notes was not turned into a guide link"
    assert text.count("\\(") == text.count("\\)"), f"api/{subpackage}: unbalanced inline math"


# -- notebooks ---------------------------------------------------------------------------------------------------------
def test_nav_lists_the_four_notebooks() -> None:
    config = (REPO / "mkdocs.yml").read_text()
    for name in NOTEBOOKS:
        assert f"notebooks/{name}" in config, f"mkdocs.yml does not list notebooks/{name} in the nav"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_page_is_rendered(site: Path, name: str) -> None:
    page = site / "notebooks" / name.removesuffix(".ipynb") / "index.html"
    assert page.is_file(), f"notebooks/{name} was not rendered"
    html = page.read_text()
    notebook_path = REPO / "notebooks" / name
    if not notebook_path.is_file():
        assert _load_hook().PLACEHOLDER_TEXT in html
        pytest.skip(f"notebooks/{name} does not exist yet: the site shows a placeholder page in its place")
    notebook = json.loads(notebook_path.read_text())
    assert _load_hook().PLACEHOLDER_TEXT not in html
    # every markdown heading of the notebook appears on the page (nbconvert renders them as headings)
    headings = [
        line.lstrip("#").strip()
        for cell in notebook["cells"]
        if cell["cell_type"] == "markdown"
        for line in "".join(cell["source"]).splitlines()
        if line.startswith("#")
    ]
    text = _text(html)
    for heading in headings[:5]:
        words = re.findall(r"[A-Za-z][A-Za-z-]{2,}", re.sub(r"\$[^$]*\$|`[^`]*`", " ", heading))[:4]
        assert all(word in text for word in words), f"notebooks/{name}: heading {heading!r} is not on the page"
    outputs = sum(len(cell.get("outputs", [])) for cell in notebook["cells"] if cell["cell_type"] == "code")
    if outputs:
        assert 'class="jp-OutputArea' in html or "output_area" in html, f"notebooks/{name}: outputs are not shown"


def test_notebook_hook_adds_notebooks_and_placeholders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook with stand-in notebooks outside the repository: present ones are added as they are, missing ones as
    placeholders, and mkdocs-jupyter takes both as notebook pages."""
    mkdocs_jupyter = pytest.importorskip("mkdocs_jupyter.plugin", reason="install the docs extra")
    hook = _load_hook()
    folder = tmp_path / "notebooks"
    folder.mkdir()
    stand_in = {
        "cells": [{"cell_type": "markdown", "id": "a", "metadata": {}, "source": "# A stand-in"}],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (folder / NOTEBOOKS[0]).write_text(json.dumps(stand_in))
    monkeypatch.setenv(hook.ENVIRONMENT_VARIABLE, str(folder))
    config = SimpleNamespace(
        config_file_path=str(REPO / "mkdocs.yml"), site_dir=str(tmp_path / "site"), use_directory_urls=True
    )
    files = hook.on_files(hook.Files([]), config)
    plugin = mkdocs_jupyter.Plugin()
    plugin.load_config({"include": ["*.ipynb"]})
    try:
        by_uri = {file.src_uri: file for file in files}
        assert sorted(by_uri) == sorted(f"notebooks/{name}" for name in NOTEBOOKS)
        assert Path(by_uri[f"notebooks/{NOTEBOOKS[0]}"].abs_src_path) == folder / NOTEBOOKS[0]
        for name in NOTEBOOKS[1:]:
            placeholder = Path(by_uri[f"notebooks/{name}"].abs_src_path)
            assert hook.PLACEHOLDER_TEXT in placeholder.read_text()
        assert all(plugin.should_include(file) for file in files)
    finally:
        hook.on_post_build(config)
    assert not Path(by_uri[f"notebooks/{NOTEBOOKS[1]}"].abs_src_path).exists(), "placeholders were not cleaned up"


# -- the code on the pages ---------------------------------------------------------------------------------------------
QUICKSTART = DOCS / "quickstart.md"
GUIDE_BLOCKS = [
    (f"{page.relative_to(DOCS)}[{index}]", block)
    for page in sorted((DOCS / "guide").glob("*.md"))
    for index, block in enumerate(_python_blocks(page))
]


def test_quickstart_python_blocks_run() -> None:
    blocks = _python_blocks(QUICKSTART)
    assert len(blocks) == 3, "the quick start shows a GP model, a Transformer and a standalone attention layer"
    assert all(STEPS.search(block) for block in blocks[:2]), "each training loop is sized by a `steps = <n>` line"
    gp, transformer, layer = (_run(block, f"quickstart.md[{index}]") for index, block in enumerate(blocks))
    assert gp["posterior"].mean.shape == (200,) and gp["left"].mean.shape == (200,)
    assert type(gp["posterior"].lazy_covariance_matrix).__name__ == "LowRankRootAddedDiagLinearOperator"
    assert transformer["probabilities"].shape == (128, 2)
    assert transformer["mean"].shape == transformer["variance"].shape == (1, 8, 32)
    assert bool((transformer["variance"] >= 0).all())
    assert layer["sample"].shape == layer["mean"].shape == layer["causal"].shape == (2, 10, 32)
    assert layer["draws"].shape == (4, 2, 10, 32) and layer["kl"].dim() == 0


@pytest.mark.parametrize(("name", "block"), GUIDE_BLOCKS, ids=[name for name, _ in GUIDE_BLOCKS])
def test_guide_python_blocks_run(name: str, block: str) -> None:
    _run(block, name)
