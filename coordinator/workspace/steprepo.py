"""The git repository a task's steps use inside their sandbox: the task's own, never the user's.

A task's worktree shares its repository (every branch, every other task's commits) with the
user's checkout. Its steps get instead a repository of the task's own at ``<tree>/.git``:
its objects are the task's own commits and, through ``objects/info/alternates``, a cache of
base commits per repository on this host (``<state>/gitbases/<key>.git``) into which only
the bases tasks were submitted from are ever fetched, never a task's branch. So inside the
sandbox ``git status``, ``diff``, ``log``, ``add``, ``commit`` and ``branch`` work, and no
other task's commit is there to read (the cache is bound read-only; the user's repository is
not bound at all).

overnight's own git work on the tree (the commit after each turn, the verifier's checkout)
still names the worktree's admin folder in the user's repository explicitly
(:class:`~overnight.coordinator.workspace.git.Where`): git never lists a ``.git`` folder, and
nothing of overnight reads what a step wrote into its repository.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from overnight.coordinator.workspace.git import Reach, git, git_ok, locked_bare, rev

BASES = "refs/bases/"
# Who the commits a step makes inside are by (its HOME is empty: no identity of its own).
STEP_IDENTITY = ("overnight step", "step@overnight.localhost")
# The cache's files are read by every task uid of this host (through its bind).
SHARED_MODE = "0644"
# Fetches between folders of this host that overnight chose (never a path a step named).
LOCAL = Reach(config=("protocol.file.allow=always",))
FETCH = ("fetch", "-q", "--no-write-fetch-head", "--no-tags", "--no-recurse-submodules")


def cache_path(state: Path, root: str) -> Path:
    """The base cache of the repository at ``root`` on this host."""
    key = hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:16]
    return state / "gitbases" / f"{key}.git"


def ensure_base(cache: Path, root: str, sha: str) -> None:
    """Bring the base commit ``sha`` (and its history) from the repository at ``root`` into
    the cache, once, and keep it there (a ref of its own)."""
    with locked_bare(cache, f"--shared={SHARED_MODE}", "--template="):
        if rev(str(cache), f"{BASES}{sha}") == sha:
            return
        if rev(str(cache), sha) is None:
            git(*FETCH, root, f"+{sha}:{BASES}{sha}", cwd=str(cache), reach=LOCAL)
        git("update-ref", f"{BASES}{sha}", sha, cwd=str(cache))


def is_git_link(tree: str) -> bool:
    """True if ``tree/.git`` is the link file ``git worktree add`` leaves: a plain file of
    overnight's own (a step's uid owns everything of a tree handed to it)."""
    try:
        info = os.lstat(os.path.join(tree, ".git"))
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def make(tree: str, cache: Path, root: str, branch: str, start: str) -> None:
    """Give the worktree ``tree`` (overnight's, not yet handed to a step: see
    :func:`is_git_link`) a repository of its own at ``tree/.git`` in place of git's link,
    on ``branch`` at ``start``: the base from the cache, the task's own commits since
    fetched from ``root``. Raises :class:`GitError`."""
    dot = os.path.join(tree, ".git")
    os.unlink(dot)
    git("init", "-q", "--template=", f"--initial-branch={branch}", tree)
    alternates = Path(dot) / "objects" / "info" / "alternates"
    alternates.parent.mkdir(parents=True, exist_ok=True)
    alternates.write_text(f"{cache / 'objects'}\n")
    repo = ["--git-dir", dot]
    if not git_ok(*repo, "cat-file", "-e", f"{start}^{{commit}}"):
        git(*repo, *FETCH, "--update-head-ok", root, f"+{start}:refs/heads/{branch}", reach=LOCAL)
    git(*repo, "update-ref", f"refs/heads/{branch}", start)
    for key, value in (("user.name", STEP_IDENTITY[0]), ("user.email", STEP_IDENTITY[1])):
        git(*repo, "config", key, value)
    git(*repo, "--work-tree", tree, "read-tree", start)
