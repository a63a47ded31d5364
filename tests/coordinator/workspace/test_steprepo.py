"""The task's own repository in its worktree (``coordinator/workspace/steprepo.py``), with real
git: the base and the task's own commits are there, another branch of the user's repository
is not, and git works on it as on any repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

from overnight.coordinator.workspace import steprepo
from overnight.coordinator.workspace import worktree as workspace
from tests.repos import FIXED, make_repo, sh


def other_task_commit(repo: Path) -> str:
    """A commit on another task's branch of ``repo`` (HEAD stays where it was)."""
    sh(repo, "checkout", "-q", "-b", "overnight/other")
    (repo / "secret.txt").write_text("another task's work\n")
    sh(repo, "add", "secret.txt")
    sh(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "other")
    commit = sh(repo, "rev-parse", "HEAD").strip()
    sh(repo, "checkout", "-q", "-")
    return commit


def own(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=tree, capture_output=True, text=True, check=False)


def made(repo: Path, state: Path, path: Path, base: str, start_branch: str) -> Path:
    tree = workspace.open_worktree(str(repo), base, start_branch, path)
    assert steprepo.is_git_link(tree.path)
    cache = steprepo.cache_path(state, str(repo))
    steprepo.ensure_base(cache, str(repo), base)
    start = workspace.rev(str(repo), f"refs/heads/{start_branch}")
    assert start is not None
    steprepo.make(tree.path, cache, str(repo), start_branch, start)
    assert not steprepo.is_git_link(tree.path) and (path / ".git").is_dir()
    return path


def test_the_tree_has_its_base_and_not_another_tasks_commit(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    base = sh(repo, "rev-parse", "HEAD").strip()
    other = other_task_commit(repo)
    tree = made(repo, tmp_path / "state", tmp_path / "state" / "wt", base, "overnight/t")
    assert own(tree, "rev-parse", "HEAD").stdout.strip() == base
    assert own(tree, "status", "--porcelain").stdout == ""
    assert own(tree, "cat-file", "-e", other).returncode != 0  # the twin: the user's has it
    assert sh(repo, "cat-file", "-t", other).strip() == "commit"
    assert own(tree, "for-each-ref", "--format=%(refname)").stdout.split() == [
        "refs/heads/overnight/t"
    ]
    # git works on it as on any repository, as the step's own identity.
    (tree / "calc.py").write_text(FIXED)
    assert own(tree, "commit", "-qam", "fix").returncode == 0
    assert own(tree, "log", "-1", "--format=%an %s").stdout.strip() == "overnight step fix"
    # The cache holds the base only (one ref per base), and a second call changes nothing.
    cache = steprepo.cache_path(tmp_path / "state", str(repo))
    steprepo.ensure_base(cache, str(repo), base)
    refs = sh(cache, "for-each-ref", "--format=%(refname)").split()
    assert refs == [f"refs/bases/{base}"]
    assert subprocess.run(["git", "-C", str(cache), "cat-file", "-e", other]).returncode != 0


def test_a_tree_made_again_starts_at_the_tasks_last_turn(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    base = sh(repo, "rev-parse", "HEAD").strip()
    other_task_commit(repo)
    state = tmp_path / "state"
    path = state / "wt"
    wt = workspace.open_worktree(str(repo), base, "overnight/t", path)
    (path / "calc.py").write_text(FIXED)
    turn = workspace.commit_step(wt, "turn 1")
    workspace.drop_worktree(str(repo), str(path))  # its host is gone
    tree = made(repo, state, path, base, "overnight/t")
    assert own(tree, "rev-parse", "HEAD").stdout.strip() == turn
    assert own(tree, "log", "--format=%s").stdout.split("\n")[0] == "turn 1"
    assert own(tree, "status", "--porcelain").stdout == ""
