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
:mod:`overnight.worker.supervise.tree`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import select
import shlex
import signal
import time
from collections.abc import Callable, Iterable
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
    signalled: int = 0  # members that got the first signal (see StepGroup.end)


# The gate: the first program of a step started in a group. It waits for one line "go" on
# its stdin, sent once the supervisor has moved it into the group, then executes the step
# (stdin /dev/null, or what follows "go" on the pipe). An end of file (the supervisor died)
# runs nothing. dash exports PWD: taken back out, or put back as it was.
GATE = "/bin/sh"
GATE_WORD = b"go\n"
GATE_REFUSED = 125


def gate_argv(argv: list[str], *, stdin_null: bool, pwd: str | None) -> list[str]:
    """``argv`` behind the gate (:data:`GATE`): run once the gate hears :data:`GATE_WORD`,
    with stdin from /dev/null if ``stdin_null``; ``pwd`` is the step environment's PWD."""
    keep = "unset PWD" if pwd is None else f"PWD={shlex.quote(pwd)}; export PWD"
    run = 'exec "$@" </dev/null' if stdin_null else 'exec "$@"'
    script = f'IFS= read -r go && [ "$go" = go ] || exit {GATE_REFUSED}; {keep}; {run}'
    return [GATE, "-c", script, "overnight-gate", *argv]


class StepGroup:
    """One lease's cgroup. A step is started behind the gate (:func:`gate_argv`) and moved
    in by :meth:`admit` before the gate lets it run; everything it starts stays in it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._procs_fd = os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)

    def admit(self, pid: int) -> None:
        """Move the process ``pid`` (a child of ours, held at its gate) into the group.
        cgroup v2 checks the opener's credentials: our handle moves a child of any user."""
        os.write(self._procs_fd, str(pid).encode())

    def enter(self) -> None:
        """Move the calling process into the group (async-signal-safe: usable between
        fork and exec)."""
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

    def _open_events(self) -> int:
        try:
            return os.open(self.path / "cgroup.events", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return -1

    def _populated(self, events: int) -> bool:
        if events < 0:
            return self.populated()
        try:
            return b"populated 1" in os.pread(events, 256, 0)
        except OSError:
            return False

    def signal_all(self, sig: int, skip: set[int] | frozenset[int] = frozenset()) -> set[int]:
        """Send ``sig`` to every member not in ``skip`` (through pidfds; a member is whoever
        is in the group when the pidfd is checked); the pids signalled."""
        sent: set[int] = set()
        for pid in self.pids():
            if pid in skip:
                continue
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if pid in self.pids():  # still ours once pinned by the pidfd
                    signal.pidfd_send_signal(fd, sig)
                    sent.add(pid)
                    if sig == signal.SIGTERM:
                        signal.pidfd_send_signal(fd, signal.SIGCONT)
            except OSError:
                pass
            finally:
                os.close(fd)
        return sent

    def end(
        self,
        grace: float,
        *,
        first_signal: int = signal.SIGTERM,
        hurry: Callable[[], bool] | None = None,
        wake_fds: Iterable[int] = (),
        kill_timeout: float = 5.0,
        settle: float = 0.0,
    ) -> EndReport:
        """End the group: ``first_signal`` to every member (and to members that appear
        meanwhile), up to ``grace`` seconds for them to go, then :meth:`kill`. ``hurry()``
        returning True (checked whenever ``wake_fds`` wake us) skips the rest of the grace.
        ``settle``: seconds the group may first take to empty by itself (a step that exited
        leaves its sandbox's init tearing its namespaces down for a few milliseconds)."""
        started = time.monotonic()
        if not self.populated():
            return EndReport(seconds=time.monotonic() - started)
        signalled: set[int] = set()
        poller = select.poll()
        for fd in wake_fds:
            poller.register(fd, select.POLLIN)
        # cgroup.events polls POLLPRI when "populated" changes: the last member's exit wakes
        # us at once (re-read through the same handle, which re-arms it).
        events = self._open_events()
        if events >= 0:
            poller.register(events, select.POLLPRI)
        settled = started + settle
        while self._populated(events) and (now := time.monotonic()) < settled:
            if hurry is not None and hurry():
                break
            poller.poll(max(1, int(min(settled - now, 0.01) * 1000)))
        grace_end = time.monotonic() + grace
        try:
            while self._populated(events):
                signalled |= self.signal_all(first_signal, skip=signalled)
                now = time.monotonic()
                if now >= grace_end or (hurry is not None and hurry()):
                    break
                poller.poll(max(1, int(min(grace_end - now, 0.01) * 1000)))
        finally:
            if events >= 0:
                os.close(events)
        report = self.kill(kill_timeout) if self.populated() else EndReport()
        report.signalled = len(signalled)
        report.seconds = time.monotonic() - started
        return report

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
                log.error(
                    "cgroup %s: %d process(es) survived SIGKILL for %.1fs: %s",
                    self.path,
                    len(report.survivors),
                    timeout,
                    list(report.survivors),
                )
                break
            sleep(0.005)
        report.seconds = time.monotonic() - started
        return report

    def remove_handle(self) -> None:
        """Close our handle on the group, leaving the group as it is."""
        with contextlib.suppress(OSError):
            os.close(self._procs_fd)
        self._procs_fd = -1

    def remove(self) -> None:
        """Close our handle and remove the (empty) directory; a group that still has members
        is left for the reaper and logged."""
        self.remove_handle()
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("cgroup %s: cannot remove: %s", self.path, exc)
            return
        with contextlib.suppress(OSError):  # the namespace's folder, once its last lease went
            self.path.parent.rmdir()

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
    for attempt in range(3):
        try:
            path.mkdir(parents=True, exist_ok=False)
            break
        except FileExistsError:
            log.error("cgroup %s exists already: not reusing another lease's container", path)
            return None
        except FileNotFoundError:  # another lease removed the namespace's folder meanwhile
            if attempt == 2:
                return None
        except OSError as exc:
            _unavailable(path, exc)
            return None
    try:
        return StepGroup(path)
    except OSError:
        with contextlib.suppress(OSError):
            path.rmdir()
        return None


def holds_limits(namespace: str) -> bool:
    """True if a lease's container under ``namespace`` would get the ``pids`` or ``memory``
    controller (its parent enables one for its children), so the step's limits could be
    the kernel's. Only then does a sandboxed step get a container: its pid namespace
    already ends its tree as a whole (the kernel kills every process of a namespace whose
    first process exits), and moving a process into a cgroup costs a step milliseconds."""
    path = group_path(namespace, "_")
    if path is None:
        return False
    try:
        enabled = (path.parent / "cgroup.subtree_control").read_text().split()
    except OSError:
        return False
    return "pids" in enabled or "memory" in enabled


_said: set[str] = set()


def _unavailable(path: Path, exc: OSError) -> None:
    # Once per process, and only where containers were expected (root): say why the /proc
    # path is all there is (a container's read-only /sys/fs/cgroup, say).
    if os.geteuid() == 0 and "unavailable" not in _said:
        _said.add("unavailable")
        log.warning(
            "cannot make step cgroups under %s (%s): trees are ended through /proc only",
            path.parent.parent,
            exc.strerror,
        )


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
