"""One task's workspace as the loop sees it: where its agent works, what overnight commits
after each agent step, and the fresh tree each verifier rule runs in.

Git work is in :mod:`workspace`, the verifier's tree in :mod:`checkout`; this module only
ties them to a task record.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from overnight.config.errors import OvernightError
from overnight.coordinator.workspace import checkout, remote, steprepo
from overnight.coordinator.workspace import worktree as workspace
from overnight.coordinator.workspace.checkout import Checked
from overnight.coordinator.workspace.rulepath import rule_path, rule_user
from overnight.coordinator.workspace.worktree import Base, Worktree
from overnight.worker.sandbox.stepuser import hand_over
from overnight.worker.supervise.procs import hostname

if TYPE_CHECKING:
    from overnight.coordinator.tasks.record import TaskRecord
    from overnight.coordinator.tasks.store import TaskStore
    from overnight.worker.sandbox.stepuser import StepUser

log = logging.getLogger("overnight.workspace")

SYNTHETIC_RULE = "protected-paths"


class WorkspaceError(OvernightError):
    """What an agent step left cannot be verified (the task pauses for a person)."""


@dataclass(frozen=True)
class AfterAgent:
    """What an agent step left: the commit (worktree mode), the protected paths it changed
    against the base, and the branch's diffstat against the base."""

    head: str | None
    changed: tuple[str, ...]
    diffstat: str


def verifier_env(
    env: dict[str, str], forbidden: list[str], user: StepUser | None
) -> dict[str, str]:
    """A verifier rule's added variables: the task's own, without ``PYTHON*``, and the
    worker's PATH without relative entries, any inside the task's trees, and any folder the
    rule's user (``user``, the step user; None: this process's) could write."""
    out = {k: v for k, v in env.items() if not k.upper().startswith("PYTHON")}
    out["PATH"] = rule_path(os.environ.get("PATH", ""), forbidden, rule_user(user))
    return out


class TaskSpace:
    """The workspace of one run of one task on this host."""

    def __init__(self, rec: TaskRecord, state: Path, namespace: str) -> None:
        self.task_id, self.run = rec.id, rec.run
        self.base: Base | None = rec.spec.base
        self.globs = list(rec.spec.protect)
        self.workdir = rec.spec.workdir
        self.state = state
        # A task from a git remote works in this host's cache of it, and pushes its branch.
        self.remote = remote.Remote.of(rec.spec, state) if rec.spec.repo else None
        self.pushed: str | None = None  # the remote's tip of the task's branch, as last seen
        if self.remote is not None and self.base is not None:
            self.base = remote.local_base(self.base, rec.spec, state)
            self.workdir = self.base.root
        self.namespace = namespace
        self.host = hostname()
        self.tree: Worktree | None = None
        self.owner: StepUser | None = None  # whom this run handed the worktree to
        self.git_cache: Path | None = None  # the base cache the tree's repository borrows from
        # The branch's last commit overnight knows (its audit trail is never rewound).
        self.last: str | None = rec.checkpoint.head or (self.base.sha if self.base else None)
        self.last_recorded = rec.checkpoint.head

    @property
    def git(self) -> bool:
        return self.base is not None and self.base.mode == workspace.WORKTREE

    def _frozen(self) -> Path:
        return frozen_path(self.state, self.namespace, self.task_id, self.run)

    def agent_cwd(self, user: StepUser | None) -> str:
        """Where the agent step runs: the task's worktree (made on first use), or the workdir."""
        if not self.git:
            return self.workdir
        assert self.base is not None and self.base.sha is not None
        if self.tree is None:
            path = workspace.worktree_path(self.state, self.namespace, self.task_id, self.run)
            branch = workspace.branch_name(self.task_id)
            fresh = not path.exists()
            if self.remote is not None:
                self.tree, self.pushed = remote.open_tree(
                    self.remote, self.base, self.last_recorded, self.task_id, path
                )
                fresh = True  # made again or kept: handed to the step user either way
            else:
                self.tree = workspace.open_worktree(self.base.root, self.base.sha, branch, path)
            if steprepo.is_git_link(self.tree.path):
                # Made just now: git's link to the user's repository becomes the task's own
                # repository (a tree kept from an earlier attempt has that already).
                self._own_repository(self.tree)
            # A tree an earlier attempt left is another uid's when each task has its own.
            if user is not None and (fresh or os.lstat(path).st_uid != user.uid):
                _chown_tree(path, user)
            self.owner = user
        return os.path.join(self.tree.path, self.base.subdir)

    def _own_repository(self, tree: Worktree) -> None:
        assert self.base is not None and self.base.sha is not None
        cache = steprepo.cache_path(self.state, self.base.root)
        steprepo.ensure_base(cache, self.base.root, self.base.sha)
        start = workspace.rev(tree.root, f"refs/heads/{tree.branch}")
        if start is None:
            raise workspace.GitError(f"branch {tree.branch} is gone")
        steprepo.make(tree.path, cache, tree.root, tree.branch, start)
        self.git_cache = cache

    def git_readable(self) -> tuple[str, ...]:
        """What a sandboxed step reads besides its tree for git to work there: the base
        cache its repository borrows objects from."""
        if self.tree is None or not self.git:
            return ()
        assert self.base is not None
        cache = self.git_cache or steprepo.cache_path(self.state, self.base.root)
        return (str(cache),) if cache.is_dir() else ()

    def missing_workdir(self) -> str | None:
        """Why the task's workdir is not in its worktree (None: it is, or there is none)."""
        if not self.git:
            return None
        assert self.base is not None and self.base.sha is not None
        absent = workspace.not_in_commit(self.base.root, self.base.sha, self.base.subdir)
        return None if absent is None else f"workdir {absent}"

    def agent_env(self) -> dict[str, str]:
        """Variables for the agent step: git trusts the task's worktree, whose repository
        folder belongs to overnight, not to the step user (else every git command the agent
        runs there fails with "dubious ownership"). Command-scope config, which git honours
        for safe.directory, unlike a repository's own."""
        if self.tree is None:
            return {}
        return {
            "GIT_CONFIG_COUNT": "1",
            "GIT_CONFIG_KEY_0": "safe.directory",
            "GIT_CONFIG_VALUE_0": self.tree.path,
        }

    def lock(self, lease: str) -> None:
        if self.tree is not None:
            workspace.lock(self.tree, workspace.lock_reason(self.task_id, self.host, lease))

    def unlock(self) -> None:
        if self.tree is not None:
            workspace.unlock(self.tree)

    def after_agent(self, turn: int, outcome: str) -> AfterAgent:
        """Commit (or freeze) what the agent step left, once its processes are gone."""
        assert self.base is not None
        if self.git:
            assert self.tree is not None and self.base.sha is not None
            message = workspace.commit_message(self.task_id, turn, outcome)
            sha = workspace.commit_step(self.tree, message, keep=self.last)
            self.last = sha
            if self.remote is not None:  # overnight's push, outside the step and its sandbox
                remote.push(self.remote, self.task_id, sha, self.pushed)
                self.pushed = sha
            changed = checkout.commit_changes(self.base, self.globs, sha)
            stat = workspace.diffstat(self.base.root, self.base.sha, sha)
            return AfterAgent(sha, tuple(changed), stat)
        checkout.freeze(self.base, self._frozen())
        return AfterAgent(
            None, tuple(checkout.snapshot_changes(self.base, self.globs, self._frozen())), ""
        )

    @contextlib.contextmanager
    def verifier_tree(self, head: str | None, user: StepUser | None) -> Iterator[Checked]:
        """A fresh tree for one rule: a checkout of ``head``, or a copy of the frozen tree;
        ``user``'s (the step user the rule runs as), if one is given."""
        assert self.base is not None
        scratch = self.state / "checkouts" / self.namespace
        frozen = None
        if not self.git:
            frozen = self._frozen()
            if not frozen.exists():  # the worker that froze it died: freeze what is there now
                checkout.freeze(self.base, frozen)
        commit = head if self.git else None
        if self.git and commit is None:
            commit = self.base.sha
        if self.remote is not None and not remote.has_all(self.remote.cache, [commit]):
            remote.sync(self.remote, self.base, self.task_id)  # a turn another host pushed
        owner = (user.uid, user.gid) if user is not None else None
        with checkout.prepared(
            self.base, self.globs, scratch, commit=commit, frozen=frozen, owner=owner
        ) as c:
            yield c

    def forbidden(self) -> list[str]:
        """The folders a verifier's PATH must not reach into."""
        out = [self.workdir]
        if self.base is not None:
            out.append(self.base.root)
        if self.tree is not None:
            out.append(self.tree.path)
        return out

    def close(self) -> None:
        """The task's run here is over: unlock its worktree, drop its frozen copy, and take
        back the worktree it handed to the step user (with a uid per task, that uid's next
        task must not own it)."""
        with contextlib.suppress(workspace.GitError, OSError):
            self.unlock()
        if self.tree is not None and self.owner is not None:
            with contextlib.suppress(OSError):
                hand_over(self.tree.path, os.geteuid(), os.getegid())
        frozen = self._frozen()
        if frozen.exists():
            checkout.remove_tree(frozen)


def _chown_tree(path: Path, user: StepUser) -> None:
    """Hand a worktree to the step user, closed to every other uid (its ``.git`` file too:
    overnight never trusts it)."""
    hand_over(path, user.uid, user.gid)
    os.chmod(path, 0o700)


def rule_argv(argv: list[str], base: Base | None, tree: Checked) -> list[str]:
    if base is None:
        return argv
    return checkout.rewrite_argv(argv, base.root, tree.root)


__all__ = [
    "SYNTHETIC_RULE",
    "AfterAgent",
    "TaskSpace",
    "WorkspaceError",
    "frozen_path",
    "prune",
    "rule_argv",
    "verifier_env",
]


def frozen_path(state: Path, namespace: str, task_id: str, run: str) -> Path:
    """Where an in-place task's tree is kept as its last agent step left it."""
    return state / "frozen" / namespace / f"{task_id}-{run}"


def prune(store: TaskStore, state: Path) -> list[str]:
    """Remove the worktrees of tasks that ended (their branches stay); a locked worktree, one
    with uncommitted changes, or one of a live task is left. Returns one line per worktree."""
    from overnight.coordinator.tasks.states import LIVE

    lines = []
    for rec in store.all():
        base = rec.spec.base
        frozen = frozen_path(state, store.keys.namespace, rec.id, rec.run)
        if rec.state not in LIVE and frozen.exists():  # left by a worker that died
            checkout.remove_tree(frozen)
            lines.append(f"{rec.id}: removed {frozen}")
        if base is None or base.mode != workspace.WORKTREE:
            continue
        base = remote.local_base(base, rec.spec, state)
        path = workspace.worktree_path(state, store.keys.namespace, rec.id, rec.run)
        if not path.exists():
            continue
        if rec.state in LIVE:
            lines.append(f"{rec.id}: kept {path}: the task is {rec.state}")
            continue
        listed = {w.path: w for w in workspace.list_worktrees(base.root)}
        entry = listed.get(str(path))
        if entry is not None and entry.locked:
            lines.append(f"{rec.id}: kept {path}: locked")
            continue
        try:
            workspace.remove_worktree(base.root, str(path))
        except workspace.GitError as exc:
            why = "uncommitted changes" if "modified or untracked" in str(exc) else str(exc)
            lines.append(f"{rec.id}: kept {path}: {why}")
            continue
        lines.append(f"{rec.id}: removed {path} (branch {workspace.branch_name(rec.id)} stays)")
    return lines
