"""`overnight demo` works in a scratch repository of its own: started from a checkout, it
leaves no branch, worktree or file in it, runs again, and `make clean` removes what it made
(its scratch folder in the temp folder included, when the step user could not enter the
checkout)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import OVERNIGHT, ROOT
from tests.repos import sh

OUTCOMES = (
    "demo: greeting: finished_verified (as expected)",
    "demo: fix-add: finished_verified (as expected)",
    "demo: hangs-once: finished_verified (as expected)",
    "demo: never-done: halted_at_call_ceiling (as expected)",
)


@contextlib.contextmanager
def folder(mode: int) -> Iterator[Path]:
    """A fresh folder of ``mode`` in the temp folder (tmp_path's parents are private)."""
    path = Path(tempfile.mkdtemp(prefix="overnight-test-clone-"))
    path.chmod(mode)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def checkout(parent: Path) -> Path:
    """A git repository standing for the user's clone, .overnight/ ignored as in this one."""
    repo = parent / "clone"
    repo.mkdir(mode=0o755)
    repo.chmod(0o755)
    (repo / ".gitignore").write_text(".overnight/\n")
    (repo / "README.md").write_text("a clone\n")
    sh(repo, "init", "-q", "-b", "main")
    sh(repo, "add", ".")
    sh(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    return repo


def demo(cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERNIGHT_")}
    return subprocess.run(
        [OVERNIGHT, "demo"], cwd=cwd, env=env, capture_output=True, text=True, timeout=170
    )


def clean(repo: Path) -> None:
    """The checkout is as it was: one branch, one worktree, nothing untracked or changed."""
    assert sh(repo, "status", "--porcelain").strip() == ""
    assert sh(repo, "branch", "--format=%(refname:short)").split() == ["main"]
    listed = sh(repo, "worktree", "list", "--porcelain").splitlines()
    assert [line for line in listed if line.startswith("worktree ")] == [f"worktree {repo}"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_demo_runs_twice_from_a_checkout_others_can_enter_and_leaves_it_clean() -> None:
    with folder(0o755) as parent:
        repo = checkout(parent)
        for _ in range(2):
            proc = demo(repo)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            for line in OUTCOMES:
                assert line in proc.stdout
            clean(repo)
        nights = sorted((repo / ".overnight" / "demo").iterdir())
        assert len(nights) == 2
        for night in nights:  # its repository, with the tasks' branches, is the night's own
            branches = sh(night / "repo", "branch", "--format=%(refname:short)").split()
            assert "overnight/greeting" in branches
            assert not (night / "scratch").exists()
        subprocess.run(["make", "-f", str(ROOT / "Makefile"), "clean"], cwd=repo, check=True)
        assert not (repo / ".overnight").exists()
        clean(repo)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_from_a_private_checkout_the_scratch_is_in_the_temp_folder_and_make_clean_removes_it() -> (
    None
):
    with folder(0o700) as parent:
        repo = checkout(parent)
        proc = demo(repo)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        for line in OUTCOMES:
            assert line in proc.stdout
        clean(repo)
        (night,) = (repo / ".overnight" / "demo").iterdir()
        link = night / "scratch"
        if os.geteuid() != 0:  # a plain user's steps run as itself: no need to move out
            assert not link.is_symlink()
            return
        scratch = Path(os.readlink(link))
        assert scratch.parent == Path(tempfile.gettempdir())
        assert (scratch / "repo" / ".git").is_dir()
        subprocess.run(["make", "-f", str(ROOT / "Makefile"), "clean"], cwd=repo, check=True)
        assert not scratch.exists()
        assert not (repo / ".overnight").exists()
