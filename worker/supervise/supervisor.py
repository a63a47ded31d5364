"""Running one command under one lease: beats, lapse detection, fail-closed, and the tree kill.

The loop waits on everything at once (``select.poll``): the child's pidfd, its output pipes,
the beat channel's socket, the signal wakeup pipe, and a timer for the next moment the
lease could lapse, a beat is due or a Redis retry is due. Nothing here polls by sleeping.
Usable in-process (an RQ work horse) and from ``overnight supervise`` (signal handlers only
when asked); the parts are the package's other modules (see its docstring)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from overnight.config.keys import Keys
from overnight.worker.beat.channel import Beat, Channel
from overnight.worker.gateway import grant as gateway_grant
from overnight.worker.lease import file as leasefile
from overnight.worker.lease import proof
from overnight.worker.lease.store import LeaseRefused, Leases
from overnight.worker.redisio.clients import (
    client_for_url,
    io_timeout,
    redis_errors,
    supervisor_client,
    url_of,
)
from overnight.worker.sandbox import cgroup, stepenv, stepuser
from overnight.worker.supervise import outcome, procs, tree
from overnight.worker.supervise.child import Child, subreaper
from overnight.worker.supervise.keeper import Keeper
from overnight.worker.supervise.limitwatch import Guard
from overnight.worker.supervise.outcome import Outcome
from overnight.worker.supervise.signals import FORWARDED, SignalCatcher
from overnight.worker.supervise.spec import StepSpec, SupervisedResult, prepare_sandbox, serialized

if TYPE_CHECKING:
    import redis

    from overnight.worker.supervise.spec import Served

log = logging.getLogger("overnight.supervisor")


def run_supervised(
    client: redis.Redis,
    keys: Keys,
    spec: StepSpec,
    on_output: Callable[[bytes], None] | None = None,
    *,
    signals: SignalCatcher | None = None,
) -> SupervisedResult:
    """Run ``spec.argv`` under a new lease and block until the step and its tree have ended.
    ``on_output`` gets every output line of the child (stdout and stderr, bytes, with its
    line ending); None passes output through to this process's stdout/stderr as it comes.
    ``signals`` is an already installed :class:`SignalCatcher` (the CLI installs one first
    thing). Raises :class:`~worker.lease.store.LeaseRefused` if ``spec.lease_id`` exists and
    redis errors if Redis is unreachable before the child starts; after that, every end is a
    result (contract section 2's table)."""
    own = None
    if signals is None and spec.install_signals:
        own = signals = SignalCatcher.install()
    try:
        return _Run(client, keys, spec, on_output, signals).run()
    finally:
        if own is not None:
            own.close()


class _Run:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        spec: StepSpec,
        on_output: Callable[[bytes], None] | None,
        signals: SignalCatcher | None,
    ) -> None:
        if not spec.argv:
            raise ValueError("argv is empty")
        if not (spec.gap > 0 and spec.deadline > 0 and spec.grace >= 0):
            raise ValueError("gap and deadline must be > 0 and grace >= 0")
        self.client = supervisor_client(client, spec.gap)
        self.keys = keys
        self.spec = spec
        self.on_output = serialized(on_output)
        self.signals = signals
        self.leases = Leases(self.client, keys)
        self.host = procs.hostname()
        self.child: Child | None = None
        self.channel: Channel | None = None
        self.home: str | None = None
        self.group: cgroup.StepGroup | None = None
        self.note: str | None = None  # a note from the step not yet written
        self.note_at = 0.0
        self.keeper: Keeper
        self.lease_id = ""
        self.gateway_token: str | None = None
        self.watch: leasefile.LeaseFileWatch | None = None
        self.opened: list[Served] = []  # served to the sandbox until the step ends

    def run(self) -> SupervisedResult:
        started = time.monotonic()
        spec = self.spec
        doc = self.leases.acquire(
            budget_sec=spec.deadline,
            gap_sec=spec.gap,
            lease_id=spec.lease_id,
            supervisor_pid=os.getpid(),
            task_id=spec.task_id,
            note=spec.note,
        )
        self.lease_id = doc.lease_id
        self.keeper = Keeper(
            self.leases,
            doc,
            gap=spec.gap,
            deadline=spec.deadline,
            beat_while_alive=spec.beat_while_alive,
            host=self.host,
            now=started,
        )
        leasefile.mirror(self.spec.lease_file, doc, self.watch, host=self.host)
        log.info("lease=%s host=%s task=%s: acquired", self.lease_id, self.host, spec.task_id)
        with subreaper():
            try:
                return self._finish(self._start_and_wait(), started)
            except BaseException as exc:
                # Whatever went wrong here, the tree must not outlive the step.
                self._abort(exc)
                raise
            finally:
                proof.remove(self.keys.namespace, self.lease_id)
                self._close_step_env()

    def _start_and_wait(self) -> Outcome:
        early = self._pending_signal()
        if early is not None:
            return self._signal_outcome(early)
        spec = self.spec
        if spec.user is not None and spec.cwd is not None:
            problem = stepuser.workdir_problem(spec.cwd, spec.user)
            if problem is not None:
                return self._refuse_start(f"the step user cannot use the workdir: {problem}")
        try:
            self.channel = Channel(self.lease_id)
            if not spec.sandbox:
                self.home = stepenv.make_home(self.lease_id, spec.user, spec.home_files)
            if spec.contain and (not spec.sandbox or cgroup.holds_limits(self.keys.namespace)):
                self.group = cgroup.create(self.keys.namespace, self.lease_id)
            env = stepenv.step_environment(
                os.environ,
                spec.env,
                lease_id=self.lease_id,
                task_id=spec.task_id,
                home=self.home,
                channel=self.channel.environment(),
                gateway=self._gateway_env(),
            )
            argv, user, ready = spec.argv, spec.user, None
            guard = Guard(spec)
            if spec.sandbox:
                ready, self.opened = prepare_sandbox(
                    spec, env, self.lease_id, guard.limits.disk, self.on_output
                )
                argv, env, user = ready.argv, ready.env, None  # setpriv takes the uid
            argv = guard.launch(argv, self.home, ready, self.group)
            try:
                self.child = Child(
                    argv,
                    cwd=spec.cwd,
                    env=env,
                    on_output=self.on_output,
                    describe=f"lease={self.lease_id} host={self.host}",
                    stdin_data=spec.stdin_data,
                    user=user,
                    group=self.group,
                    pass_fds=ready.pass_fds if ready is not None else (),
                )
            finally:
                if ready is not None:
                    ready.close()
        except OSError as exc:
            return self._refuse_start(f"cannot start {spec.argv[0]!r}: {exc}", exc)
        proof.write(
            self.keys.namespace,
            self.lease_id,
            self.keeper.token,
            self.child.pid,
            self.child.ticks,
            self.group.path if self.group else None,
        )
        self.keeper.attach(self.child.pid, self.child.ticks)
        self.keeper.limits = guard.attach(self.child.pid, self.child.ticks, self.lease_id)
        leasefile.mirror(self.spec.lease_file, self.keeper.doc, self.watch, host=self.host)
        if spec.lease_file:  # the child may beat by rewriting it (worker.lease.file)
            every, seen = self.keeper.min_interval, self.keeper.doc.public()
            self.watch = leasefile.LeaseFileWatch(spec.lease_file, every, seen, time.monotonic())
        return self._loop(self.child)

    def _loop(self, child: Child) -> Outcome:
        keeper, pipes = self.keeper, child.pipes
        poller = select.poll()
        poller.register(child.pidfd, select.POLLIN)
        if self.signals is not None:
            poller.register(self.signals.read_fd, select.POLLIN)
        pipes.attach(poller)
        channel = self.channel
        assert channel is not None
        channel.attach(poller, child.pid, child.ticks)
        while True:
            wake = keeper.next_wake()
            if self.note is not None:
                wake = min(wake, self.note_at)
            if self.watch is not None:
                wake = min(wake, self.watch.next_check)
            events = poller.poll(math.ceil(max(0.0, wake - time.monotonic()) * 1000))
            fds = {fd for fd, _ in events}
            if child.pidfd in fds:
                return outcome.child_ended(*child.exit_status())
            if self.signals is not None and self.signals.read_fd in fds:
                self.signals.drain()
                sig = self._pending_signal()
                if sig is not None:
                    return self._signal_outcome(sig)
            for fd, mask in events:
                if pipes.handles(fd) and pipes.event(fd, mask) and self.spec.output_beats:
                    keeper.beat_pending = True
                elif channel.handles(fd):
                    for beat in channel.event(fd, self._answer):
                        keeper.beat_pending = True
                        if beat.note is not None:
                            self.note = beat.note
            asked = self.watch.poll(time.monotonic()) if self.watch is not None else None
            if asked is not None:
                keeper.beat_pending = keeper.beat_pending or asked.beat
                self.note = asked.note if asked.note is not None else self.note
            if self.note is not None and time.monotonic() >= self.note_at:
                self._write_note()
            ended = keeper.tick(time.monotonic())
            if ended is not None:
                return ended

    def _refuse_start(self, why: str, exc: OSError | None = None) -> Outcome:
        line = f"overnight: lease={self.lease_id} host={self.host}: {why}"
        log.warning("%s", line)
        if self.on_output is not None:  # the step's own log says why, not only ours
            self.on_output(line.encode() + b"\n")
        return outcome.not_started(exc or PermissionError(13, why))

    def _answer(self, _beat: Beat) -> float:
        # Seconds a step that stays silent from now still has.
        now = time.monotonic()
        return max(0.0, min(now + self.spec.gap, self.keeper.deadline_at) - now)

    def _write_note(self) -> None:
        note, self.note = self.note, None
        assert note is not None
        try:
            self.leases.set_note(self.lease_id, self.keeper.token, note)
        except LeaseRefused as exc:  # the lease is ending: the keeper finds out and says why
            log.warning("lease=%s host=%s: note refused: %s", self.lease_id, self.host, exc.reason)
        except redis_errors():
            if self.note is None:  # a newer note replaces this one
                self.note = note
        self.note_at = time.monotonic() + self.keeper.min_interval

    def _gateway_env(self) -> dict[str, str] | None:
        # A per-lease token, revoked with the step; the keeper watches what the gateway saw.
        grant = self.spec.grant
        if grant is None:
            return None
        socket = self.spec.gateway_socket if self.spec.sandbox else None
        # Waited for well within the lease's gap: no beat renews it yet.
        wait = min(gateway_grant.GATEWAY_WAIT, self.spec.gap / 2)
        problem = gateway_grant.awaited_problem(grant.base_url, socket, wait)
        if problem is not None:  # never a token for whatever holds the gateway's place
            raise PermissionError(13, f"the gateway cannot be trusted: {problem}")
        ttl = self.spec.deadline + self.spec.gap + 60
        self.gateway_token, env = gateway_grant.mint(
            self.client, self.keys, self.lease_id, self.keeper.token, grant, ttl, self.spec.gap
        )
        self.keeper.gateway = gateway_grant.watch(self.client, self.keys, self.lease_id)
        return env

    def _close_step_env(self) -> None:
        if self.gateway_token is not None:
            with contextlib.suppress(*redis_errors()):  # else its TTL ends it
                gateway_grant.revoke(self.client, self.keys, self.lease_id, self.gateway_token)
            self.gateway_token = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        while self.opened:
            self.opened.pop().close()
        if self.home is not None:
            stepenv.remove_home(self.home)
            self.home = None
        if self.group is not None:
            self.group.remove()  # a group that still has members is left to the reaper
            self.group = None

    def _pending_signal(self) -> int | None:
        pending = self.signals.pending if self.signals is not None else []
        return pending[0] if pending else None

    def _signal_outcome(self, sig: int) -> Outcome:
        log.warning(
            "lease=%s host=%s: got signal %d; ending the tree", self.lease_id, self.host, sig
        )
        return outcome.by_signal(sig)

    # --- the end ----------------------------------------------------------------------------

    def _kill_tree(self, ended: Outcome) -> tree.KillReport | None:
        if self.child is None:
            return None
        report = self.child.end_tree(
            self.lease_id, self.spec.grace, ended.first_signal, self.signals
        )
        if report.survivors:
            tree.record_survivors(
                self.client,
                self.keys,
                report,
                lease_id=self.lease_id,
                host=self.host,
                task_id=self.spec.task_id,
            )
        return report

    def _finish(self, ended: Outcome, started: float) -> SupervisedResult:
        child = self.child
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if child is not None:
            child.pipes.drain(0.0)
        report = self._kill_tree(ended)
        returncode = None
        if child is not None:
            returncode = child.reap()
            child.pipes.drain(0.5)
            child.close()
        ended_here, ended, doc = self.keeper.end(ended)
        leasefile.mirror(self.spec.lease_file, doc, self.watch, host=self.host)
        self._close_step_env()  # after the end is written: a big scratch HOME takes a while
        log.info(
            "lease=%s host=%s task=%s: ended %s/%s, exit %d",
            self.lease_id,
            self.host,
            self.spec.task_id,
            doc.status,
            doc.note,
            ended.exit_code,
        )
        return SupervisedResult(
            exit_code=ended.exit_code,
            doc=doc,
            reason=ended.note,
            returncode=returncode,
            lease_lost=ended.lost,
            ended_here=ended_here,
            seconds=time.monotonic() - started,
            kill=report,
        )

    def _abort(self, exc: BaseException) -> None:
        log.error(
            "lease=%s host=%s: supervisor failed (%s: %s); ending the tree",
            self.lease_id,
            self.host,
            type(exc).__name__,
            exc,
        )
        with contextlib.suppress(Exception):
            ended = outcome.aborted(exc)
            self._kill_tree(ended)
            if self.child is not None:
                self.child.reap()
                self.child.close()
            self.leases.end(self.lease_id, self.keeper.token, "killed", ended.note, exit_code=1)


__all__ = [
    "FORWARDED",
    "SignalCatcher",
    "StepSpec",
    "SupervisedResult",
    "client_for_url",
    "io_timeout",
    "run_supervised",
    "url_of",
]
