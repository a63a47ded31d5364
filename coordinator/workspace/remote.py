"""Tasks from a git remote: each host's cache of the repository, the task's tree made from
it, and overnight's push of the task's branch ``overnight/<task>`` after every turn.

A cache is a bare repository under the host's state folder (``repos/<name>``, one per
remote URL whatever its credentials), fetched and changed under a flock. The URL reaches
git only as command-scope config in git's own environment: never in an argv (another
user's ``ps`` would show it), never in a file (a sandboxed step sees the cache read-only,
and an unsandboxed one may read it). What overnight prints or raises of a remote has its
password redacted. The remote's refs land in the cache's own namespace (``refs/overnight/``)
so a fetch never touches a branch a worktree has checked out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from overnight.coordinator.workspace.git import (
    GitError,
    Reach,
    git,
    git_ok,
    git_proc,
    locked_bare,
    rev,
    tree_files,
)
from overnight.coordinator.workspace.plan import (
    WORKTREE,
    Base,
    Tips,
    branch_name,
    cache_name,
    glob_problem,
    named_files,
    redact,
    redact_text,
    start_of,
    unmatched_globs,
)
from overnight.coordinator.workspace.worktree import Resolved, Worktree, reopen_worktree

if TYPE_CHECKING:
    from overnight.coordinator.tasks.spec import TaskSpec

REMOTE = "overnight"  # the name the remote has in git's command-scope config, for one call
TASKS = "refs/overnight/tasks/"  # each task's branch as last fetched from or pushed to its remote
BASES = "refs/overnight/bases/"  # each remote task's base commit, kept


class PushRefused(GitError):
    """The remote refused the task's branch: it no longer holds the tip this host started
    from (another host moved the task), so this turn's outcome is unknown."""


@dataclass(frozen=True)
class Remote:
    """Where a remote task's repository comes from (``url``) and where its branch goes
    (``push``), with this host's cache of it."""

    url: str
    push: str
    cache: Path

    @classmethod
    def of(cls, spec: TaskSpec, state: Path) -> Remote:
        assert spec.repo is not None
        return cls(spec.repo, spec.push_to or spec.repo, cache_path(state, spec.repo))


def cache_path(state: Path, url: str) -> Path:
    return state / "repos" / cache_name(url)


def local_base(base: Base, spec: TaskSpec, state: Path) -> Base:
    """``base`` as this host works with it: a remote task's repository is this host's cache."""
    if spec.repo is None:
        return base
    return base.model_copy(update={"root": str(cache_path(state, spec.repo))})


def _reach(url: str) -> Reach:
    env = (
        ("GIT_CONFIG_COUNT", "1"),
        ("GIT_CONFIG_KEY_0", f"remote.{REMOTE}.url"),
        ("GIT_CONFIG_VALUE_0", url),
    )
    # A repository on this host's file system is allowed when named by the task (only),
    # never by a submodule; --no-recurse-submodules keeps those out anyway.
    return Reach(config=("protocol.file.allow=user",), env=env)


def _talk(url: str, *args: str, cwd: Path) -> str:
    """``git ARGS`` against the remote ``url``; an error says the URL without its password."""
    try:
        return git(*args, cwd=str(cwd), reach=_reach(url))
    except GitError as exc:
        raise GitError(redact_text(str(exc), [url])) from None


# --- submit -----------------------------------------------------------------------------------


def resolve_ref(url: str, ref: str | None, cache: Path) -> tuple[str, str]:
    """The full name and commit ``ref`` (default the remote's HEAD) names on the remote now
    (``git ls-remote``); raises :class:`GitError` naming what is missing."""
    want = ref or "HEAD"
    with locked_bare(cache):
        out = _talk(url, "ls-remote", "--symref", REMOTE, cwd=cache)
    refs: dict[str, str] = {}
    for line in out.splitlines():
        sha, _, name = line.partition("\t")
        if sha.startswith("ref: ") and name == "HEAD" and want == "HEAD":
            want = sha.removeprefix("ref: ")  # the branch the remote's HEAD names
        elif not sha.startswith("ref: "):
            refs[name] = sha
    for name in (want, f"refs/heads/{want}", f"refs/tags/{want}"):
        if name in refs:
            return name, refs.get(f"{name}^{{}}", refs[name])
    raise GitError(f"{redact(url)} has no ref {want!r}")


def fetch_base(remote: Remote, ref: str | None, sha: str) -> None:
    """Bring the base commit ``sha`` into the cache (fetched by the ref it was resolved from,
    or by itself where the ref has moved off it) and keep it there. Hold :func:`locked`."""
    if rev(str(remote.cache), sha) is None:
        if ref is not None:
            _talk(remote.url, *_fetch(f"+{ref}:{BASES}{sha}"), cwd=remote.cache)
        if rev(str(remote.cache), sha) is None:
            _talk(remote.url, *_fetch(f"+{sha}:{BASES}{sha}"), cwd=remote.cache)
    git("update-ref", f"{BASES}{sha}", sha, cwd=str(remote.cache))


def _fetch(*refspecs: str) -> list[str]:
    opts = ["-q", "--no-write-fetch-head", "--no-tags", "--no-recurse-submodules"]
    return ["fetch", *opts, REMOTE, *refspecs]


def fetch_task(remote: Remote, task_id: str) -> str | None:
    """The tip of ``overnight/<task>`` on the push remote, fetched into the cache (None: the
    remote has no such branch). Hold :func:`locked`."""
    ref = f"refs/heads/{branch_name(task_id)}"
    listed = _talk(remote.push, "ls-remote", REMOTE, ref, cwd=remote.cache)
    tip = next((line.split("\t")[0] for line in listed.splitlines() if line.endswith(ref)), None)
    if tip is None:
        git("update-ref", "-d", f"{TASKS}{task_id}", cwd=str(remote.cache), check=False)
        return None
    if rev(str(remote.cache), tip) is None:
        _talk(remote.push, *_fetch(f"+{ref}:{TASKS}{task_id}"), cwd=remote.cache)
    git("update-ref", f"{TASKS}{task_id}", tip, cwd=str(remote.cache))
    return tip


def sync(remote: Remote, base: Base, task_id: str) -> str | None:
    """The cache brought up to date with the task: its base, and its branch's tip on the
    push remote (returned; None where no turn was pushed)."""
    assert base.sha is not None
    with locked_bare(remote.cache):
        fetch_base(remote, base.ref, base.sha)
        return fetch_task(remote, task_id)


def has_all(cache: Path, commits: Sequence[str | None]) -> bool:
    return all(c is None or rev(str(cache), c) is not None for c in commits)


# --- a host's turns ---------------------------------------------------------------------------


def open_tree(
    remote: Remote, base: Base, head: str | None, task_id: str, path: Path
) -> tuple[Worktree, str | None]:
    """The task's worktree at ``path`` from this host's cache, on ``overnight/<task>`` at
    the remote's tip of it (a previous host's last pushed turn) or at the base; returns it
    and the remote tip it starts from (None: nothing was pushed yet). Raises
    :class:`GitError` when the remote's branch no longer holds the task's turns."""
    assert base.sha is not None
    branch = branch_name(task_id)
    with locked_bare(remote.cache):
        fetch_base(remote, base.ref, base.sha)
        tip = fetch_task(remote, task_id)
        root = str(remote.cache)
        tips = Tips(
            base.sha,
            head,
            tip,
            has_base=tip is not None and _contains(root, tip, base.sha),
            has_head=tip is not None and head is not None and _contains(root, tip, head),
        )
        start = start_of(tips, branch)
        if start.commit is None:
            raise GitError(start.problem or f"{branch}: no commit to start from")
        tree = reopen_worktree(root, start.commit, branch, path)
    return tree, tip


def _contains(root: str, tip: str, commit: str) -> bool:
    return git_ok("merge-base", "--is-ancestor", commit, tip, cwd=root)


def push(remote: Remote, task_id: str, new: str, old: str | None) -> None:
    """Push ``new`` to ``overnight/<task>`` on the push remote, only if the remote still has
    ``old`` there (None: no such branch): :class:`PushRefused` if it does not, :class:`GitError`
    if the push failed otherwise."""
    ref = f"refs/heads/{branch_name(task_id)}"
    argv = ["push", "--porcelain", "--no-verify", "--no-recurse-submodules"]
    argv += [f"--force-with-lease={ref}:{old or ''}", REMOTE, f"{new}:{ref}"]
    proc = git_proc(*argv, cwd=str(remote.cache), reach=_reach(remote.push))
    out = proc.stdout.decode("utf-8", "replace")
    err = proc.stderr.decode("utf-8", "replace")
    if proc.returncode == 0:
        git("update-ref", f"{TASKS}{task_id}", new, cwd=str(remote.cache))
        return
    said = redact_text(next((x for x in [*err.splitlines(), ""] if x.strip()), ""), [remote.push])
    where = f"{branch_name(task_id)} to {redact(remote.push)}"
    if any(line.startswith("!") and "\t[rejected]" in line for line in out.splitlines()):
        raise PushRefused(f"push of {where} refused: the remote moved it ({said})")
    raise GitError(f"push of {where} failed: {said or proc.returncode}")


# --- submit: the base ---------------------------------------------------------------------------


def resolve(spec: TaskSpec, state: Path) -> Resolved:
    """The base of a remote task: the commit its ``ref`` names on the remote now, fetched
    into this host's cache (its files checked against the protect globs and the rules)."""
    assert spec.repo is not None
    remote = Remote.of(spec, state)
    problems = [("protect", p) for g in spec.protect if (p := glob_problem(g)) is not None]
    try:
        full, sha = resolve_ref(spec.repo, spec.ref, remote.cache)
        with locked_bare(remote.cache):
            fetch_base(remote, full, sha)
    except (GitError, OSError) as exc:
        return Resolved(None, (*problems, ("ref" if spec.ref else "repo", str(exc))))
    root = str(remote.cache)
    files = tree_files(root, sha)
    if not problems:
        problems += [
            ("protect", f"{g!r} matches no file in {redact(spec.repo)} at {sha[:12]}")
            for g in unmatched_globs(spec.protect, files)
        ]
    if problems:
        return Resolved(None, tuple(problems))
    named = named_files([r.run for r in spec.verifier], root, "", set(files))
    base = Base(mode=WORKTREE, root=root, in_repo=True, sha=sha, named=tuple(named), ref=full)
    return Resolved(base)


def branch_pushed(spec: TaskSpec, task_id: str, state: Path) -> bool:
    """Whether the push remote already has ``overnight/<task>`` (an earlier run's)."""
    remote = Remote.of(spec, state)
    ref = f"refs/heads/{branch_name(task_id)}"
    with locked_bare(remote.cache):
        return bool(_talk(remote.push, "ls-remote", REMOTE, ref, cwd=remote.cache).strip())
