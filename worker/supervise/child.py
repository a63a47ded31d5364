"""The supervised child: started as the leader of its own group and session, as the step user
(:mod:`worker.sandbox.stepuser`) and inside its lease's cgroup (:mod:`worker.sandbox.cgroup`)
where the host allows, watched through a pidfd, and ended together with everything it
started: through the cgroup as a whole, or else through ``/proc`` (:mod:`worker.supervise.tree`)."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from overnight.worker.supervise import procs, tree
from overnight.worker.supervise.output import Pipes

if TYPE_CHECKING:
    from overnight.worker.sandbox.cgroup import StepGroup
    from overnight.worker.sandbox.stepuser import StepUser
    from overnight.worker.supervise.signals import SignalCatcher

log = logging.getLogger("overnight.supervisor")

# How long members may resist SIGKILL before they are reported as survivors.
KILL_TIMEOUT = 5.0

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


def _filled_pipe(data: bytes) -> int:
    """The read end of a pipe holding ``data`` with its write end closed."""
    if len(data) > 65536:  # a pipe's buffer: more would block us before the child reads
        raise OSError(f"stdin data of {len(data)} bytes is too large")
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
        ``stdin_data`` (written and closed before the child starts, so it never waits on
        us); as ``user`` if given, inside ``group`` if given (moved there between fork and
        exec, so nothing it runs is ever outside it), with ``pass_fds`` inherited; raises
        OSError if it cannot start."""
        stdin: int = subprocess.DEVNULL
        if stdin_data is not None:
            stdin = _filled_pipe(stdin_data)
        try:
            # The group's cgroup.procs was opened by us (root): cgroup v2 checks the opener's
            # credentials, so the move works after the switch to the step user.
            self.proc = subprocess.Popen(
                argv,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=env,
                start_new_session=True,
                bufsize=0,
                preexec_fn=group.enter if group is not None else None,
                user=user.uid if user is not None else None,
                group=user.gid if user is not None else None,
                extra_groups=list(user.groups) if user is not None else None,
                pass_fds=pass_fds,
            )
        finally:
            if stdin_data is not None:
                os.close(stdin)
        self.pid = self.proc.pid
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
        if self.group is not None:
            in_group = self.group.end(
                grace,
                first_signal=first_signal,
                hurry=hurry,
                wake_fds=wake,
                kill_timeout=KILL_TIMEOUT,
            )
            grace = 0.0
        report = tree.end_tree(
            target,
            grace,
            first_signal=first_signal,
            hurry=hurry,
            wake_fds=wake,
            kill_timeout=KILL_TIMEOUT,
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
