"""Who a step runs as: an unprivileged uid when overnight runs as root.

A step running as root (or as overnight's own user) could read and write everything
overnight keeps on the host. So when overnight runs as root, every step of a task runs as a
uid of that task's own, taken from ``OVERNIGHT_STEP_UIDS`` for as long as the task runs
here (:mod:`worker.sandbox.uidpool`); or, with ``OVERNIGHT_STEP_USER``, every step of every
task runs as that one user. Only the explicit opt-in ``OVERNIGHT_ALLOW_ROOT_STEPS`` lets
steps run as root. A setting that cannot be honoured (no such user, a user of uid 0, a step
user while overnight is not root) ends the command with one line naming it (exit 78): never
a silent fallback to less containment.

:func:`decide` is the pure rule; :func:`configured` reads the settings of this process.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from overnight.config import defaults
from overnight.config.exits import EXIT_BAD_CONFIG, CommandError

STEP_USER = "OVERNIGHT_STEP_USER"
ALLOW_ROOT = "OVERNIGHT_ALLOW_ROOT_STEPS"
STEP_UIDS = "OVERNIGHT_STEP_UIDS"


@dataclass(frozen=True)
class StepUser:
    """The account steps run as: its name, uid, gid and supplementary groups.

    With ``pool`` (the first and last uid of ``OVERNIGHT_STEP_UIDS``) it stands for any uid
    of that range, for checks of what such a uid may reach: no step runs as it; each task
    takes a uid of its own (:func:`worker.sandbox.uidpool.held`). ``alone``: a uid so taken,
    which no process but the holder's current step runs as."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    pool: tuple[int, int] | None = None
    alone: bool = False


def pooled(uid: int) -> StepUser:
    """The step user of a uid taken from the pool: no account, its gid its uid, no groups."""
    return StepUser(f"overnight-{uid}", uid, uid, alone=True)


def any_of(first: int, last: int) -> StepUser:
    """Any uid of the range ``first``..``last``, for checks (see :class:`StepUser`)."""
    return StepUser(f"overnight-{first}", first, first, (), (first, last))


class StepUserRefused(CommandError):
    """The step user settings cannot be honoured here (exit 78, one line naming the setting)."""

    def __init__(self, variable: str, problem: str) -> None:
        super().__init__(f"bad configuration: {variable}: {problem}", EXIT_BAD_CONFIG)
        self.variable = variable


def lookup(name: str) -> StepUser | None:
    """The account ``name`` (with its groups), or None if there is none."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None
    try:
        groups = tuple(g for g in os.getgrouplist(name, entry.pw_gid) if g != entry.pw_gid)
    except OSError:
        groups = ()
    return StepUser(name, entry.pw_uid, entry.pw_gid, groups)


def decide(
    step_user: str | None,
    allow_root: bool,
    euid: int,
    find: Callable[[str], StepUser | None] = lookup,
    uids: str = defaults.STEP_UIDS,
) -> StepUser | None:
    """Who steps run as (None: as this process's own user; a user with a ``pool``: a uid of
    that range per task), or :class:`StepUserRefused`. ``uids`` is ``OVERNIGHT_STEP_UIDS``."""
    if step_user:
        if euid != 0:
            why = f"cannot be honoured: overnight runs as uid {euid}, not root, so it cannot "
            raise StepUserRefused(STEP_USER, why + "start steps as another user; unset it")
        found = find(step_user)
        if found is None:
            raise StepUserRefused(STEP_USER, f"no such user {step_user!r} on this host")
        if found.uid == 0:
            raise StepUserRefused(STEP_USER, f"{step_user!r} has uid 0; steps must not run as root")
        return found
    if euid != 0 or allow_root:
        return None
    if uids == "off":
        raise StepUserRefused(
            STEP_USER,
            f"overnight runs as root, no step user is set and {STEP_UIDS} is off: set "
            f"it to an unprivileged user, or {STEP_UIDS} to a range of uids (or "
            f"{ALLOW_ROOT}=1 to run steps as root)",
        )
    first, last = (int(n) for n in uids.split("-"))
    return any_of(first, last)


def steps_line(user: StepUser | None, euid: int) -> str:
    """Who steps run as, in the words a worker, ``up`` and the demo print at start
    (``user`` as :func:`decide` gave it)."""
    if user is None:
        if euid == 0:
            return f"steps run as root ({ALLOW_ROOT}=1): for trusted steps only"
        return f"steps run as this user (uid {euid})"
    if user.pool is not None:
        first, last = user.pool
        return f"steps run as uids {first}-{last}, a uid of its own for each task ({STEP_UIDS})"
    return f"steps run as {user.name} (uid {user.uid}), the same uid for every task ({STEP_USER})"


@cache
def configured() -> StepUser | None:
    """Who this process's steps run as, by its settings (read once)."""
    from overnight.config.validate import read_fast

    fast = read_fast(os.environ)
    if fast is not None:
        return decide(fast.step_user, fast.allow_root_steps, os.geteuid(), uids=fast.step_uids)
    from overnight.config.context import settings

    s = settings()
    return decide(s.step_user, s.allow_root_steps, os.geteuid(), uids=s.step_uids)


def _allows(info: os.stat_result, user: StepUser, bits: int) -> bool:
    """True if the mode of ``info`` grants ``user`` every permission in ``bits`` (r=4, w=2,
    x=1), by owner, group or other (ACLs are not consulted)."""
    if info.st_uid == user.uid:
        have = (info.st_mode >> 6) & 7
    elif info.st_gid == user.gid or info.st_gid in user.groups:
        have = (info.st_mode >> 3) & 7
    else:
        have = info.st_mode & 7
    return have & bits == bits


def reach_problem(path: str | Path, user: StepUser) -> str | None:
    """Why ``user`` cannot reach ``path`` (enter every folder above it), or None."""
    for folder in reversed(Path(os.path.abspath(path)).parents):
        try:
            info = os.stat(folder)
        except OSError as exc:
            return f"{folder}: {exc.strerror}"
        if not _allows(info, user, 1):
            return f"{user.name} cannot enter {folder} (mode {stat.filemode(info.st_mode)})"
    return None


def run_problem(path: str | Path, user: StepUser) -> str | None:
    """Why ``user`` cannot run the program at ``path`` (reach it and execute it), or None."""
    problem = reach_problem(path, user)
    if problem is not None:
        return problem
    try:
        info = os.stat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not _allows(info, user, 1):
        return f"{user.name} cannot execute {path} (mode {stat.filemode(info.st_mode)})"
    return None


def workdir_problem(path: str, user: StepUser) -> str | None:
    """Why ``user`` cannot enter and write ``path`` (one line), or None if it can."""
    target = Path(os.path.abspath(path))
    problem = reach_problem(target, user)
    if problem is not None:
        return problem
    try:
        info = os.stat(target)
    except OSError as exc:
        return f"{target}: {exc.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{target} is not a folder"
    if not _allows(info, user, 3):
        return (
            f"{user.name} cannot write {target} (owner uid {info.st_uid}, mode "
            f"{stat.filemode(info.st_mode)})"
        )
    return None


def give(path: str | Path, user: StepUser | None, mode: int = 0o700) -> None:
    """Make ``path`` (a folder overnight just created) ``user``'s own, with ``mode``."""
    if user is not None:
        os.chown(path, user.uid, user.gid)
    os.chmod(path, mode)


def task_folder(base: Path, name: str, user: StepUser | None) -> Path:
    """``base/name``: a folder of one task that only ``user`` (the step user; None: this
    process's user) can enter, 0700. ``base`` and its parent are this process's own, 0711
    (enterable, not listable), and none of them may be a link someone else planted."""
    for level in (base.parent, base):
        with contextlib.suppress(FileExistsError):
            os.mkdir(level, 0o711)
        info = os.lstat(level)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise PermissionError(f"{level} is not a folder of uid {os.geteuid()}")
        os.chmod(level, 0o711)
    folder = base / name
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"{folder} is not a private folder")
    owner = user.uid if user is not None else os.geteuid()
    if info.st_uid not in (owner, os.geteuid()):  # an earlier attempt's uid: all of it is ours
        hand_over(folder, owner, user.gid if user is not None else os.getegid())
    give(folder, user)
    return folder


def hand_over(path: str | Path, uid: int, gid: int) -> None:
    """Make the tree at ``path`` (links not followed) ``uid``'s and ``gid``'s, ``path`` last."""
    for folder, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            with contextlib.suppress(OSError):
                os.lchown(os.path.join(folder, name), uid, gid)
    os.lchown(path, uid, gid)


def write_file(path: Path, text: str) -> Path:
    """Write ``path`` in a folder a step may own without following anything it planted: a
    fresh file (no link followed) renamed over the old name."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
