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
import logging
import os
import select
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from overnight.worker.redisio.clients import redis_errors
from overnight.worker.supervise.procs import (
    TAG_VAR,
    Proc,
    Signaller,
    is_child_subreaper,
    is_tagged,
    own_children,
    read_proc,
    scan,
    set_child_subreaper,
)

if TYPE_CHECKING:
    import redis

    from overnight.config.keys import Keys

log = logging.getLogger("overnight.tree")
FREEZE_MAX = 1.0

# The plumbing lives in worker.supervise.procs; these names stay importable from here.
__all__ = [
    "TAG_VAR",
    "KillReport",
    "Proc",
    "Tree",
    "end_tree",
    "is_child_subreaper",
    "is_tagged",
    "own_children",
    "read_proc",
    "scan",
    "set_child_subreaper",
]


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
    orphans: dict[int, Proc] = field(default_factory=dict)  # zombies exited_alone found
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
        reap it, and a zombie's own children were handed on before it became one. So if our
        only children are the exited, unreaped root and zombies (others we may have, if they
        started before the root: they cannot descend from it), no descendant lives, and
        group and session members (only descendants can be in them) are gone too. A
        sandbox's pid namespace keeps this true: its first process, which comes back to us
        when bwrap's outer process exits before it, turns zombie only once the kernel has
        ended every other process of the namespace. The zombies are in :attr:`orphans` for
        :func:`end_tree` to reap. What this
        does not cover are processes that never descended from the root but carry its tag
        (started on its behalf by some other process); the full scan still looks for tags
        whenever the root is alive, we are not a subreaper, or a live orphan came back to us.
        """
        if self.adopter is None or self.adopter != os.getpid() or not is_child_subreaper():
            return False
        try:
            info = os.waitid(os.P_PID, self.root, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        late = self._late_children() if info is not None else None
        if late is None or any(not row.dead for row in late.values()):
            return False
        self.orphans = late
        return True

    def _late_children(self) -> dict[int, Proc] | None:
        """Our children but the root that started no earlier than it (None: /proc cannot
        tell, or the root is not among them)."""
        children = own_children()
        if children is None or self.root not in children:
            return None
        late: dict[int, Proc] = {}
        for pid in children - {self.root}:
            row = read_proc(pid)
            if row is not None and (self.root_start is None or row.start >= self.root_start):
                late[pid] = row
        return late

    def settle(self, seconds: float, wake_fds: Iterable[int] = ()) -> None:
        """Give the root's live late children (a sandbox's first process tearing its
        namespaces down after bwrap's outer process exited) up to ``seconds`` to exit by
        themselves; returns early when one of ``wake_fds`` wakes."""
        end = time.monotonic() + seconds
        while (now := time.monotonic()) < end:
            late = self._late_children()
            alive = [pid for pid, row in (late or {}).items() if not row.dead]
            if not alive:
                return
            poller = select.poll()
            opened = []
            try:
                for pid in alive:
                    with contextlib.suppress(OSError):
                        opened.append(os.pidfd_open(pid))
                        poller.register(opened[-1], select.POLLIN)
                for fd in wake_fds:
                    poller.register(fd, select.POLLIN)
                if any(fd not in opened for fd, _ in poller.poll(max(1, int((end - now) * 1000)))):
                    return
            finally:
                for fd in opened:
                    os.close(fd)

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
    via_cgroup: bool = False  # the tree was ended through its cgroup first
    in_group: int = 0  # processes the cgroup's end signalled or killed


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
    settle: float = 0.0,
) -> KillReport:
    """Send ``first_signal`` to every live member, wait up to ``grace``, then SIGKILL the rest.

    Returns early once every member is gone. Members that appear during the grace get the
    signal too. ``hurry()`` returning True (checked whenever ``wake_fds`` wake us) skips the
    rest of the grace. When this returns, no member is alive unless it resisted SIGKILL for
    ``kill_timeout`` seconds (reported in ``survivors``). ``settle``: seconds the exited
    root's late children may first take to exit by themselves (:meth:`Tree.settle`).
    """
    started = time.monotonic()
    report = KillReport()
    if settle > 0:
        tree.settle(settle, wake_fds)
    if tree.exited_alone():
        _reap(tree.orphans, tree.keep_unreaped)
        report.seconds = time.monotonic() - started
        return report
    sig = Signaller()
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
        _freeze_and_kill(tree, sig, report, kill_timeout)
    finally:
        sig.close()
    report.seconds = time.monotonic() - started
    return report


def _freeze_and_kill(tree: Tree, sig: Signaller, report: KillReport, timeout: float) -> None:
    """SIGSTOP every member, rescanning until a scan finds none that is not stopped yet (a
    stopped process cannot fork, so pid hopping ends here), then SIGKILL them all; repeat
    until none is alive, or report who resisted for ``timeout`` seconds."""
    kill_end = time.monotonic() + timeout
    # Freezing stops at the fixed point, or after this long (a member that keeps spawning
    # faster than we scan still gets SIGKILL, repeatedly).
    freeze_end = time.monotonic() + min(timeout, FREEZE_MAX)
    stopped: set[tuple[int, int]] = set()
    while True:
        members = tree.members()
        _reap(members, tree.keep_unreaped)
        alive = {pid: p for pid, p in members.items() if not p.dead}
        if not alive:
            return
        late = time.monotonic() >= kill_end
        fresh = [p for p in alive.values() if (p.pid, p.start) not in stopped]
        if fresh and not late and time.monotonic() < freeze_end:
            if tree.group_safe:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(tree.root, signal.SIGSTOP)
            for proc in fresh:
                if sig.send(proc, signal.SIGSTOP):
                    stopped.add((proc.pid, proc.start))
            continue  # rescan at once: whatever forked before its stop shows up now
        if tree.group_safe:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(tree.root, signal.SIGKILL)
        for proc in alive.values():
            if sig.send(proc, signal.SIGKILL):
                report.killed.add(proc.pid)
        if late:
            sig.wait_any(alive, 0.05, ())
            left = {pid for pid, p in tree.members().items() if not p.dead}
            report.survivors = left
            if left:
                log.error("pids %s survived SIGKILL for %.1fs", sorted(left), timeout)
            return
        sig.wait_any(alive, 0.01, ())


def record_survivors(
    client: redis.Redis,
    keys: Keys,
    report: KillReport,
    *,
    lease_id: str,
    host: str,
    task_id: str | None,
) -> None:
    """Log and record (a ``survivors`` receipt) the processes that outlived a lease's end."""
    # Loudly, and on the record: the morning-after view must show a tree that did not die.
    log.error(
        "lease=%s host=%s task=%s: %d process(es) SURVIVED the end of the lease: %s",
        lease_id,
        host,
        task_id,
        len(report.survivors),
        sorted(report.survivors),
    )
    from overnight.worker.redisio import (
        receipts,  # pydantic: not on the fast path of every step
    )

    try:
        receipts.emit(
            client,
            keys,
            receipts.SURVIVORS,
            lease_id=lease_id,
            task_id=task_id,
            pids=sorted(report.survivors),
            via="cgroup" if report.via_cgroup else "proc",
        )
    except redis_errors() as exc:
        log.error("lease=%s host=%s: cannot record the survivors: %s", lease_id, host, exc)
