"""The RQ worker class: :class:`OvernightWorker`, what ``overnight worker`` runs.

A stop the user asks of a worker is not an unknown outcome: on a warm stop (SIGTERM or
SIGINT) the worker sends its work horse SIGTERM, which ends the step in flight through its
lease and sends the task back to ``queued`` from its checkpoint (:mod:`coordinator.tasks.stop`);
a forced stop (a second signal) sends it SIGTERM again, which skips what is left of the
step's grace, and waits for the horse to record it before the worker goes.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from rq import Queue, Worker
from rq.executions import cleanup_execution
from rq.job import Job, JobStatus

from overnight.config.context import settings as current_settings
from overnight.config.keys import Keys
from overnight.coordinator.dispatch.enqueue import JOB_FUNC
from overnight.coordinator.dispatch.job import HORSE_STOP, text_client
from overnight.coordinator.dispatch.lead import RecoveryLead, lead_ttl
from overnight.coordinator.dispatch.listener import stop_listening
from overnight.coordinator.dispatch.recovery import recover
from overnight.coordinator.report.logs import prune_task_logs, task_log_root
from overnight.coordinator.tasks.store import TaskRefused, TaskStore
from overnight.worker.redisio.clients import STARTUP_WAIT, Backoff, retry_transient, transient
from overnight.worker.supervise.procs import set_dumpable, set_pdeathsig

log = logging.getLogger("overnight.dispatch")
T = TypeVar("T")

# How long a forced stop waits for the work horse to end its step and record it before it
# SIGKILLs the horse (the task's outcome is then unknown, as if the worker had died).
FORCED_WAIT = 15.0
# How often a worker removes the step logs of tasks that retention has forgotten.
LOG_PRUNE_INTERVAL = 3600.0
# The job functions whose work horse's death this worker recovers from.
_JOB_FUNCS = {JOB_FUNC, "overnight.coordinator.dispatch.job.perform_task"}


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when ``parent`` dies, so a killed worker takes
    its work horse (and the in-process supervisor) with it; the step's tree is left to
    its lease and the reaper."""
    if not set_pdeathsig(signal.SIGKILL):
        return
    if os.getppid() != parent:
        os._exit(1)


def _horse_gone(pid: int) -> bool:
    """Whether work horse ``pid`` has exited (reaped here if RQ left it)."""
    try:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            return False
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return True


def _host_ready() -> bool:
    """The step user, the sandbox and this host's folders, as ``overnight worker`` checks
    them first: one that cannot be used ends ``rq worker -w`` with the same one line (and
    exit status). Returns whether steps run sandboxed."""
    from overnight.config.exits import CommandError
    from overnight.coordinator.workspace.hostdirs import prepare_host
    from overnight.worker.sandbox import launch
    from overnight.worker.sandbox.stepuser import configured

    try:
        user = configured()
        sandboxed = launch.configured(user)
        prepare_host(current_settings(), user)
    except CommandError as exc:
        print(f"overnight: {exc.message}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None
    return sandboxed


class OvernightWorker(Worker):
    """An RQ worker for overnight tasks.

    ``rq worker -w overnight.coordinator.dispatch.OvernightWorker`` runs it too.

    It runs a :func:`recover` pass at start, then, while idle, tries for the namespace's
    recovery lead every ``OVERNIGHT_RECOVERY_INTERVAL`` seconds and runs a pass when it
    holds it; its work horse dies with it. A Redis that is away or refuses writes for a while
    (connection loss, OOM at maxmemory, LOADING, MISCONF, READONLY) never ends it: it logs
    once, backs off and goes on where it was.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        set_dumpable(False)  # `rq worker -w ...` does not come through overnight's CLI
        self._sandboxed = _host_ready()  # likewise its folders and sandbox, before any task
        super().__init__(*args, **kwargs)
        self._last_recovery: float | None = None
        self._last_log_prune: float | None = None
        self._lead: RecoveryLead | None = None
        self._forced = False
        self._redis = Backoff(f"worker {self.name}", log)
        self._dropped: list[tuple[Job, int]] = []  # jobs given up on in a stall, their horse

    @property
    def dequeue_timeout(self) -> int:
        interval = math.ceil(current_settings().recovery_interval)
        return max(1, min(int(super().dequeue_timeout), interval))

    @property
    def should_run_maintenance_tasks(self) -> bool:
        return bool(super().should_run_maintenance_tasks) or self._recovery_due()

    def _recovery_due(self) -> bool:
        last = self._last_recovery
        return last is None or time.monotonic() - last >= current_settings().recovery_interval

    def _set_ip_address(self, connection: Any) -> None:
        # RQ names its connection (CLIENT SETNAME, CLIENT INFO) from __init__, outside any
        # loop: a worker made again mid-failover (the old primary gone, no new one named
        # yet) waits for a primary as a starting worker does instead of exiting 69.
        call = partial(super()._set_ip_address, connection)
        retry_transient(call, f"worker {self.name}", log, patience=STARTUP_WAIT, cap=2.0)

    # --- Redis errors are transient: RQ's loop would quit on them ----------------------------
    def _stalled(self, exc: Exception) -> None:
        """A transient Redis error in the work loop: log (once per stall), wait, go on."""
        wait = self._redis.failed(exc)
        deadline = time.monotonic() + wait
        while not self._stop_requested and time.monotonic() < deadline:
            time.sleep(min(0.1, wait))

    def _ride(self, call: Callable[[], T], *, again: bool = False, born: bool = False) -> T | None:
        """``call()`` through a transient Redis error: waited out (logged once per stall),
        then given up (None), or with ``again`` tried again until it succeeds or a stop is
        asked for. With ``born``, a stop asked for during a stall raises the error instead
        (a worker is not left half born). Any other error is raised at once."""
        while True:
            try:
                found = call()
            except Exception as exc:
                if not transient(exc) or (born and self._stop_requested):
                    raise
                self._stalled(exc)
                if again and not self._stop_requested:
                    continue
                return None
            if again:
                self._redis.ok()
            return found

    def check_for_suspension(self, burst: bool) -> None:
        self._ride(partial(super().check_for_suspension, burst))

    def register_birth(self) -> None:
        # A worker (re)started while Redis refuses writes waits instead of dying at birth;
        # RQ registers in one MULTI/EXEC, so a refused try wrote nothing.
        self._ride(super().register_birth, again=True, born=True)
        self._ride(self._record_sandbox, again=True, born=True)

    def _record_sandbox(self) -> None:
        from overnight.worker.sandbox import modes
        from overnight.worker.supervise.procs import hostname

        settings = current_settings()
        mode = modes.BWRAP if self._sandboxed else modes.OFF
        client = text_client(self.connection)
        modes.record(client, Keys(settings.namespace), hostname(), mode, settings.retention)

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        self._ride(partial(super().heartbeat, timeout, pipeline))

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        if self._dropped:
            self._ride(self._release_dropped, again=True)
        dequeue = partial(super().dequeue_job_and_maintain_ttl, timeout, max_idle_time)
        return self._ride(dequeue, again=True)

    def execute_job(self, job: Job, queue: Queue) -> None:
        # The horse ran (or not) and the task's own writes tell which; its claim lapses if
        # nobody holds it, and recovery takes it from there. The job is ended once Redis
        # answers again (:meth:`_release_dropped`).
        try:
            super().execute_job(job, queue)
        except Exception as exc:
            if not transient(exc):
                raise
            self._stalled(exc)
            self._dropped.append((job, self.horse_pid))

    def _release_dropped(self) -> None:
        """End each job given up on in a stall once its horse is gone: its execution
        removed and the job marked failed. It read ``started`` by this worker, alive, which
        recovery takes as running; so a task its horse never claimed (the stall came
        between the dequeue and the claim) was never enqueued again."""
        kept: list[tuple[Job, int]] = []
        for job, pid in self._dropped:
            if pid and not _horse_gone(pid):
                kept.append((job, pid))
                continue
            mine = [e for e in self.executions.values() if e.job_id == job.id]
            with self.connection.pipeline() as pipe:
                for execution in mine:
                    cleanup_execution(self, job, pipe, execution)
                job.set_status(JobStatus.FAILED, pipeline=pipe)
                pipe.execute()
            self.log.warning("worker %s: job %s given up in a Redis stall", self.name, job.id)
            if job.func_name in _JOB_FUNCS and len(job.args) == 3:
                # Its task, if still queued, is due a recovery check now, not a grace on.
                client, keys = text_client(self.connection), Keys(str(job.args[0]))
                store = TaskStore(client, keys, retention=current_settings().retention)
                store.queued_checked([str(job.args[1])], store.now() - store.queued_grace)
        self._dropped = kept

    def teardown(self) -> None:
        try:
            super().teardown()  # type: ignore[no-untyped-call]
        except Exception as exc:
            if not transient(exc):
                raise
            self.log.warning("worker %s: could not unregister: %s", self.name, exc)
        if self._lead is not None:
            self._lead.release()

    def unsubscribe(self) -> None:
        # RQ's own waits on its command listener, up to a minute for an idle worker's stop.
        stop_listening(self)

    def run_maintenance_tasks(self) -> None:
        if super().should_run_maintenance_tasks:
            self._ride(super().run_maintenance_tasks)
        if self._recovery_due():
            self._last_recovery = time.monotonic()
            self.recover_tasks()
        last = self._last_log_prune
        if last is None or time.monotonic() - last >= LOG_PRUNE_INTERVAL:
            self._last_log_prune = time.monotonic()
            self.prune_logs()

    def prune_logs(self) -> list[str]:
        """Remove this host's step logs of tasks retention has forgotten; never raises."""
        settings = current_settings()
        try:
            root = task_log_root(settings, settings.namespace)
            gone = prune_task_logs(
                text_client(self.connection), Keys(settings.namespace), root, settings.retention
            )
        except Exception as exc:
            self.log.warning("step log retention failed: %s: %s", type(exc).__name__, exc)
            return []
        if gone:
            self.log.info("retention: removed the step logs of %d task(s)", len(gone))
        return gone

    def recover_tasks(self) -> list[str]:
        """One recovery pass for this worker's namespace if it holds the recovery lead;
        never raises."""
        settings = current_settings()
        client = text_client(self.connection)
        keys = Keys(settings.namespace)
        first = self._lead is None
        if self._lead is None:
            self._lead = RecoveryLead(client, keys, lead_ttl(settings))
        try:
            # The start-up pass runs whoever leads (a worker started to clear up after a
            # dead one need not wait for the dead one's lead to lapse); later ones need it.
            if not self._lead.hold() and not first:
                return []
            actions = recover(client, self.connection, keys, settings)
        except Exception as exc:
            if transient(exc):
                self._redis.failed(exc)
            else:
                self.log.warning("recovery pass failed: %s: %s", type(exc).__name__, exc)
            return []
        for line in actions:
            self.log.info("recovery: %s", line)
        return actions

    def handle_work_horse_killed(self, job: Job, retpid: int, ret_val: int, rusage: Any) -> None:
        """The horse died under a task (killed, or crashed): recover the task now."""
        super().handle_work_horse_killed(job, retpid, ret_val, rusage)  # type: ignore[no-untyped-call]
        if job.func_name not in _JOB_FUNCS or len(job.args) != 3:
            return
        namespace, task_id, attempt = job.args
        settings = current_settings()
        try:
            client = text_client(self.connection)
            keys = Keys(str(namespace))
            try:
                store = TaskStore(client, keys, retention=settings.retention)
                store.drop_claim(str(task_id), int(attempt), retpid)
            except TaskRefused:
                return  # the claim was not that horse's (any more): nothing to recover
            self.log.warning("task %s: work horse %s died mid-task", task_id, retpid)
            recover(client, self.connection, keys, settings)
        except Exception as exc:
            self.log.warning("task %s: recovery after horse death failed: %s", task_id, exc)

    # --- a stop the user asked for ends the step in flight, recorded as stopped -----------
    def handle_warm_shutdown_request(self) -> None:
        super().handle_warm_shutdown_request()  # type: ignore[no-untyped-call]
        self._signal_horse()

    def request_force_stop(self, signum: int, frame: Any) -> None:
        self._forced = True
        try:
            super().request_force_stop(signum, frame)
        finally:  # RQ ignores a second signal within a second of the first
            self._forced = False

    def kill_horse(self, sig: signal.Signals = signal.SIGKILL) -> None:
        # RQ's forced stop SIGKILLs the horse, which would leave its step's outcome unknown:
        # the horse is asked again first (no grace left) and given time to record the stop.
        if self._forced and sig == signal.SIGKILL and self.horse_pid and self._horse_ends():
            return
        super().kill_horse(sig)

    def fork_work_horse(self, job: Job, queue: Queue) -> None:
        super().fork_work_horse(job, queue)
        if self._stop_requested:  # the stop came as this job was taken: it ends at once
            self._signal_horse()

    def _signal_horse(self) -> bool:
        """SIGTERM to the work horse (never to its process group: the step's tree is the
        horse's to end); False if there is none."""
        pid = self.horse_pid
        if not pid:
            return False
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return False
        self.log.info("worker %s: asked work horse %s to stop its step", self.name, pid)
        return True

    def _horse_ends(self) -> bool:
        """Ask the horse to stop at once; True once it exited (left for RQ to reap), False
        if it did not within FORCED_WAIT seconds."""
        pid = self.horse_pid
        signal.alarm(0)  # RQ's horse-monitor timer must not cut this wait short
        if not self._signal_horse():
            return True
        deadline = time.monotonic() + FORCED_WAIT
        while time.monotonic() < deadline:
            try:
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
            except ChildProcessError:
                return True
            time.sleep(0.05)
        self.log.warning(
            "worker %s: work horse %s did not stop in %.0fs", self.name, pid, FORCED_WAIT
        )
        return False

    def setup_work_horse_signals(self) -> None:
        super().setup_work_horse_signals()  # type: ignore[no-untyped-call]
        HORSE_STOP.install()

    def main_work_horse(self, job: Job, queue: Queue) -> None:
        set_dumpable(False)  # inherited through fork already; a horse holds the secrets too
        _die_with_parent(self.pid or os.getppid())
        super().main_work_horse(job, queue)
