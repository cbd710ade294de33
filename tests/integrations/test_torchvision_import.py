"""The torchvision import repair, with stand-ins for torchvision (its first import fails, or not), for
``torch.library.Library`` and for the module finder: the missing schemas are declared, the failed import's modules
dropped and the import retried, with a warning; anything else is left alone."""

from __future__ import annotations

import sys
import types

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


def test_import_torchvision_declares_the_missing_operators_and_retries(monkeypatch):
    attempts = _fake_torchvision(monkeypatch, RuntimeError("operator torchvision::nms does not exist"))
    with pytest.warns(UserWarning, match=r"torchvision 0.0-test cannot load its compiled operators.*nms"):
        torchvision_import.import_torchvision()
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
