"""The code label of run files and tuned rows: the commit of a git checkout, with a hash of the uncommitted changes
that tells their states apart (checked on a repository the test makes, against ``git`` itself and ``hashlib``)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpattn import __version__
from gpattn.comparison import environment
from gpattn.comparison.environment import _git_commit, code_version

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(root: Path, *arguments: str) -> str:
    identity = ["-c", "user.name=test", "-c", "user.email=test@example.org", "-c", "commit.gpgsign=false"]
    identity += ["-c", f"core.hooksPath={os.devnull}"]  # no hook of the user's runs in the test's repository
    return subprocess.run(["git", *identity, *arguments], cwd=root, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch) -> Path:
    for variable in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR"):  # pytest run from a git hook
        monkeypatch.delenv(variable, raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "module.py").write_text("x = 1\n")
    (tmp_path / "data.txt").write_text("a\n")
    _git(tmp_path, "add", "module.py", "data.txt")
    _git(tmp_path, "commit", "-q", "--no-verify", "-m", "first")
    return tmp_path


def test_a_clean_checkout_is_its_commit_and_untracked_files_do_not_count(checkout):
    head = _git(checkout, "rev-parse", "HEAD").strip()
    assert _git_commit(checkout) == head
    (checkout / "notes.txt").write_text("not tracked\n")
    assert _git_commit(checkout) == head


def _fingerprint(root: Path, *names: str) -> str:
    """The label's hash written out: SHA-256 over each changed path and its contents (``file:`` and the bytes, or
    ``deleted``), each field preceded by its length in 8 little-endian bytes."""
    digest = hashlib.sha256()
    for name in sorted(names):
        path = root / name
        for field in (name.encode(), b"file:" + path.read_bytes() if path.exists() else b"deleted"):
            digest.update(len(field).to_bytes(8, "little") + field)
    return digest.hexdigest()[:12]


def test_uncommitted_states_get_their_own_hash_and_the_same_state_the_same_one(checkout):
    head = _git(checkout, "rev-parse", "HEAD").strip()
    (checkout / "module.py").write_text("x = 2\n")
    first = _git_commit(checkout)
    assert first == f"{head}+dirty.{_fingerprint(checkout, 'module.py')}"
    (checkout / "module.py").write_text("x = 3\n")
    second = _git_commit(checkout)
    assert second.startswith(f"{head}+dirty.") and second != first
    _git(checkout, "add", "module.py")  # staged or not, the files as they are
    assert _git_commit(checkout) == second
    (checkout / "module.py").write_text("x = 2\n")
    assert _git_commit(checkout) == first
    (checkout / "data.txt").unlink()
    assert _git_commit(checkout) == f"{head}+dirty.{_fingerprint(checkout, 'module.py', 'data.txt')}"
    _git(checkout, "checkout", "HEAD", "--", "module.py", "data.txt")  # back to the commit
    assert _git_commit(checkout) == head


def test_the_label_does_not_depend_on_the_users_git_configuration_or_a_calling_hook(checkout, tmp_path, monkeypatch):
    (checkout / "module.py").write_text("x = 2\n")
    label = _git_commit(checkout)
    for setting in ("diff.noprefix true", "diff.mnemonicPrefix true", "diff.algorithm patience", "status.short false"):
        _git(checkout, "config", *setting.split())
    (checkout / ".gitattributes").write_text("*.py diff=upper\n")  # a text conversion of every Python file
    _git(checkout, "config", "diff.upper.textconv", "tr a-z A-Z <")
    assert _git_commit(checkout) == label
    other = tmp_path / "other"
    other.mkdir()
    _git(other, "init", "-q")
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))  # what a git hook that runs gpattn would leave set
    assert _git_commit(checkout) == label


def test_links_and_submodules_are_told_apart_by_what_they_hold(checkout, tmp_path):
    (checkout / "link").symlink_to("module.py")
    _git(checkout, "add", "link")
    inner = tmp_path / "inner"
    inner.mkdir()
    _git(inner, "init", "-q")
    (inner / "a.txt").write_text("1\n")
    _git(inner, "add", "a.txt")
    _git(inner, "commit", "-q", "--no-verify", "-m", "inner")
    _git(checkout, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(inner), "sub")
    _git(checkout, "commit", "-q", "--no-verify", "-m", "link and submodule")
    head = _git(checkout, "rev-parse", "HEAD").strip()
    assert _git_commit(checkout) == head
    labels = set()
    (checkout / "link").unlink()
    (checkout / "link").symlink_to("data.txt")  # another target
    labels.add(_git_commit(checkout))
    (checkout / "link").unlink()
    (checkout / "link").symlink_to("module.py")
    assert _git_commit(checkout) == head
    (checkout / "sub" / "a.txt").write_text("2\n")  # the submodule's own uncommitted change
    labels.add(_git_commit(checkout))
    _git(checkout / "sub", "commit", "-q", "--no-verify", "-am", "two")  # the submodule at another commit
    labels.add(_git_commit(checkout))
    (checkout / "sub" / "a.txt").write_text("3\n")
    labels.add(_git_commit(checkout))
    assert len(labels) == 4 and all(label.startswith(f"{head}+dirty.") for label in labels)


def test_code_version_is_read_once_per_process(monkeypatch):
    labels = iter(["abc123+dirty.000000000001", "abc123+dirty.000000000002"])
    monkeypatch.setattr(environment, "_git_commit", lambda: next(labels))
    environment._code_version_of_this_process.cache_clear()
    try:
        first = code_version()
        assert first == {"gpattn": __version__, "git_commit": "abc123+dirty.000000000001"}
        first["git_commit"] = "changed by a caller"
        assert code_version() == {"gpattn": __version__, "git_commit": "abc123+dirty.000000000001"}
    finally:
        environment._code_version_of_this_process.cache_clear()


def test_outside_a_checkout_or_without_git_there_is_no_commit(tmp_path, checkout, monkeypatch):
    assert _git_commit(tmp_path / "nowhere") is None
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))
    assert _git_commit(checkout) is None


def test_damaged_run_files_and_environment_blocks_are_read_without_error(tmp_path):
    """A run file whose record is damaged (a list as its seed) is no run of a report, grouped under no code without
    one; an environment block whose entries are not dicts is shown as unknown."""
    import json

    from gpattn.comparison.environment import environment_lines, run_file_codes

    code = {"gpattn": "0.1", "git_commit": "a"}
    (tmp_path / "t-r-0.json").write_text(
        json.dumps({"code": code, "record": {"task": "t", "attention": "r", "seed": [0]}})
    )
    (tmp_path / "t-r-1.json").write_text(
        json.dumps({"code": code, "record": {"task": "t", "attention": "r", "seed": 1}})
    )
    assert run_file_codes(tmp_path, [("t", "r", 0), ("t", "r", 1)]) == [{"code": code, "runs": ["t-r-1"]}]
    assert run_file_codes(tmp_path) == [{"code": None, "runs": ["t-r-0"]}, {"code": code, "runs": ["t-r-1"]}]
    lines = environment_lines({"machine": None, "threads": [1], "python": "3.11"})
    assert lines[0] == "* machine: ?; CPU ?, ? cores" and lines[1].startswith("* python 3.11, torch ?")
    assert lines[2] == "* threads of the process that wrote the report: ? intra-op, ? inter-op"
