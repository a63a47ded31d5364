"""Where a task works: its own branch in its own git worktree, or a snapshot-protected folder.

Three parts: the pure planning in :mod:`plan` (tested as tables), the thin git runner in
:mod:`git`, and here what a task's worktree goes through (made, locked, committed after an
agent step, listed, removed) and what ``submit`` makes of a task's workdir (:func:`resolve`).
The names of the first two are re-exported: callers reach the workspace through this module.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from overnight.config.folders import make_folders
from overnight.coordinator.workspace.git import (
    GIT_TIMEOUT,
    HARDENING,
    IDENTITY,
    Entry,
    GitError,
    Where,
    branch_exists,
    changed,
    common_dir,
    diff,
    diffstat,
    dirty,
    git,
    git_bytes,
    git_ok,
    head,
    not_in_commit,
    read_blobs,
    repo_root,
    rev,
    tree_entries,
    tree_files,
)
from overnight.coordinator.workspace.plan import (
    ALWAYS_PROTECTED_NAMES,
    ALWAYS_PROTECTED_SUFFIXES,
    BRANCH_PREFIX,
    IN_PLACE,
    WORKTREE,
    Base,
    Mode,
    always_protected,
    branch_name,
    clean_path,
    commit_message,
    glob_problem,
    glob_regex,
    is_protected,
    lock_reason,
    named_files,
    protected_of,
    redact,
    ref_problem,
    unmatched_globs,
    url_problem,
)
from overnight.coordinator.workspace.tree import tree_of
from overnight.worker.sandbox import nofollow

if TYPE_CHECKING:
    from overnight.config.settings import Settings

__all__ = [
    "ALWAYS_PROTECTED_NAMES",
    "ALWAYS_PROTECTED_SUFFIXES",
    "BRANCH_PREFIX",
    "GIT_TIMEOUT",
    "HARDENING",
    "IDENTITY",
    "IN_PLACE",
    "WORKTREE",
    "Base",
    "Entry",
    "GitError",
    "ListedWorktree",
    "Mode",
    "Resolved",
    "Where",
    "Worktree",
    "always_protected",
    "branch_exists",
    "branch_name",
    "changed",
    "clean_path",
    "commit_message",
    "commit_step",
    "common_dir",
    "diff",
    "diffstat",
    "dirty",
    "drop_worktree",
    "git",
    "git_bytes",
    "git_ok",
    "glob_problem",
    "glob_regex",
    "head",
    "is_protected",
    "list_worktrees",
    "lock",
    "lock_reason",
    "move_worktree",
    "named_files",
    "not_in_commit",
    "open_worktree",
    "protected_of",
    "read_blobs",
    "redact",
    "ref_problem",
    "remove_worktree",
    "reopen_worktree",
    "repo_root",
    "resolve",
    "rev",
    "state_dir",
    "tree_entries",
    "tree_files",
    "unlock",
    "unmatched_globs",
    "url_problem",
    "worktree_path",
]


# --- a task's worktree ------------------------------------------------------------------------


@dataclass(frozen=True)
class Worktree:
    """A task's worktree: the repository it belongs to, its folder, its admin folder."""

    root: str
    path: str
    git_dir: str
    branch: str


def worktree_path(state_dir: Path, namespace: str, task_id: str, run: str) -> Path:
    return state_dir / "worktrees" / namespace / f"{task_id}-{run}"


def _admin_dir(root: str, path: str) -> str | None:
    """The admin folder of the worktree at ``path``, found from the repository's side (the
    worktree's own ``.git`` file is the agent's to rewrite)."""
    admin = Path(common_dir(root)) / "worktrees"
    want = os.path.realpath(os.path.join(path, ".git"))
    if not admin.is_dir():
        return None
    for entry in admin.iterdir():
        try:
            text = (entry / "gitdir").read_text().strip()
        except OSError:
            continue
        if os.path.realpath(text) == want:
            return str(entry)
    return None


def open_worktree(root: str, base_sha: str, branch: str, path: Path) -> Worktree:
    """The task's worktree at ``path``: made on a new branch from ``base_sha`` the first
    time, found again after a worker died, or made again on the task's branch where its
    worker's host is gone (``submit`` refuses an id whose branch exists, so an existing
    branch that grew from the base is this task's). Raises :class:`GitError` otherwise."""
    if not path.exists():
        make_folders(path.parent, 0o711)  # a step user walks through
        if not branch_exists(root, branch):
            git("worktree", "add", "-b", branch, str(path), base_sha, cwd=root)
        elif git_ok("merge-base", "--is-ancestor", base_sha, f"refs/heads/{branch}", cwd=root):
            git("worktree", "prune", cwd=root)
            git("worktree", "add", str(path), branch, cwd=root)
        else:
            raise GitError(f"branch {branch} exists and does not grow from the task's base")
    admin = _admin_dir(root, str(path))
    if admin is None:
        raise GitError(f"{path} is not a worktree of {root}")
    return Worktree(root, str(path), admin, branch)


def reopen_worktree(root: str, start: str, branch: str, path: Path) -> Worktree:
    """The task's worktree at ``path`` on ``branch`` at commit ``start``: the one there if
    its branch is at ``start`` already (what a step of this host left in it stays), else
    made afresh there (the files there go without following a link; the branch is set to
    ``start``). For a task whose branch another host may have moved since."""
    if path.exists() or os.path.islink(path):
        at = rev(root, f"refs/heads/{branch}")
        if at != start or _admin_dir(root, str(path)) is None:
            git("worktree", "unlock", str(path), cwd=root, check=False)
            try:
                nofollow.remove_path(str(path))
            except OSError as exc:
                raise GitError(f"{path} could not be removed: {exc.strerror or exc}") from None
    if not path.exists():
        make_folders(path.parent, 0o711)  # a step user walks through
        git("worktree", "prune", cwd=root)
        git(
            "update-ref",
            "-m",
            "overnight: the task's tree starts here",
            f"refs/heads/{branch}",
            start,
            cwd=root,
        )
        git("worktree", "add", "--force", "--quiet", str(path), branch, cwd=root)
    admin = _admin_dir(root, str(path))
    if admin is None:
        raise GitError(f"{path} is not a worktree of {root}")
    return Worktree(root, str(path), admin, branch)


def lock(wt: Worktree, reason: str) -> None:
    git("worktree", "unlock", wt.path, cwd=wt.root, check=False)
    git("worktree", "lock", "--reason", reason, wt.path, cwd=wt.root)


def unlock(wt: Worktree) -> None:
    git("worktree", "unlock", wt.path, cwd=wt.root, check=False)


def commit_step(wt: Worktree, message: str, keep: str | None = None) -> str:
    """Commit what the tree holds now on the task's branch (ignored files stay out, the
    agent's own commits stay in); returns the new commit. ``keep`` is the branch's last
    known commit: an agent that rewound or rewrote the branch does not erase the audit
    trail (the branch goes back to ``keep`` first; the tree is committed on top)."""
    where = Where(wt.git_dir, wt.path)
    ref = f"refs/heads/{wt.branch}"
    git("symbolic-ref", "HEAD", ref, at=where)  # an agent that switched branch is brought back
    if keep is not None and not git_ok("merge-base", "--is-ancestor", keep, ref, at=where):
        git("update-ref", "-m", "overnight: the branch was rewritten; kept", ref, keep, at=where)
    parent = git("rev-parse", "--verify", f"{ref}^{{commit}}", at=where).strip()
    tree = _tree_of(wt)
    new = git("commit-tree", tree, "-p", parent, "-m", message, at=where).strip()
    git("update-ref", "-m", "overnight: commit after an agent step", ref, new, parent, at=where)
    git("read-tree", ref, at=where)  # the worktree's index follows its branch (no filter runs)
    return new


def _tree_of(wt: Worktree) -> str:
    return tree_of(Where(wt.git_dir, wt.path))


@dataclass(frozen=True)
class ListedWorktree:
    path: str
    head: str
    branch: str
    locked: bool


def list_worktrees(root: str) -> list[ListedWorktree]:
    out = git("worktree", "list", "--porcelain", "-z", cwd=root)
    items: list[ListedWorktree] = []
    fields: dict[str, str] = {}
    for token in [*out.split("\0"), ""]:
        if token:
            key, _, value = token.partition(" ")
            fields[key] = value
            continue
        if "worktree" in fields:
            branch = fields.get("branch", "").removeprefix("refs/heads/")
            items.append(
                ListedWorktree(
                    fields["worktree"], fields.get("HEAD", ""), branch, "locked" in fields
                )
            )
        fields = {}
    return items


def remove_worktree(root: str, path: str) -> None:
    """Remove a worktree that is not locked and holds no uncommitted change (its branch
    stays); raises :class:`GitError` otherwise. The files go without following a link the
    step's user left or swaps in (git's own removal walks by name), then git forgets it."""
    admin = _admin_dir(root, path)
    if admin is None:
        raise GitError(f"{path} is not a worktree of {root}")
    listed = {w.path: w for w in list_worktrees(root)}
    if path in listed and listed[path].locked:
        raise GitError(f"{path} is locked")
    status = git("status", "--porcelain", "--untracked-files=normal", at=Where(admin, path))
    if status.strip():
        raise GitError(f"{path} contains modified or untracked files")
    try:
        nofollow.remove_path(path)
    except OSError as exc:
        raise GitError(f"{path} could not be removed: {exc.strerror or exc}") from None
    git("worktree", "prune", cwd=root)


def move_worktree(root: str, path: str, target: str) -> None:
    """Move the worktree at ``path`` to ``target`` (a new folder beside it): the folder is
    renamed (nothing in it followed) and its admin folder told where it went. Not ``git
    worktree move``: that wants the tree's ``.git`` to be git's link, and it is the task's own
    repository."""
    admin = _admin_dir(root, path)
    if admin is None:
        raise GitError(f"{path} is not a worktree of {root}")
    git("worktree", "unlock", path, cwd=root, check=False)
    make_folders(Path(target).parent, 0o711)  # a step user walks through
    os.rename(path, target)
    (Path(admin) / "gitdir").write_text(f"{os.path.join(target, '.git')}\n")


def drop_worktree(root: str, path: str) -> None:
    """Remove the worktree at ``path`` whatever it holds (its branch stays): the files go
    without following a link, then git forgets it."""
    git("worktree", "unlock", path, cwd=root, check=False)
    try:
        nofollow.remove_path(path)
    except OSError as exc:
        raise GitError(f"{path} could not be removed: {exc.strerror or exc}") from None
    git("worktree", "prune", cwd=root)


# --- submit -----------------------------------------------------------------------------------


def state_dir(settings: Settings | None = None) -> Path:
    """overnight's own folder on this host: the ``state_dir`` setting (of ``settings``,
    default the process's), else ``/var/lib/overnight`` as root, else the XDG one."""
    if settings is None:
        from overnight.config.context import settings as current

        settings = current()
    configured = settings.state_dir
    if configured:
        return Path(configured).expanduser().resolve()
    if os.geteuid() == 0:  # a step user must be able to reach its worktree
        return Path("/var/lib/overnight")
    xdg = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return (Path(xdg) / "overnight").resolve()


@dataclass(frozen=True)
class Resolved:
    """What :func:`resolve` made of a task's workspace: the base, or problems as (key, text)
    pairs, and a warning for the person submitting."""

    base: Base | None
    problems: tuple[tuple[str, str], ...] = ()
    warning: str = ""


def resolve(
    workdir: Path,
    mode: Mode | None,
    globs: Sequence[str],
    argvs: Sequence[Sequence[str]],
    state: Path,
) -> Resolved:
    """The base of a task whose workdir is ``workdir``: its repository and HEAD commit in
    worktree mode (the default in a repository), a snapshot of the protected files otherwise."""
    from overnight.coordinator.workspace import checkout

    problems = [("protect", p) for g in globs if (p := glob_problem(g)) is not None]
    root = repo_root(str(workdir))
    mode = mode or (WORKTREE if root is not None else IN_PLACE)
    top = Path(root) if root is not None else workdir
    if state == top or top in state.parents:
        problems.append(("workspace", f"overnight's state folder {state} is inside {top}"))
    if mode == WORKTREE and root is None:
        text = f'"worktree" needs a git repository; {workdir} is not in one'
        return Resolved(None, (*problems, ("workspace", text)))
    subdir = os.path.relpath(workdir, top).replace(os.sep, "/")
    subdir = "" if subdir == "." else subdir
    warning = ""
    if mode == WORKTREE:
        assert root is not None
        sha = head(root)
        if sha is None:
            return Resolved(
                None, (*problems, ("workspace", f"the repository {root} has no commit"))
            )
        files = tree_files(root, sha)
        absent = not_in_commit(root, sha, subdir)
        if absent is not None:
            problems.append(("workdir", absent))
        if dirty(root):
            warning = (
                f"{root} has uncommitted changes; they are not part of the task's base {sha[:12]}"
            )
    else:
        files = list(checkout.walk_files(top))
    if not problems:
        problems += [
            ("protect", f"{g!r} matches no file in {top}") for g in unmatched_globs(globs, files)
        ]
    if problems:
        return Resolved(None, tuple(problems))
    named = tuple(named_files(argvs, str(top), subdir, set(files)))
    if mode == WORKTREE:
        base = Base(mode=mode, root=str(top), subdir=subdir, in_repo=True, sha=sha, named=named)
        return Resolved(base, warning=warning)
    store = state / "snapshots"
    snap = checkout.take_snapshot(top, globs, named, store)
    base = Base(
        mode=mode,
        root=str(top),
        subdir=subdir,
        in_repo=root is not None,
        named=named,
        snapshot=snap,
        snapshot_dir=str(store),
    )
    return Resolved(base)
