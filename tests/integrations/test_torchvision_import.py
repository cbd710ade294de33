"""The torchvision import repair, with stand-ins for torchvision (its first import fails, or not), for
``torch.library.Library`` and for the module finder: the missing schemas are declared, the failed import's modules
dropped and the import retried, logged but without a warning; anything else is left alone."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

from gpattn.integrations import torchvision_import


class _FakeLibrary:
    instances: list[_FakeLibrary] = []

    def __init__(self, namespace: str, kind: str):
        self.namespace, self.kind, self.schemas = namespace, kind, []
        _FakeLibrary.instances.append(self)

    def define(self, schema: str) -> None:
        self.schemas.append(schema)


def _fake_torchvision(monkeypatch, failure: Exception | None):
    """torchvision stand-in: its first import fails with ``failure`` (after leaving a half-imported submodule)."""
    attempts = []

    def import_module(name: str):
        attempts.append(name)
        if failure is not None and len(attempts) == 1:
            sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
            raise failure
        sys.modules["torchvision"] = types.SimpleNamespace(__version__="0.0-test")
        return sys.modules["torchvision"]

    for name in [name for name in sys.modules if name.split(".")[0] == "torchvision"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(torchvision_import.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torchvision_import.importlib, "import_module", import_module)
    monkeypatch.setattr(torchvision_import.torch.library, "Library", _FakeLibrary)
    monkeypatch.setattr(torchvision_import, "_LIBRARIES", [])
    _FakeLibrary.instances.clear()
    return attempts


def test_import_torchvision_declares_the_missing_operators_and_retries(monkeypatch, caplog):
    attempts = _fake_torchvision(monkeypatch, RuntimeError("operator torchvision::nms does not exist"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: nothing gpattn does needs the compiled operators
        with caplog.at_level(logging.INFO, logger="gpattn.integrations.torchvision_import"):
            torchvision_import.import_torchvision()
    assert re.search(r"torchvision 0.0-test cannot load its compiled operators.*nms", caplog.text)
    assert attempts == ["torchvision", "torchvision"]
    (library,) = _FakeLibrary.instances
    assert (library.namespace, library.kind) == ("torchvision", "FRAGMENT")
    assert [schema.split("(")[0] for schema in library.schemas] == ["nms", "qnms"]
    assert "torchvision._meta_registrations" not in sys.modules  # the failed import's modules were dropped


def test_import_torchvision_leaves_a_working_torchvision_alone(monkeypatch):
    attempts = _fake_torchvision(monkeypatch, None)
    torchvision_import.import_torchvision()
    assert attempts == ["torchvision"] and not _FakeLibrary.instances
    torchvision_import.import_torchvision()  # already imported: nothing more
    assert attempts == ["torchvision"]


def test_import_torchvision_reraises_other_errors(monkeypatch):
    _fake_torchvision(monkeypatch, RuntimeError("something else"))
    with pytest.raises(RuntimeError, match="something else"):
        torchvision_import.import_torchvision()
    assert not _FakeLibrary.instances


def test_import_torchvision_without_torchvision_does_nothing(monkeypatch):
    attempts = _fake_torchvision(monkeypatch, None)
    monkeypatch.setattr(torchvision_import.importlib.util, "find_spec", lambda name: None)
    torchvision_import.import_torchvision()
    assert attempts == []


def test_importing_the_integrations_prints_nothing(tmp_path):
    """What a user sees (Python's default warning filters, a fresh interpreter): nothing, also where torchvision's
    compiled operators do not load (PyPI's CUDA torchvision beside a CPU torch; before: a UserWarning on every
    import of gpattn.integrations)."""
    import gpattn

    source_root = str(Path(gpattn.__file__).resolve().parents[1])  # the gpattn under test, not the working directory's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source_root, os.environ.get("PYTHONPATH")]))}
    script = "import gpattn.integrations, gpattn.integrations.timm, gpattn.integrations.huggingface"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == ""
