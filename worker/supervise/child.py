"""The supervised child: started as the leader of its own group and session, as the step user
(:mod:`worker.sandbox.stepuser`) and inside its lease's cgroup (:mod:`worker.sandbox.cgroup`)
where the host allows, watched through a pidfd, and ended together with everything it
started: through the cgroup as a whole, or else through ``/proc`` (:mod:`worker.supervise.tree`)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from functools import cache
from typing import TYPE_CHECKING

from overnight.worker.sandbox.cgroup import GATE_WORD, gate_argv
from overnight.worker.sandbox.limits import SYSTEM_PATH
from overnight.worker.supervise import procs, tree
from overnight.worker.supervise.output import Pipes

if TYPE_CHECKING:
    from overnight.worker.sandbox.cgroup import StepGroup
    from overnight.worker.sandbox.stepuser import StepUser
    from overnight.worker.supervise.signals import SignalCatcher

log = logging.getLogger("overnight.supervisor")

# How long members may resist SIGKILL before they are reported as survivors.
KILL_TIMEOUT = 5.0
# How long the group of a child that exited may take to empty by itself before it is
# signalled: a sandbox's init tears the step's namespaces down after the step's exit.
SETTLE = 0.05
# The most stdin data a step gets: a pipe's default buffer, written before the step runs.
PIPE_DATA = 65536

_subreaper_lock = threading.Lock()
_subreaper_users: dict[int, tuple[int, bool]] = {}  # pid -> (steps running, was before)


@contextlib.contextmanager
def subreaper() -> Iterator[None]:
    """Be a child subreaper while at least one step of this process runs, then restore the
    previous state, so a long-lived caller does not collect strangers' orphans for ever."""
    pid = os.getpid()  # a forked horse starts its own count
    with _subreaper_lock:
        count, before = _subreaper_users.get(pid, (0, False))
        if count == 0:
            before = tree.is_child_subreaper()
            if not tree.set_child_subreaper():
                log.warning("host=%s: cannot become a child subreaper", procs.hostname())
        _subreaper_users[pid] = (count + 1, before)
    try:
        yield
    finally:
        with _subreaper_lock:
            count, before = _subreaper_users[pid]
            _subreaper_users[pid] = (count - 1, before)
            if count == 1 and not before:
                tree.set_child_subreaper(False)


@cache
def _setpriv() -> str | None:
    return shutil.which("setpriv", path=SYSTEM_PATH)


def switch_argv(user: StepUser) -> list[str] | None:
    """The ``setpriv`` prefix that runs the rest of the chain as ``user`` (its uid, gid and
    groups, from root), or None without a setpriv in the system folders."""
    program = _setpriv()
    if program is None:
        return None
    groups = ",".join(str(g) for g in user.groups)
    chosen = [f"--groups={groups}"] if groups else ["--clear-groups"]
    return [program, f"--reuid={user.uid}", f"--regid={user.gid}", *chosen, "--"]


def _gate_pipe() -> tuple[int, int]:
    """A pipe for the gate: room for its word and the largest stdin data, so writing both
    never waits on the child."""
    read, write = os.pipe2(os.O_CLOEXEC)
    try:
        if fcntl.fcntl(write, fcntl.F_GETPIPE_SZ) < PIPE_DATA + len(GATE_WORD):
            fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 2 * PIPE_DATA)
    except OSError:
        os.close(read)
        os.close(write)
        raise
    return read, write


def _filled_pipe(data: bytes) -> int:
    """The read end of a pipe holding ``data`` with its write end closed."""
    read, write = os.pipe2(os.O_CLOEXEC)
    try:
        os.write(write, data)
    except OSError:
        os.close(read)
        raise
    finally:
        os.close(write)
    return read


class Child:
    """One started command: its process, a pidfd that polls readable once it exits, its start
    time (clock ticks, for telling a reused PID apart) and its output pipes."""

    def __init__(
        self,
        argv: list[str],
        *,
        cwd: str | None,
        env: dict[str, str],
        on_output: Callable[[bytes], None] | None,
        describe: str,
        stdin_data: bytes | None = None,
        user: StepUser | None = None,
        group: StepGroup | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        """Start ``argv`` with stdin from /dev/null, or from a pipe that already holds all of
        ``stdin_data`` (written before the step's program runs, so it never waits on us); as
        ``user`` if given, inside ``group`` if given (held at a gate until it is moved there,
        so nothing it runs is ever outside it), with ``pass_fds`` inherited; raises OSError
        if it cannot start.

        Nothing runs in the forked child but what the C side of ``subprocess`` does: no
        ``preexec_fn`` and no ``user`` (either makes CPython fork the whole caller, a work
        horse of many MB, where it otherwise uses vfork). The uid switch is ``setpriv`` at
        the head of the launch chain, the cgroup move :meth:`StepGroup.admit` at the gate."""
        if stdin_data is not None and len(stdin_data) > PIPE_DATA:
            raise OSError(f"stdin data of {len(stdin_data)} bytes is too large")
        switch = switch_argv(user) if user is not None else []
        chain = [*(switch or []), *argv]
        as_user = user if switch is None else None  # no setpriv here: the slow, forking way
        gate_fd = -1
        if group is not None:
            chain = gate_argv(chain, stdin_null=stdin_data is None, pwd=env.get("PWD"))
            stdin, gate_fd = _gate_pipe()
        elif stdin_data is not None:
            stdin = _filled_pipe(stdin_data)
        else:
            stdin = subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                chain,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=env,
                start_new_session=True,
                bufsize=0,
                user=as_user.uid if as_user is not None else None,
                group=as_user.gid if as_user is not None else None,
                extra_groups=list(as_user.groups) if as_user is not None else None,
                pass_fds=pass_fds,
            )
        except BaseException:
            if gate_fd >= 0:
                os.close(gate_fd)
            raise
        finally:
            if stdin != subprocess.DEVNULL:
                os.close(stdin)
        self.pid = self.proc.pid
        self.pidfd = -1
        if group is not None:
            self._open_gate(group, gate_fd, stdin_data or b"")
        self.pidfd = os.pidfd_open(self.pid)
        row = tree.read_proc(self.pid)
        self.ticks = row.start if row is not None else None
        assert self.proc.stdout is not None and self.proc.stderr is not None
        sources = {self.proc.stdout.fileno(): 1, self.proc.stderr.fileno(): 2}
        for fd in sources:
            os.set_blocking(fd, False)
        self.pipes = Pipes(sources, on_output, describe)
        self.describe = describe
        self.group = group

    def _open_gate(self, group: StepGroup, gate_fd: int, data: bytes) -> None:
        # Into the group, then "go" (and the stdin data): the step's program runs only now.
        try:
            group.admit(self.pid)
            os.write(gate_fd, GATE_WORD + data)
        except OSError:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.close()
            raise
        finally:
            os.close(gate_fd)

    def _exited(self) -> bool:
        """True once the child has exited (left unreaped)."""
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None and info.si_pid == self.pid

    def exit_status(self) -> tuple[bool, int]:
        """How the exited child ended, leaving it unreaped: (True, exit code) or (False, signal)."""
        info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        assert info is not None
        return info.si_code == os.CLD_EXITED, info.si_status

    def end_tree(
        self, lease_id: str, grace: float, first_signal: int, signals: SignalCatcher | None
    ) -> tree.KillReport:
        """End the child and everything it started, through its cgroup where it has one
        (:meth:`worker.sandbox.cgroup.StepGroup.end`), then through ``/proc``
        (:func:`worker.supervise.tree.end_tree`: the whole path without a cgroup; with one, it only
        collects orphans that came back to us, and ends anything that left the group). A
        further signal to this process while the grace runs skips the rest of it."""
        seen = len(signals.pending) if signals is not None else 0

        def hurry() -> bool:
            if signals is None:
                return False
            signals.drain()
            return len(signals.pending) > seen

        target = tree.Tree(
            root=self.pid,
            root_start=self.ticks,
            lease_id=lease_id,
            adopter=os.getpid(),
            group_safe=self.proc.returncode is None,  # unreaped: its pgid cannot be reused
            keep_unreaped={self.pid},
        )
        wake = [signals.read_fd] if signals is not None else []
        in_group = None
        settle = SETTLE if self._exited() else 0.0
        if self.group is not None:
            in_group = self.group.end(
                grace,
                first_signal=first_signal,
                hurry=hurry,
                wake_fds=wake,
                kill_timeout=KILL_TIMEOUT,
                settle=settle,
            )
            grace, settle = 0.0, 0.0
        report = tree.end_tree(
            target,
            grace,
            first_signal=first_signal,
            hurry=hurry,
            wake_fds=wake,
            kill_timeout=KILL_TIMEOUT,
            settle=settle,
        )
        if in_group is not None:
            report.via_cgroup = True
            report.in_group = in_group.signalled + in_group.killed
            report.survivors |= set(in_group.survivors)
            report.seconds += in_group.seconds
        if report.survivors:
            log.error(
                "%s: %d process(es) of the tree SURVIVED SIGKILL: %s",
                self.describe,
                len(report.survivors),
                sorted(report.survivors),
            )
        if report.signalled or report.killed or report.in_group:
            log.warning(
                "%s: ended %d process(es) of the tree in %.2fs",
                self.describe,
                max(report.in_group, len(report.signalled | report.killed)),
                report.seconds,
            )
        return report

    def reap(self) -> int:
        """Wait for the child itself (its tree already ended); its return code."""
        return self.proc.wait()

    def close(self) -> None:
        """Close the pipes and the pidfd."""
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if self.pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = -1
