"""A per-lease kernel container: one cgroup v2 directory per step, ended as a whole.

A process cannot leave a cgroup it was put in without write access to another cgroup's
``cgroup.procs`` (root-owned), and ``cgroup.kill`` (Linux 5.14+) SIGKILLs every member at
once, including processes forked while the kill runs, so pid hopping (fork-and-exit loops),
``setsid``, ``env -i`` and ``nohup`` do not help a step outlive its lease. Where
``cgroup.kill`` is missing, the group is frozen (``cgroup.freeze``: a frozen process cannot
fork), every member is SIGKILLed and the group thawed, until it is empty.

The groups live under ``<cgroup2 mount>/overnight/<namespace>/<lease id>``. Only a process
allowed to create them (root, or a user the cgroup tree is delegated to) gets containers;
everyone else gets ``None`` from :func:`create` and falls back to the ``/proc`` path of
:mod:`overnight.worker.tree`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger("overnight.cgroup")

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


@cache
def cgroup2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (``/sys/fs/cgroup`` or a hybrid's
    ``/sys/fs/cgroup/unified``), or None."""
    try:
        with open("/proc/self/mountinfo") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        pre, _, post = line.partition(" - ")
        if post.split(" ", 1)[0] == "cgroup2":
            return Path(pre.split()[4])
    return None


def component(name: str) -> str:
    """``name`` as one safe path component (lease ids and namespaces are user-chosen)."""
    cleaned = _SAFE.sub("_", name)[:200]
    return cleaned if cleaned not in ("", ".", "..") else "_"


def group_path(namespace: str, lease_id: str, mount: Path | None = None) -> Path | None:
    """The directory of a lease's container (whether or not it exists), or None without
    cgroup v2."""
    base = mount if mount is not None else cgroup2_mount()
    if base is None:
        return None
    return base / "overnight" / component(namespace) / component(lease_id)


@dataclass
class EndReport:
    """What ending a container did."""

    killed: int = 0  # members alive when the kill began
    survivors: tuple[int, ...] = ()  # members still there when we gave up
    seconds: float = 0.0


class StepGroup:
    """One lease's cgroup. :meth:`enter` (run in the child between fork and exec) moves the
    child into it; everything it starts stays in it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._procs_fd = os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)

    def enter(self) -> None:
        """Move the calling process into the group (a ``preexec_fn``: async-signal-safe
        system calls only)."""
        os.write(self._procs_fd, b"0")

    def pids(self) -> list[int]:
        """The members now (empty when the group is gone)."""
        try:
            text = (self.path / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def populated(self) -> bool:
        """True while any process is in the group."""
        try:
            text = (self.path / "cgroup.events").read_text()
        except OSError:
            return False
        return "populated 1" in text

    def signal_all(self, sig: int) -> int:
        """Send ``sig`` to every member (through pidfds; a member is whoever is in the group
        when the pidfd is checked); how many were signalled."""
        sent = 0
        for pid in self.pids():
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if pid in self.pids():  # still ours once pinned by the pidfd
                    signal.pidfd_send_signal(fd, sig)
                    sent += 1
                    if sig == signal.SIGTERM:
                        signal.pidfd_send_signal(fd, signal.SIGCONT)
            except OSError:
                pass
            finally:
                os.close(fd)
        return sent

    def kill(self, timeout: float = 5.0, sleep: Callable[[float], None] = time.sleep) -> EndReport:
        """SIGKILL every member and wait until the group is empty (at most ``timeout``)."""
        started = time.monotonic()
        report = EndReport(killed=len(self.pids()))
        deadline = started + timeout
        while self.populated():
            if not self._write("cgroup.kill", "1"):
                self._freeze_and_kill()
            if time.monotonic() >= deadline:
                report.survivors = tuple(self.pids())
                log.error("cgroup %s: %d process(es) survived SIGKILL for %.1fs: %s",
                          self.path, len(report.survivors), timeout,
                          list(report.survivors))  # fmt: skip
                break
            sleep(0.005)
        report.seconds = time.monotonic() - started
        return report

    def remove(self) -> None:
        """Close our handle and remove the (empty) directory; a group that still has members
        is left for the reaper and logged."""
        with contextlib.suppress(OSError):
            os.close(self._procs_fd)
        self._procs_fd = -1
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("cgroup %s: cannot remove: %s", self.path, exc)

    def _freeze_and_kill(self) -> None:
        if not self._write("cgroup.freeze", "1"):
            for pid in self.pids():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            return
        for pid in self.pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self._write("cgroup.freeze", "0")

    def _write(self, name: str, value: str) -> bool:
        try:
            (self.path / name).write_text(value)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EINVAL, errno.EACCES, errno.EPERM):
                log.warning("cgroup %s: %s: %s", self.path, name, exc)
            return False
        return True


def create(namespace: str, lease_id: str) -> StepGroup | None:
    """Make the container of a lease; None where this host or user cannot (then the caller
    uses the ``/proc`` path)."""
    path = group_path(namespace, lease_id)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=False)
    except FileExistsError:
        log.error("cgroup %s exists already: not reusing another lease's container", path)
        return None
    except OSError:
        return None
    try:
        return StepGroup(path)
    except OSError:
        with contextlib.suppress(OSError):
            path.rmdir()
        return None


def open_existing(namespace: str, lease_id: str) -> StepGroup | None:
    """The container of a lease whose supervisor is gone (for the reaper), or None."""
    path = group_path(namespace, lease_id)
    if path is None or not path.is_dir():
        return None
    try:
        return StepGroup(path)
    except OSError:
        return None


def available() -> bool:
    """True if this process can make step containers here (checked by making one)."""
    probe = create("probe", f"probe-{os.getpid()}-{time.monotonic_ns()}")
    if probe is None:
        return False
    probe.remove()
    return True
