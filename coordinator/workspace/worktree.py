"""Where a task works: its own branch in its own git worktree, or a snapshot-protected folder.

Two halves. Pure planning (what is protected, which globs are bad, what a commit message or a
lock reason says) is tested as tables. A thin git runner does the rest: always an argv list
through ``git`` with an explicit ``--git-dir``/``--work-tree`` where the agent's tree is
involved (its ``.git`` file is the agent's to rewrite), hooks off, no system or global config,
overnight's own identity for its commits.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from overnight.config.errors import OvernightError
from overnight.config.folders import make_folders

if TYPE_CHECKING:
    from overnight.config.settings import Settings

WORKTREE: Literal["worktree"] = "worktree"
IN_PLACE: Literal["in-place"] = "in-place"
Mode = Literal["worktree", "in-place"]
ALWAYS_PROTECTED_NAMES = frozenset(
    {"conftest.py", "pytest.ini", "sitecustomize.py", "usercustomize.py"}
)
ALWAYS_PROTECTED_SUFFIXES = (".pth",)
BRANCH_PREFIX = "overnight/"
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
)


class Base(BaseModel):
    """What a task's workspace was at submit; recorded in the task, never read from its file.

    ``root`` is the repository root (or the workdir, outside git); ``subdir`` the workdir
    relative to it. ``sha`` is the base commit (worktree mode). ``named`` are the files
    (relative to ``root``) a verifier's argv names. ``snapshot`` maps each protected file to
    its sha256 at submit (in-place mode), whose bytes are in ``snapshot_dir``.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    mode: Mode
    root: str
    subdir: str = ""
    in_repo: bool = False
    sha: str | None = None
    named: tuple[str, ...] = ()
    snapshot: dict[str, str] = Field(default_factory=dict)
    snapshot_dir: str | None = None


# --- pure planning ----------------------------------------------------------------------------


@cache
def glob_regex(pattern: str) -> re.Pattern[str]:
    """A protect glob as a regex over '/'-separated paths: ``**`` spans folders (and none),
    ``*`` and ``?`` stay within one; a glob naming a folder covers what is under it."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(f"{out}(?:/.*)?")


def glob_problem(pattern: str) -> str | None:
    """Why a protect glob is unusable (empty, absolute, or reaching out with '..'), or None."""
    if not pattern.strip() or "\x00" in pattern:
        return "must be a non-empty glob"
    if pattern.startswith("/"):
        return f"{pattern!r} must be relative to the repository root"
    if ".." in PurePosixPath(pattern).parts:
        return f"{pattern!r} escapes the repository"
    return None


def always_protected(path: str) -> bool:
    name = PurePosixPath(path).name
    return name in ALWAYS_PROTECTED_NAMES or name.endswith(ALWAYS_PROTECTED_SUFFIXES)


def is_protected(path: str, globs: Sequence[str], named: Iterable[str] = ()) -> bool:
    """True for a path (relative to the root) the verifier must see as it was at the base."""
    if always_protected(path) or path in set(named):
        return True
    return any(glob_regex(g.rstrip("/")).fullmatch(path) for g in globs)


def protected_of(paths: Iterable[str], globs: Sequence[str], named: Iterable[str]) -> list[str]:
    named = frozenset(named)
    return sorted(p for p in paths if is_protected(p, globs, named))


def unmatched_globs(globs: Sequence[str], files: Iterable[str]) -> list[str]:
    """The globs that match none of ``files``."""
    files = list(files)
    return [g for g in globs if not any(glob_regex(g.rstrip("/")).fullmatch(f) for f in files)]


def named_files(
    argvs: Iterable[Sequence[str]], root: str, subdir: str, files: set[str]
) -> list[str]:
    """The files (relative to ``root``) among ``files`` that an argv names, as a path
    relative to the workdir ``root/subdir`` or absolute inside ``root``."""
    out: set[str] = set()
    for argv in argvs:
        for arg in argv:
            if not arg or arg.startswith("-") or "\x00" in arg:
                continue
            if os.path.isabs(arg):
                rel = os.path.relpath(os.path.normpath(arg), root)
            else:
                rel = os.path.normpath(os.path.join(subdir, arg))
            rel = rel.replace(os.sep, "/")
            if rel in files:
                out.add(rel)
    return sorted(out)


def branch_name(task_id: str) -> str:
    return f"{BRANCH_PREFIX}{task_id}"


def lock_reason(task_id: str, host: str, lease: str) -> str:
    return f"task {task_id} host {host} lease {lease}"


def commit_message(task_id: str, turn: int, outcome: str) -> str:
    """The subject and body of overnight's commit after an agent step."""
    subject = f"overnight: task {task_id} turn {turn}: agent step {outcome}"
    return f"{subject}\n\nTask: {task_id}\nTurn: {turn}\nOutcome: {outcome}\n"


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


def clean_path(path: str, forbidden: Iterable[str]) -> str:
    """The worker's PATH without relative entries and without any inside ``forbidden``
    folders (the task's tree): what a verifier run gets."""
    roots = [os.path.realpath(f) for f in forbidden]
    kept = []
    for entry in path.split(os.pathsep):
        if not entry or not os.path.isabs(entry):
            continue
        real = os.path.realpath(entry)
        if any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots):
            continue
        kept.append(entry)
    return os.pathsep.join(kept)


# --- the git runner ---------------------------------------------------------------------------


class GitError(OvernightError):
    """A git command failed; the message is its first line of stderr."""


def _git_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
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


def git(*args: str, cwd: str | None = None, at: Where | None = None, check: bool = True) -> str:
    """Run ``git ARGS`` (argv, never a shell); returns stdout. Raises :class:`GitError`."""
    out = git_bytes(*args, cwd=cwd, at=at, check=check)
    return out.decode("utf-8", "surrogateescape")


def git_bytes(
    *args: str,
    cwd: str | None = None,
    at: Where | None = None,
    check: bool = True,
    data: bytes | None = None,
) -> bytes:
    """:func:`git` with ``data`` on its stdin and its stdout as bytes."""
    proc = _run(args, cwd, at, data)
    if check and proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        raise GitError(f"git {args[0] if args else ''}: {err[0] if err else proc.returncode}")
    return proc.stdout


def git_ok(*args: str, cwd: str | None = None, at: Where | None = None) -> bool:
    """True if ``git ARGS`` exits 0 (for the commands that answer by their exit code)."""
    return _run(args, cwd, at, None).returncode == 0


def _run(
    args: Sequence[str], cwd: str | None, at: Where | None, data: bytes | None
) -> subprocess.CompletedProcess[bytes]:
    argv = ["git"]
    for item in HARDENING:
        argv += ["-c", item]
    if cwd is not None:
        argv += ["-C", cwd]
    env = _git_env()
    if at is not None:
        argv += [f"--git-dir={at.git_dir}", f"--work-tree={at.work_tree}"]
        if at.index is not None:
            env["GIT_INDEX_FILE"] = at.index
    return subprocess.run(
        [*argv, *args],
        env=env,
        input=data if data is not None else b"",
        capture_output=True,
        timeout=GIT_TIMEOUT,
        check=False,
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
    """The tree object of what the worktree holds: tracked and untracked files, ignored ones
    left out, every blob hashed raw (plumbing only: no filter, hook or attribute runs, so a
    repository config the agent wrote cannot run a program as overnight)."""
    where = Where(wt.git_dir, wt.path)
    out = git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=wt.path, at=where)
    files, links = [], []
    for rel in sorted(set(filter(None, out.split("\0")))):
        full = os.path.join(wt.path, rel)
        if rel.endswith("/") or not os.path.lexists(full):
            continue  # a nested repository, or a tracked file the agent deleted
        if os.path.islink(full):
            links.append(rel)
        elif os.path.isfile(full):
            files.append(rel)
    rows = []
    if files:
        paths = "".join(f"{rel}\n" for rel in files).encode("utf-8", "surrogateescape")
        shas = git_bytes(
            "hash-object", "-w", "--no-filters", "--stdin-paths", cwd=wt.path, at=where, data=paths
        ).split()
        for rel, sha in zip(files, shas, strict=True):
            executable = os.stat(os.path.join(wt.path, rel)).st_mode & 0o100
            rows.append(f"{'100755' if executable else '100644'} {sha.decode()}\t{rel}")
    for rel in links:
        target = os.fsencode(os.readlink(os.path.join(wt.path, rel)))
        sha = git_bytes("hash-object", "-w", "--stdin", at=where, data=target).strip()
        rows.append(f"120000 {sha.decode()}\t{rel}")
    index = os.path.join(wt.git_dir, "overnight-index")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(index)
    scratch = Where(wt.git_dir, wt.path, index=index)
    data = "".join(f"{row}\0" for row in rows).encode("utf-8", "surrogateescape")
    git_bytes("update-index", "--add", "-z", "--index-info", at=scratch, data=data)
    tree = git("write-tree", at=scratch).strip()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(index)
    return tree


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
    stays); raises :class:`GitError` otherwise."""
    git("worktree", "remove", path, cwd=root)


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
