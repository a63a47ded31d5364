"""Finding and ending a supervised process tree on Linux, without ever signalling a reused PID.

A tree is everything a supervised child started: its process group and session, every
descendant (by parent links), orphans re-parented to the supervisor (it is a child
subreaper), and every process whose environment carries the lease's tag
(``OVERNIGHT_LEASE_ID=<id>``), which is how escapees are found once their parents are gone.
Signals go through pidfds opened after the start time was checked, so a PID that was
reused between the scan and the signal is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

log = logging.getLogger("overnight.tree")

TAG_VAR = "OVERNIGHT_LEASE_ID"
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37


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


def scan() -> dict[int, Proc]:
    """The whole process table (as far as ``/proc`` shows it)."""
    table: dict[int, Proc] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            proc = read_proc(int(name))
            if proc is not None:
                table[proc.pid] = proc
    return table


def is_tagged(pid: int, lease_id: str) -> bool:
    """True if ``pid``'s environment names ``lease_id`` as its lease."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read()
    except OSError:
        return False
    needle = f"{TAG_VAR}={lease_id}\0".encode()
    return env.startswith(needle) or (b"\0" + needle) in env


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


def set_child_subreaper(on: bool = True) -> bool:
    """Make this process a child subreaper (or stop being one), so orphaned descendants
    are re-parented to it rather than to init.

    Idempotent and safe in a forked RQ work horse; returns False where unsupported.
    """
    libc = _libc()
    return libc is not None and libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0


def is_child_subreaper() -> bool:
    """True if this process is a child subreaper now."""
    import ctypes

    libc = _libc()
    flag = ctypes.c_int(0)
    if libc is None or libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) != 0:
        return False
    return bool(flag.value)


@cache
def _libc() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True)
    except (OSError, AttributeError):
        return None


@dataclass
class Tree:
    """What identifies one supervised tree.

    ``root``/``root_start`` is the supervised child. Group and session members count only
    while the root still exists (even as a zombie), because only then can its pgid and sid
    not have been reused. ``adopter`` is the subreaper (the supervisor): its children that
    started no earlier than the root are orphans of the tree. ``group_safe`` says the root
    is the caller's own unreaped child, so ``killpg(root)`` cannot hit a stranger.
    """

    root: int
    root_start: int | None
    lease_id: str | None = None
    adopter: int | None = None
    group_safe: bool = False
    keep_unreaped: set[int] = field(default_factory=set)
    _tag_cache: dict[tuple[int, int], bool] = field(default_factory=dict, repr=False)

    def members(self, table: dict[int, Proc] | None = None) -> dict[int, Proc]:
        """Every process of the tree in ``table`` (a fresh scan by default), zombies included."""
        table = scan() if table is None else table
        me = os.getpid()
        root = table.get(self.root)
        root_here = root is not None and root.start == self.root_start
        found: dict[int, Proc] = {}
        for proc in table.values():
            if proc.pid in (me, self.adopter):
                continue
            if (
                (root_here and self.root in (proc.pid, proc.pgid, proc.sid))
                or (
                    self.adopter is not None
                    and proc.ppid == self.adopter
                    and self.root_start is not None
                    and proc.start >= self.root_start
                )
                or (self.lease_id and self._tagged(proc))
            ):
                found[proc.pid] = proc
        # Descendants of members, by parent links.
        children: dict[int, list[Proc]] = {}
        for proc in table.values():
            children.setdefault(proc.ppid, []).append(proc)
        stack = list(found)
        while stack:
            for child in children.get(stack.pop(), ()):
                if child.pid not in found and child.pid not in (me, self.adopter):
                    found[child.pid] = child
                    stack.append(child.pid)
        return found

    def exited_alone(self) -> bool:
        """True when the root has exited and, provably without a scan, nothing else of the
        tree can be alive (so :func:`end_tree` has nothing to do).

        Why this is enough: this process is a child subreaper and an ancestor of every
        descendant. When a process exits, its children go to the nearest living subreaper
        above them, so the topmost living process of any surviving branch is a child of
        this process (or of a subreaper that is itself such a surviving descendant). An
        orphan that reached us stays in our children list, as a zombie once dead, until we
        reap it. So if our only child is the exited, unreaped root (others we may have, if
        they started before the root: they cannot descend from it), no descendant lives, and
        group and session members (only descendants can be in them) are gone too. What this
        does not cover are processes that never descended from the root but carry its tag
        (started on its behalf by some other process); the full scan still looks for tags
        whenever the root is alive, we are not a subreaper, or any orphan came back to us.
        """
        if self.adopter is None or self.adopter != os.getpid() or not is_child_subreaper():
            return False
        try:
            info = os.waitid(os.P_PID, self.root, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        children = own_children()
        if info is None or children is None or self.root not in children:
            return False
        for pid in children - {self.root}:
            row = read_proc(pid)
            if row is not None and (self.root_start is None or row.start >= self.root_start):
                return False
        return True

    def _tagged(self, proc: Proc) -> bool:
        if proc.dead or not self.lease_id:
            return False
        key = (proc.pid, proc.start)
        if key not in self._tag_cache:
            self._tag_cache[key] = is_tagged(proc.pid, self.lease_id)
        return self._tag_cache[key]


@dataclass
class KillReport:
    """What ending a tree did: every PID signalled, and any that outlived SIGKILL."""

    signalled: set[int] = field(default_factory=set)
    killed: set[int] = field(default_factory=set)
    survivors: set[int] = field(default_factory=set)
    seconds: float = 0.0


class _Signaller:
    """Signals processes through pidfds opened only after their start time was checked."""

    def __init__(self) -> None:
        self.fds: dict[tuple[int, int], int] = {}

    def send(self, proc: Proc, sig: int) -> bool:
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


def _reap(members: dict[int, Proc], keep: set[int]) -> None:
    """Collect zombies of the tree that are our own children (orphans we adopted)."""
    me = os.getpid()
    for proc in members.values():
        if proc.dead and proc.ppid == me and proc.pid not in keep:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(proc.pid, os.WNOHANG)


def end_tree(
    tree: Tree,
    grace: float,
    *,
    first_signal: int = signal.SIGTERM,
    hurry: Callable[[], bool] | None = None,
    wake_fds: Iterable[int] = (),
    kill_timeout: float = 5.0,
) -> KillReport:
    """Send ``first_signal`` to every live member, wait up to ``grace``, then SIGKILL the rest.

    Returns early once every member is gone. Members that appear during the grace get the
    signal too. ``hurry()`` returning True (checked whenever ``wake_fds`` wake us) skips the
    rest of the grace. When this returns, no member is alive unless it resisted SIGKILL for
    ``kill_timeout`` seconds (reported in ``survivors``).
    """
    started = time.monotonic()
    report = KillReport()
    if tree.exited_alone():
        report.seconds = time.monotonic() - started
        return report
    sig = _Signaller()
    wake = list(wake_fds)
    try:
        grace_end = started + grace
        while True:
            members = tree.members()
            _reap(members, tree.keep_unreaped)
            alive = {pid: p for pid, p in members.items() if not p.dead}
            if not alive:
                # Nothing of the tree is left to start anything: no second scan needed.
                report.seconds = time.monotonic() - started
                return report
            if tree.group_safe:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(tree.root, first_signal)
            for proc in alive.values():
                if proc.pid not in report.signalled and sig.send(proc, first_signal):
                    report.signalled.add(proc.pid)
                    # A stopped process only acts on SIGTERM once continued.
                    if proc.state == "T" or proc.state == "t":
                        sig.send(proc, signal.SIGCONT)
            now = time.monotonic()
            if now >= grace_end or (hurry is not None and hurry()):
                break
            sig.wait_any(alive, min(grace_end - now, 0.05), wake)
        kill_end = time.monotonic() + kill_timeout
        while True:
            members = tree.members()
            _reap(members, tree.keep_unreaped)
            alive = {pid: p for pid, p in members.items() if not p.dead}
            if not alive:
                break
            if time.monotonic() >= kill_end:
                report.survivors = set(alive)
                log.error("pids %s survived SIGKILL for %.1fs", sorted(alive), kill_timeout)
                break
            if tree.group_safe:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(tree.root, signal.SIGKILL)
            for proc in alive.values():
                if sig.send(proc, signal.SIGKILL):
                    report.killed.add(proc.pid)
            sig.wait_any(alive, 0.01, ())
    finally:
        sig.close()
    report.seconds = time.monotonic() - started
    return report
