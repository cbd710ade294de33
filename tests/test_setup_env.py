"""scripts/setup_env.sh in a sandbox: a copy of the script beside a fake ``.venv`` whose ``python`` runs the real
interpreter on a site folder holding a stand-in ``torch`` (it records that it was imported and prints torch's NumPy
complaint) and, as wanted, a stand-in torchvision's metadata; ``python -m pip`` only logs its arguments."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "setup_env.sh"


def _distribution(site: Path, name: str, version: str) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _sandbox(tmp_path: Path, torch_version: str, torchvision_version: str | None, up_to_date: bool) -> Path:
    root = tmp_path / "clone"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "scripts" / "setup_env.sh")
    (root / "pyproject.toml").write_text("[project]\nname = 'sandbox'\n")
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    # what the real torch does when imported before NumPy is installed
    (site / "torch" / "__init__.py").write_text(
        "import pathlib, sys\n"
        f"pathlib.Path({str(tmp_path / 'torch-imported')!r}).touch()\n"
        "print('UserWarning: Failed to initialize NumPy: No module named numpy', file=sys.stderr)\n"
        f"__version__ = {torch_version!r}\n"
    )
    _distribution(site, "torch", torch_version)
    if torchvision_version is not None:
        _distribution(site, "torchvision", torchvision_version)
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$@" >> {tmp_path / "pip.log"}; exit 0; fi\n'
        f'PYTHONPATH={site} exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    if up_to_date:
        time.sleep(0.01)
        (root / ".venv" / ".gpattn-installed").touch()
    return root


def _run(root: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "GPATTN_TORCH_SPEC")}
    return subprocess.run(
        ["bash", str(root / "scripts" / "setup_env.sh")], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.parametrize("up_to_date", [True, False])
def test_reads_the_torch_version_without_importing_torch(tmp_path, up_to_date):
    """Before: ``python -c 'import torch; ...'`` printed "Failed to initialize NumPy" on a fresh set-up (torch is
    installed before NumPy); now the version comes from the package metadata."""
    root = _sandbox(tmp_path, "2.13.0+cpu", "0.28.0+cpu", up_to_date)
    result = _run(root)
    assert result.returncode == 0, result.stderr
    assert "[setup_env] torch 2.13.0+cpu already installed" in result.stdout
    assert not (tmp_path / "torch-imported").exists() and "NumPy" not in result.stderr
    pip_calls = (tmp_path / "pip.log").read_text().splitlines() if not up_to_date else []
    assert len(pip_calls) == (0 if up_to_date else 1)
    assert "note:" not in result.stdout  # a matching torchvision


@pytest.mark.parametrize(
    ("torch_version", "torchvision_version", "note"),
    [("2.13.0+cpu", "0.28.0", True), ("2.13.0", "0.28.0", False), ("2.13.0+cpu", None, False)],
)
def test_says_when_torchvision_is_the_cuda_build_beside_a_cpu_torch(tmp_path, torch_version, torchvision_version, note):
    root = _sandbox(tmp_path, torch_version, torchvision_version, up_to_date=False)
    result = _run(root)
    assert result.returncode == 0, result.stderr
    message = f"note: torchvision {torchvision_version} (timm's dependency) is PyPI's build for the CUDA torch"
    assert (message in result.stdout) == note, result.stdout
    assert "--constraint /dev/fd/" in (tmp_path / "pip.log").read_text()
