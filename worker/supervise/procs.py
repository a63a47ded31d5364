"""Linux process plumbing in one place: who a PID really is, the process table, environment
tags, our own children, prctl, and signals that never reach a reused PID.

Every signal overnight sends to a process it did not just start goes through
:class:`Signaller`: a pidfd opened only after the start time was checked, so a PID reused
between the scan and the signal is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

from overnight.config import validate

log = logging.getLogger("overnight.procs")

# The environment variable that tags every process of a lease's tree with the lease id.
TAG_VAR = "OVERNIGHT_LEASE_ID"
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37


@cache
def hostname() -> str:
    """This host's id (``OVERNIGHT_HOST_ID``, default the host name), as leases, reaper
    heartbeats, receipts and proofs record it."""
    return validate.this_host()


@cache
def boot_id() -> str:
    """The kernel's boot id: PIDs and start times are only comparable within one boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


# --- the process table ----------------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    """One row of the process table, from ``/proc/PID/stat``."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    start: int  # clock ticks since boot

    @property
    def dead(self) -> bool:
        return self.state in ("Z", "X")


def read_proc(pid: int) -> Proc | None:
    """The row for ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after its last ')'.
    f = stat.rsplit(b")", 1)[1].split()
    return Proc(pid, int(f[1]), int(f[2]), int(f[3]), f[0].decode(), int(f[19]))


def start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), or None."""
    row = read_proc(pid)
    return None if row is None else row.start


def is_same_process(pid: int, ticks: int | None, boot: str) -> bool:
    """True only if ``pid`` exists (a zombie too) and is the very process that started at
    ``ticks`` in boot ``boot``."""
    if pid <= 0 or ticks is None or (boot and boot != boot_id()):
        return False
    return start_ticks(pid) == ticks


def scan() -> dict[int, Proc]:
    """The whole process table (as far as ``/proc`` shows it)."""
    table: dict[int, Proc] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            proc = read_proc(int(name))
            if proc is not None:
                table[proc.pid] = proc
    return table


def ancestors(pid: int) -> set[int]:
    """``pid`` and every process above it up to init, as the table shows them now."""
    found: set[int] = set()
    while pid > 0 and pid not in found:
        found.add(pid)
        row = read_proc(pid)
        if row is None:
            break
        pid = row.ppid
    return found


# --- environment tags -----------------------------------------------------------------------


def env_value(pid: int, var: str) -> str | None:
    """The value of ``var`` in ``pid``'s environment (as it was at exec), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read()
    except OSError:
        return None
    prefix = f"{var}=".encode()
    for entry in env.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def is_tagged(pid: int, lease_id: str, var: str = TAG_VAR) -> bool:
    """True if ``pid``'s environment holds ``var=lease_id`` (the lease tag by default), in
    any of its entries (an environment may name a variable twice)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read()
    except OSError:
        return False
    needle = f"{var}={lease_id}\0".encode()
    return env.startswith(needle) or (b"\0" + needle) in env


def lease_tag(pid: int) -> str | None:
    """The lease id in ``pid``'s environment (``OVERNIGHT_LEASE_ID``), or None."""
    return env_value(pid, TAG_VAR)


def tagged(var: str, value: str, table: dict[int, Proc] | None = None) -> dict[int, Proc]:
    """Live processes of ``table`` (a fresh scan by default) whose environment holds
    ``var=value``; this process is never among them."""
    table = scan() if table is None else table
    me = os.getpid()
    return {
        pid: p
        for pid, p in table.items()
        if pid != me and not p.dead and is_tagged(pid, value, var)
    }


# --- our own children -----------------------------------------------------------------------


def own_children() -> set[int] | None:
    """This process's children, zombies included (``/proc/self/task/*/children``), or None
    if ``/proc`` cannot tell for sure (no such file, or a thread came or went meanwhile,
    which may move its children to another thread)."""
    base = "/proc/self/task"
    found: set[int] = set()
    try:
        tids = sorted(os.listdir(base))
        for tid in tids:
            with open(f"{base}/{tid}/children", "rb") as fh:
                found.update(int(pid) for pid in fh.read().split())
        if sorted(os.listdir(base)) != tids:
            return None
    except (OSError, ValueError):
        return None
    return found


# --- prctl ----------------------------------------------------------------------------------


@cache
def _libc() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True)
    except (OSError, AttributeError):
        return None


def _prctl(option: int, arg: int) -> bool:
    libc = _libc()
    return libc is not None and libc.prctl(option, arg, 0, 0, 0) == 0


def set_pdeathsig(sig: int) -> bool:
    """Have the kernel send ``sig`` to this process when the thread that started it exits.

    Meant for a ``preexec_fn`` (or right after a fork); False where unsupported."""
    return _prctl(PR_SET_PDEATHSIG, int(sig))


def set_dumpable(on: bool) -> bool:
    """Set this process's dumpable flag; off, a same-user process cannot ptrace it or read
    its ``/proc`` memory and environment files. False where unsupported."""
    return _prctl(PR_SET_DUMPABLE, int(on))


def set_child_subreaper(on: bool = True) -> bool:
    """Make this process a child subreaper (or stop being one), so orphaned descendants
    are re-parented to it rather than to init.

    Idempotent and safe in a forked RQ work horse; returns False where unsupported.
    """
    return _prctl(PR_SET_CHILD_SUBREAPER, int(on))


def is_child_subreaper() -> bool:
    """True if this process is a child subreaper now."""
    import ctypes

    libc = _libc()
    flag = ctypes.c_int(0)
    if libc is None or libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) != 0:
        return False
    return bool(flag.value)


# --- signals --------------------------------------------------------------------------------


class Signaller:
    """Signals processes through pidfds opened only after their start time was checked.

    Never signals pid 1 or this process. Call :meth:`close` when done (it closes the pidfds).
    """

    def __init__(self) -> None:
        self.fds: dict[tuple[int, int], int] = {}

    def send(self, proc: Proc, sig: int) -> bool:
        """Send ``sig`` to ``proc`` if it is still the process that started at ``proc.start``;
        True if it was sent."""
        if proc.pid <= 1 or proc.pid == os.getpid():
            return False
        key = (proc.pid, proc.start)
        fd = self.fds.get(key)
        if fd is None:
            try:
                fd = os.pidfd_open(proc.pid)
            except ProcessLookupError:
                return False
            except OSError as exc:
                if exc.errno not in (errno.ENOSYS, errno.EINVAL):
                    return False
                return self._send_plain(proc, sig)
            current = read_proc(proc.pid)
            if current is None or current.start != proc.start:
                os.close(fd)  # the PID now names another process
                return False
            self.fds[key] = fd
        try:
            signal.pidfd_send_signal(fd, sig)
        except ProcessLookupError:
            return False
        except PermissionError:
            log.warning("pid %d: not permitted to signal it", proc.pid)
            return False
        return True

    @staticmethod
    def _send_plain(proc: Proc, sig: int) -> bool:
        current = read_proc(proc.pid)
        if current is None or current.start != proc.start:
            return False
        try:
            os.kill(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def wait_any(self, pids: Iterable[int], timeout: float, extra_fds: Iterable[int]) -> None:
        """Sleep until one of ``pids`` exits, an ``extra_fds`` is readable, or ``timeout``."""
        poller = select.poll()
        wanted = set(pids)
        for (pid, _start), fd in self.fds.items():
            if pid in wanted:
                poller.register(fd, select.POLLIN)
        for fd in extra_fds:
            poller.register(fd, select.POLLIN)
        poller.poll(max(0, int(timeout * 1000) + 1))

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
