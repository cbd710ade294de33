"""The code label of run files and tuned rows: the commit of a git checkout, with a hash of the uncommitted changes
that tells their states apart (checked on a repository the test makes, against ``git`` itself and ``hashlib``)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from gpattn.comparison.environment import _git_commit

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(root: Path, *arguments: str) -> str:
    identity = ["-c", "user.name=test", "-c", "user.email=test@example.org", "-c", "commit.gpgsign=false"]
    return subprocess.run(["git", *identity, *arguments], cwd=root, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    (tmp_path / "module.py").write_text("x = 1\n")
    _git(tmp_path, "add", "module.py")
    _git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def test_a_clean_checkout_is_its_commit_and_untracked_files_do_not_count(checkout):
    head = _git(checkout, "rev-parse", "HEAD").strip()
    assert _git_commit(checkout) == head
    (checkout / "notes.txt").write_text("not tracked\n")
    assert _git_commit(checkout) == head


def test_uncommitted_states_get_their_own_hash_and_the_same_state_the_same_one(checkout):
    head = _git(checkout, "rev-parse", "HEAD").strip()
    (checkout / "module.py").write_text("x = 2\n")
    first = _git_commit(checkout)
    command = ["git", "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff"]
    diff = subprocess.run(command, cwd=checkout, check=True, capture_output=True).stdout
    assert first == f"{head}+dirty.{hashlib.sha256(diff).hexdigest()[:12]}"
    (checkout / "module.py").write_text("x = 3\n")
    second = _git_commit(checkout)
    assert second.startswith(f"{head}+dirty.") and second != first
    _git(checkout, "add", "module.py")  # staged changes count as well, with the same diff against HEAD
    assert _git_commit(checkout) == second
    (checkout / "module.py").write_text("x = 2\n")
    _git(checkout, "add", "module.py")
    assert _git_commit(checkout) == first
    (checkout / "module.py").write_text("x = 1\n")  # back to the commit
    _git(checkout, "add", "module.py")
    assert _git_commit(checkout) == head


def test_outside_a_checkout_or_without_git_there_is_no_commit(tmp_path, checkout, monkeypatch):
    assert _git_commit(tmp_path / "nowhere") is None
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))
    assert _git_commit(checkout) is None
