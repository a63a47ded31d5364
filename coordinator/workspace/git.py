"""The git runner: always an argv list through the system folders' ``git`` (never one a
step could have put on PATH), with an explicit ``--git-dir``/``--work-tree`` where the
agent's tree is involved (its ``.git`` file is the agent's to rewrite), hooks off, no
external diff or text conversion, no system or global config, overnight's own identity for
its commits; and the few questions overnight asks of a repository."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from overnight.config.errors import OvernightError
from overnight.config.folders import make_folders
from overnight.worker.sandbox.launch import SYSTEM_PATH

IDENTITY = ("overnight", "overnight@localhost")
GIT_TIMEOUT = 300.0
# Config that would run a program or sign with a key: off for every git call overnight makes.
HARDENING = (
    "core.hooksPath=/dev/null",
    "core.fsmonitor=false",
    "commit.gpgSign=false",
    "tag.gpgSign=false",
    "core.pager=cat",
    "protocol.file.allow=never",
    "gc.auto=0",
    "maintenance.auto=false",
)
# Commands that would run a repository's diff drivers: always without them.
NO_DRIVERS = {"diff": ("--no-ext-diff", "--no-textconv"), "log": ("--no-ext-diff", "--no-textconv")}
# The worker's own ways of reaching a task's remote (a prompt program, an ssh command, a CA):
# kept for the calls that talk to a remote, dropped from every other git call.
REMOTE_PASS = ("GIT_ASKPASS", "GIT_SSH", "GIT_SSH_COMMAND", "GIT_SSL_CAINFO", "GIT_SSL_CAPATH")


class GitError(OvernightError):
    """A git command failed; the message is its first line of stderr."""


@cache
def program() -> str:
    """The git overnight runs: the system folders' (``git`` from PATH only where they have
    none)."""
    return shutil.which("git", path=SYSTEM_PATH) or "git"


def _git_env(remote: bool = False) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GIT_") or (remote and k in REMOTE_PASS)
    }
    env.update(
        PATH=SYSTEM_PATH,  # what git itself starts (a helper, a filter's program)
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_TERMINAL_PROMPT="0",
        LC_ALL="C",
        GIT_AUTHOR_NAME=IDENTITY[0],
        GIT_AUTHOR_EMAIL=IDENTITY[1],
        GIT_COMMITTER_NAME=IDENTITY[0],
        GIT_COMMITTER_EMAIL=IDENTITY[1],
    )
    return env


@dataclass(frozen=True)
class Where:
    """A git call about a tree named explicitly (not found through its ``.git`` file)."""

    git_dir: str
    work_tree: str
    index: str | None = None


@dataclass(frozen=True)
class Reach:
    """A git call that talks to a remote: ``config`` added to the command line (after the
    hardening, so it wins), ``env`` (command-scope config such as the remote's URL, which
    then appears in no argv and no file), the worker's :data:`REMOTE_PASS` variables kept."""

    config: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def git(
    *args: str,
    cwd: str | None = None,
    at: Where | None = None,
    check: bool = True,
    reach: Reach | None = None,
) -> str:
    """Run ``git ARGS`` (argv, never a shell); returns stdout. Raises :class:`GitError`."""
    out = git_bytes(*args, cwd=cwd, at=at, check=check, reach=reach)
    return out.decode("utf-8", "surrogateescape")


def git_bytes(
    *args: str,
    cwd: str | None = None,
    at: Where | None = None,
    check: bool = True,
    data: bytes | None = None,
    pass_fds: Sequence[int] = (),
    reach: Reach | None = None,
) -> bytes:
    """:func:`git` with ``data`` on its stdin and its stdout as bytes (``pass_fds`` stay open
    in git, as ``/proc/self/fd/N``)."""
    proc = _run(args, cwd, at, data, pass_fds, reach)
    if check and proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        raise GitError(f"git {args[0] if args else ''}: {err[0] if err else proc.returncode}")
    return proc.stdout


def git_ok(*args: str, cwd: str | None = None, at: Where | None = None) -> bool:
    """True if ``git ARGS`` exits 0 (for the commands that answer by their exit code)."""
    return _run(args, cwd, at, None).returncode == 0


def git_proc(
    *args: str, cwd: str | None = None, reach: Reach | None = None
) -> subprocess.CompletedProcess[bytes]:
    """``git ARGS`` run to its end whatever its exit status (for a caller that reads its
    output on failure too, as a refused push's)."""
    return _run(args, cwd, None, None, (), reach)


def _run(
    args: Sequence[str],
    cwd: str | None,
    at: Where | None,
    data: bytes | None,
    pass_fds: Sequence[int] = (),
    reach: Reach | None = None,
) -> subprocess.CompletedProcess[bytes]:
    argv = [program()]
    for item in (*HARDENING, *(reach.config if reach is not None else ())):
        argv += ["-c", item]
    if cwd is not None:
        argv += ["-C", cwd]
    env = _git_env(remote=reach is not None)
    if reach is not None:
        env.update(reach.env)
    if at is not None:
        argv += [f"--git-dir={at.git_dir}", f"--work-tree={at.work_tree}"]
        if at.index is not None:
            env["GIT_INDEX_FILE"] = at.index
    if args and args[0] in NO_DRIVERS:
        args = [args[0], *NO_DRIVERS[args[0]], *args[1:]]
    return subprocess.run(
        [*argv, *args],
        env=env,
        input=data if data is not None else b"",
        capture_output=True,
        timeout=GIT_TIMEOUT,
        check=False,
        pass_fds=tuple(pass_fds),
        umask=0o022,  # what git makes (a worktree, objects) is never writable by others
    )


@dataclass(frozen=True)
class Entry:
    """One file of a commit's tree: its mode, blob id and path."""

    mode: str
    sha: str
    path: str


def tree_entries(root: str, sha: str, paths: Sequence[str] = ()) -> list[Entry]:
    """The files (blobs and links; not submodules) of commit ``sha``, or those of ``paths``."""
    extra = ["--", *paths] if paths else []
    out = git("ls-tree", "-r", "-z", "--full-tree", sha, *extra, cwd=root)
    entries = []
    for row in filter(None, out.split("\0")):
        meta, _, path = row.partition("\t")
        mode, kind, blob = meta.split()
        if kind == "blob":
            entries.append(Entry(mode, blob, path))
    return entries


def read_blobs(root: str, shas: Sequence[str]) -> dict[str, bytes]:
    """The bytes of each blob, read raw (no filter, no attribute, no config applies)."""
    wanted = sorted(set(shas))
    if not wanted:
        return {}
    out = git_bytes(
        "cat-file", "--batch", cwd=root, data="".join(f"{s}\n" for s in wanted).encode()
    )
    blobs: dict[str, bytes] = {}
    pos = 0
    while pos < len(out):
        end = out.index(b"\n", pos)
        head = out[pos:end].decode().split()
        if len(head) != 3:
            raise GitError(f"git cat-file: unexpected reply {out[pos:end]!r}")
        size = int(head[2])
        blobs[head[0]] = out[end + 1 : end + 1 + size]
        pos = end + 1 + size + 1
    return blobs


def repo_root(path: str) -> str | None:
    """The root of the git repository ``path`` is in (None outside one, or without git)."""
    try:
        out = git("rev-parse", "--show-toplevel", cwd=path, check=True)
    except (GitError, OSError):
        return None
    return out.strip() or None


def head(root: str) -> str | None:
    """The commit HEAD names (None in a repository with no commit)."""
    out = git("rev-parse", "--verify", "--quiet", "HEAD^{commit}", cwd=root, check=False)
    return out.strip() or None


def dirty(root: str) -> bool:
    """True if the tree has uncommitted changes (untracked, non-ignored files count)."""
    return bool(git("status", "--porcelain", "--untracked-files=normal", cwd=root).strip())


def common_dir(root: str) -> str:
    out = git("rev-parse", "--path-format=absolute", "--git-common-dir", cwd=root)
    return out.strip()


def tree_files(root: str, sha: str) -> list[str]:
    out = git("ls-tree", "-r", "-z", "--name-only", sha, cwd=root)
    return [p for p in out.split("\0") if p]


def branch_exists(root: str, branch: str) -> bool:
    ref = f"refs/heads/{branch}"
    return bool(git("rev-parse", "--verify", "--quiet", ref, cwd=root, check=False).strip())


def changed(root: str, a: str, b: str) -> list[str]:
    """Paths that differ between commits ``a`` and ``b`` (added, deleted, changed)."""
    out = git("diff", "--no-renames", "--name-only", "-z", f"{a}..{b}", cwd=root)
    return [p for p in out.split("\0") if p]


def diff(root: str, a: str, b: str) -> str:
    return git("diff", "--no-ext-diff", "--no-textconv", "--no-color", f"{a}..{b}", cwd=root)


def diffstat(root: str, a: str, b: str) -> str:
    """``git diff --stat``'s summary line (e.g. '2 files changed, 3 insertions(+)'), or ''."""
    out = git("diff", "--no-ext-diff", "--no-textconv", "--shortstat", f"{a}..{b}", cwd=root)
    return out.strip()


def rev(root: str, name: str) -> str | None:
    out = git("rev-parse", "--verify", "--quiet", f"{name}^{{commit}}", cwd=root, check=False)
    return out.strip() or None


def not_in_commit(root: str, sha: str, rel: str) -> str | None:
    """Why ``rel`` (a path under the repository root) is missing from commit ``sha``, which a
    task's worktree checks out (None: it is there)."""
    if not rel or git_ok("cat-file", "-e", f"{sha}:{rel}", cwd=root):
        return None
    ignored = git_ok("check-ignore", "-q", rel, cwd=root)
    why = "is ignored by git" if ignored else "is not committed (untracked)"
    return (
        f"{rel} {why}, so the task's worktree (a checkout of {sha[:12]}) does not have it: "
        'commit it, or set workspace = "in-place"'
    )


@contextlib.contextmanager
def locked_bare(cache: Path, *init: str) -> Iterator[None]:
    """The bare repository ``cache`` held by this process alone (a flock beside it), made
    with ``git init --bare INIT...`` if missing. Its folders are 0711: a step's uid walks
    through them (to its tree, or bwrap binds the cache from there)."""
    make_folders(cache.parent, 0o711, above=0o711)
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(cache.parent / f"{cache.name}.lock", flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not (cache / "HEAD").is_file():
            git("init", "-q", "--bare", *init, str(cache))
        yield
    finally:
        os.close(fd)
