"""A host-local pool of step uids (as systemd's DynamicUser): each task running on this host
holds a uid of ``OVERNIGHT_STEP_UIDS`` of its own from its claim to its end, so one task's
steps cannot read another's process environment, signal or trace its processes, or write
its worktree.

A uid is held by an exclusive ``flock`` on its file in ``<runtime root>/uids`` (0700, root's),
which dies with its holder: a crashed worker frees its uid. Before a uid is handed out it is
checked unused: no process runs as it (real, effective, saved or filesystem uid or gid), no
account or group of this host has it, and no file it owns is left where the next task's steps
could use it (the folders of task trees and prompts, the shared temporary folders). A uid
failing a check is passed over, never cleaned. :func:`pick` is the pure choice;
:class:`UidPool` does the I/O.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import hashlib
import logging
import os
import pwd
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from overnight.config.exits import EXIT_REFUSED, CommandError
from overnight.config.folders import usable
from overnight.config.runtime import runtime_root
from overnight.worker.sandbox.stepuser import StepUser, pooled

log = logging.getLogger("overnight.uidpool")

# (folder, depth): where a file left by an earlier holder of a uid matters.
Place = tuple[Path, int]
SHARED_TMP: tuple[Place, ...] = ((Path("/tmp"), 1), (Path("/var/tmp"), 1), (Path("/dev/shm"), 1))


class PoolExhausted(CommandError):
    """Every uid of the pool is held by a live task or in use on this host (a refusal)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_REFUSED)


def pick(task_id: str, first: int, last: int, taken: Iterable[int]) -> int | None:
    """The uid of ``first``..``last`` for ``task_id``: the first not ``taken`` from a start the
    task id fixes (so a task resumed on a host tends to get its uid back), or None."""
    size = last - first + 1
    if size <= 0:
        return None
    start = int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "big") % size
    busy = set(taken)
    for offset in range(size):
        uid = first + (start + offset) % size
        if uid not in busy:
            return uid
    return None


def ids_in_status(status: bytes) -> set[int]:
    """Every uid and gid (real, effective, saved, filesystem) a ``/proc/PID/status`` names."""
    found: set[int] = set()
    for key in (b"\nUid:", b"\nGid:"):
        start = status.find(key)
        if start < 0:
            continue
        end = status.find(b"\n", start + len(key))
        line = status[start + len(key) : end if end >= 0 else len(status)]
        found.update(int(v) for v in line.split() if v.isdigit())
    return found


def ids_running() -> set[int]:
    """The uids and gids some process of this host runs with (read with plain descriptors:
    a pool hand-out scans the whole table twice)."""
    found: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/status", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            found |= ids_in_status(os.read(fd, 8192))
        except OSError:
            pass
        finally:
            os.close(fd)
    return found


def has_account(uid: int) -> bool:
    """True if a user or group of this host has the id ``uid``."""
    for look in (pwd.getpwuid, grp.getgrgid):
        with contextlib.suppress(KeyError, OverflowError):
            look(uid)
            return True
    return False


def left_by(uid: int, places: Sequence[Place]) -> Path | None:
    """A file or folder of ``uid`` found in ``places`` (each walked ``depth`` levels down,
    links not followed), or None."""
    for folder, depth in places:
        level = [str(folder)]
        for down in range(depth, 0, -1):
            below: list[str] = []
            for parent in level:
                with contextlib.suppress(OSError), os.scandir(parent) as entries:
                    for entry in entries:
                        with contextlib.suppress(OSError):
                            if entry.stat(follow_symlinks=False).st_uid == uid:
                                return Path(entry.path)
                            if down > 1 and entry.is_dir(follow_symlinks=False):
                                below.append(entry.path)
            level = below
    return None


@dataclass
class Held:
    """A uid held for one task until :meth:`release` (or the holder's death)."""

    user: StepUser
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the lock goes with the last descriptor
            self.fd = -1


def pool_folder() -> Path:
    """Where the pool's lock files are: one per uid, in overnight's runtime folder."""
    return runtime_root() / "uids"


class UidPool:
    """The uids ``first``..``last`` of this host, handed out one per task."""

    def __init__(
        self, first: int, last: int, folder: Path | None = None, places: Sequence[Place] = ()
    ) -> None:
        self.first, self.last = first, last
        self.folder = folder or pool_folder()
        self.places = (*places, *SHARED_TMP)

    def take(self, task_id: str) -> Held:
        """A uid for ``task_id``, held by this process; :class:`PoolExhausted` if none is free."""
        fix = "check the runtime folder"
        usable(self.folder.parent, 0o700, fix, private=True, own=True)
        usable(self.folder, 0o700, fix, private=True, own=True)
        running: set[int] = set()  # as /proc last showed, to pass over uids in use
        passed: set[int] = set()
        while True:
            uid = pick(task_id, self.first, self.last, passed)
            if uid is None:
                raise PoolExhausted(
                    f"no free step uid in {self.first}-{self.last} for task {task_id}: "
                    f"{len(passed)} held or in use on this host"
                )
            passed.add(uid)
            if uid in running or has_account(uid):
                continue
            held = self._lock(uid)
            if held is None:
                continue
            # Looked at only now it is held: a holder may have ended since any earlier look.
            running = ids_running()
            why = self._unclean(uid, running)
            if why is None:
                os.ftruncate(held.fd, 0)
                os.write(held.fd, f"{task_id} {os.getpid()}\n".encode())
                return held
            log.warning("step uid %s passed over for task %s: %s", uid, task_id, why)
            held.release()

    def _lock(self, uid: int) -> Held | None:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.folder / str(uid), flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return Held(pooled(uid), fd)

    def _unclean(self, uid: int, running: set[int]) -> str | None:
        """Why ``uid``, now held, may not be given out (None: it may); ``running`` is what
        :func:`ids_running` said once it was held."""
        if uid in running:
            return "a process runs as it"
        left = left_by(uid, self.places)
        return None if left is None else f"{left} is its"


@contextlib.contextmanager
def held(
    user: StepUser | None, task_id: str, places: Sequence[Place] = ()
) -> Iterator[StepUser | None]:
    """``user``, or for a user that stands for a pool, a uid of that pool held for
    ``task_id`` while the block runs."""
    if user is None or user.pool is None:
        yield user
        return
    taken = UidPool(*user.pool, places=places).take(task_id)
    try:
        yield taken.user
    finally:
        taken.release()
