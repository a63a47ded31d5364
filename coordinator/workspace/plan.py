"""Where a task works, planned: the workspace's shape recorded at submit (:class:`Base`),
what is protected, which protect globs are unusable, what a branch, a lock reason or
overnight's commit message says. Pure functions, tested as tables."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import PurePosixPath
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

WORKTREE: Literal["worktree"] = "worktree"
IN_PLACE: Literal["in-place"] = "in-place"
Mode = Literal["worktree", "in-place"]
ALWAYS_PROTECTED_NAMES = frozenset(
    {"conftest.py", "pytest.ini", "sitecustomize.py", "usercustomize.py"}
)
ALWAYS_PROTECTED_SUFFIXES = (".pth",)
BRANCH_PREFIX = "overnight/"


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
    ref: str | None = None


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


# --- tasks from a git remote ------------------------------------------------------------------

# What a task's ``repo`` / ``push_to`` may be: a URL of these schemes, scp-like
# ``user@host:path``, or an absolute path (a repository on this host's file system).
REMOTE_SCHEMES = ("https", "http", "ssh", "git", "file")
_SCP_RE = re.compile(r"^(?:[A-Za-z0-9._-]+@)?[A-Za-z0-9.-]+:(?!//)[^\s]+$")
REF_RE = re.compile(r"^(?!-)(?!.*\.\.)(?!.*//)[A-Za-z0-9._/-]{1,200}(?<![/.])$")


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot name a task's remote (None: it can). Never repeats a password."""
    if not url.strip() or any(ord(c) < 32 or c.isspace() for c in url):
        return "must be a git URL without blanks or control characters"
    if url.startswith("-"):
        return "must not start with '-'"
    if url.startswith("/"):
        return None
    if "://" in url:
        scheme = url.split("://", 1)[0].lower()
        if scheme not in REMOTE_SCHEMES:
            known = ", ".join(f"{s}://" for s in REMOTE_SCHEMES)
            return f"{redact(url)!r}: the scheme {scheme!r} is not one of {known}"
        try:
            parts = urlsplit(url)
        except ValueError as exc:
            return f"{redact(url)!r} is not a URL: {exc}"
        if scheme != "file" and not parts.hostname:
            return f"{redact(url)!r} names no host"
        return None
    if "::" in url.split("/", 1)[0]:
        return f"{redact(url)!r}: a remote helper (<transport>::<address>) is not allowed"
    if _SCP_RE.match(url):
        return None
    return f"{redact(url)!r} is not a git URL (scheme://host/path, user@host:path or /path)"


def ref_problem(ref: str) -> str | None:
    """Why ``ref`` cannot name the task's base on its remote (a branch, tag or full ref)."""
    if ref == "HEAD" or REF_RE.match(ref):
        return None
    return f"{ref!r} is not a ref name (a branch, a tag, refs/..., or HEAD)"


def redact(url: str) -> str:
    """``url`` without the password of its user part (``https://user:****@host/...``): what
    overnight prints or logs of a remote."""
    if "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    auth, at, tail = rest.partition("@")
    if not at or "/" in auth:
        return url
    user, colon, _ = auth.partition(":")
    return f"{scheme}://{user}{':****' if colon else ''}@{tail}"


def redact_text(text: str, urls: Iterable[str]) -> str:
    """``text`` with each of ``urls`` (and its password alone) redacted."""
    for url in urls:
        if url and url != redact(url):
            text = text.replace(url, redact(url))
            password = url.split("://", 1)[1].partition("@")[0].partition(":")[2]
            if password:
                text = text.replace(password, "****")
    return text


def cache_name(url: str) -> str:
    """The folder name of a remote's cache on a host: the same for every credential."""
    if "://" in url:
        scheme, rest = url.split("://", 1)
        auth, at, tail = rest.partition("@")
        url = f"{scheme.lower()}://{tail}" if at and "/" not in auth else url
    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Tips:
    """What is known of a remote task's branch when a host opens its tree: the base, the
    head the task's record holds (its last committed turn), the remote's tip of
    ``overnight/<task>`` (None: the branch is not there), and whether that tip grows from
    the base and contains the head."""

    base: str
    head: str | None
    remote: str | None
    has_base: bool = False
    has_head: bool = False


@dataclass(frozen=True)
class Start:
    """Where a host starts a remote task's tree: a commit, or why it cannot."""

    commit: str | None
    problem: str | None = None


def start_of(tips: Tips, branch: str) -> Start:
    """The commit a host starts the task's tree from: the remote's tip when the branch is
    there (a previous host's turns), else the base. A branch that does not grow from the
    base, or lacks the turn the record holds, is refused (someone else moved it)."""
    if tips.remote is None:
        if tips.head is None or tips.head == tips.base:
            return Start(tips.base)
        return Start(None, f"the remote has no {branch}, though turn commit {tips.head[:12]} was")
    if not tips.has_base:
        return Start(None, f"{branch} on the remote does not grow from the base {tips.base[:12]}")
    if tips.head is not None and not tips.has_head:
        return Start(None, f"{branch} on the remote lacks the task's turn {tips.head[:12]}")
    return Start(tips.remote)
