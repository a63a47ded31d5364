"""Tasks on RQ: enqueueing, the job function, recovery of tasks whose worker died, the worker.

One RQ job runs one attempt of one task (job id ``<task>-<run>-<attempt>``). A job only
runs if its attempt is the task's current one and the task is queued, so a duplicate or
stale job is harmless. A worker that dies stops renewing the task's claim; a recovery
pass (:func:`recover`) then re-queues the task from its checkpoint, or pauses it when the
step in flight had an unknown outcome. A pass reads the recovery index (claim expiries,
queued tasks due a check), so its cost follows what changed, not how many tasks there are;
it runs in the one process of the namespace that holds the recovery lead
(:class:`RecoveryLead`): an :class:`OvernightWorker` or the coordinator.

A stop the user asks of a worker is not an unknown outcome: on a warm stop (SIGTERM or
SIGINT) the worker sends its work horse SIGTERM, which ends the step in flight through its
lease and sends the task back to ``queued`` from its checkpoint (:mod:`coordinator.tasks.stop`);
a forced stop (a second signal) sends it SIGTERM again, which skips what is left of the
step's grace, and waits for the horse to record it before the worker goes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
from rq import Queue, Worker
from rq.job import Job, JobStatus

# Imported here so a forked work horse finds them loaded and starts each task at once.
from overnight.config.context import settings as current_settings
from overnight.config.keys import Keys
from overnight.config.settings import gateway_base
from overnight.coordinator.dispatch.rerun import step_may_run
from overnight.coordinator.report.logs import prune_task_logs, task_log_root
from overnight.coordinator.tasks.judge import expired, lost_step
from overnight.coordinator.tasks.loop import CallRefused, Consume, LoopConfig, TaskLoop
from overnight.coordinator.tasks.states import QUEUED
from overnight.coordinator.tasks.steps import (
    StepOutcome,
    StepRequest,
    StepRunner,
    supervised_runner,
)
from overnight.coordinator.tasks.store import (
    Runner,
    TaskCorrupt,
    TaskRecord,
    TaskRefused,
    TaskStore,
    server_time,
)
from overnight.worker.envelope.envelope import CallEnvelope, EnvelopeEmpty
from overnight.worker.redisio import receipts
from overnight.worker.redisio.clients import Backoff, transient
from overnight.worker.supervise.procs import hostname, set_pdeathsig

if TYPE_CHECKING:
    from overnight.config.settings import Settings

log = logging.getLogger("overnight.dispatch")

# redis-py reads package metadata for every new connection (about 1.5 ms); a work horse
# opens several per task, and the installed version cannot change under a running worker.
redis.utils.get_lib_version = functools.cache(redis.utils.get_lib_version)

# RQ's own job timeout is the task's deadline plus this, so the task's deadline fires first.
JOB_MARGIN = 120
# How many ended leases a pass looks at for retention (oldest first).
LEASE_PRUNE_BATCH = 1000
# How long a forced stop waits for the work horse to end its step and record it before it
# SIGKILLs the horse (the task's outcome is then unknown, as if the worker had died).
FORCED_WAIT = 15.0
# How often a worker removes the step logs of tasks that retention has forgotten.
LOG_PRUNE_INTERVAL = 3600.0
_TEXT_CLIENTS: dict[int, redis.Redis] = {}
_TMP = tempfile.gettempdir()  # probed once here, not in every work horse


def text_client(conn: redis.Redis) -> redis.Redis:
    """A ``decode_responses=True`` client on the same server, user and TLS as ``conn``."""
    found = _TEXT_CLIENTS.get(id(conn))
    if found is None:
        pool = conn.connection_pool
        # driver_info=None: no CLIENT SETINFO round trips on each of a work horse's connects.
        kwargs = {**pool.connection_kwargs, "decode_responses": True, "driver_info": None}
        found = redis.Redis(
            connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
        )
        _TEXT_CLIENTS[id(conn)] = found
    return found


def job_timeout(rec: TaskRecord, now: float) -> int:
    """Seconds RQ lets the job run: what is left of the task's deadline at ``now`` (Redis
    server time), plus a margin."""
    left = rec.spec.deadline
    if rec.started_unix is not None:
        left -= now - rec.started_unix
    return math.ceil(max(left, 1.0)) + JOB_MARGIN


def enqueue(
    rq_conn: redis.Redis,
    records: Sequence[TaskRecord],
    namespace: str,
    now: float | None = None,
    *,
    retention: int | None = None,
) -> list[str]:
    """Put one RQ job per record (its current attempt) on the record's queue; returns job ids.

    ``now`` is Redis server time (read here if not given). The job and its result are kept
    ``retention`` seconds once it ends (``OVERNIGHT_RETENTION`` unless given)."""
    if now is None:
        now = server_time(rq_conn)
    if retention is None:
        retention = current_settings().retention
    by_queue: dict[str, list[Any]] = {}
    for rec in records:
        data = Queue.prepare_data(
            perform_task,
            args=(namespace, rec.id, rec.attempt),
            timeout=job_timeout(rec, now),
            result_ttl=retention,
            failure_ttl=retention,
            description=f"overnight task {rec.id} attempt {rec.attempt} [{namespace}]",
            job_id=rec.job_id(),
        )
        by_queue.setdefault(rec.queue, []).append(data)
    ids: list[str] = []
    for name, datas in by_queue.items():
        queue = Queue(name, connection=rq_conn)
        with rq_conn.pipeline() as pipe:
            jobs = queue.enqueue_many(datas, pipeline=pipe)
            pipe.execute()
        ids += [job.id for job in jobs]
    return ids


def model_env(settings: Settings) -> dict[str, str]:
    """The model settings the built-in model step needs, passed to it alone."""
    env = {
        "OVERNIGHT_MODEL_NAME": settings.model_name,
        "OVERNIGHT_MODEL_TIMEOUT": repr(settings.model_timeout),
    }
    if settings.model_url:
        env["OVERNIGHT_MODEL_URL"] = settings.model_url
    if settings.model_api_key:
        env["OVERNIGHT_MODEL_API_KEY"] = settings.model_api_key.get_secret_value()
    return env


def gateway_wanted(settings: Settings) -> bool:
    """A host runs a gateway (and steps get its token) once an upstream is configured."""
    return bool(settings.model_url or settings.anthropic_url)


def gateway_answers(settings: Settings, wait: float = 0.0) -> bool:
    """Whether a gateway answers on this host's gateway port (polled up to ``wait`` s)."""
    import socket

    host = settings.gateway_host if settings.gateway_host not in ("0.0.0.0", "::") else "127.0.0.1"
    deadline = time.monotonic() + wait
    while True:
        try:
            with socket.create_connection((host, settings.gateway_port), timeout=0.5):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def loop_config(settings: Settings, namespace: str) -> LoopConfig:
    return LoopConfig(
        model_env=model_env(settings),
        preset_models={"openai": settings.model_name, "anthropic": settings.anthropic_model},
        gateway_url=gateway_base(settings) if gateway_wanted(settings) else None,
        default_deadline=settings.deadline,
        default_gap=settings.heartbeat_gap,
        grace=settings.grace,
        claim_ttl=settings.task_claim_ttl,
        max_lost_leases=settings.max_lost_leases,
        prompt_dir=Path(_TMP) / "overnight" / namespace,
        log_dir=task_log_root(settings, namespace),
    )


def envelope_consume(client: redis.Redis, namespace: str, task_id: str, ttl: int) -> Consume:
    """Charge the shared envelope named by the task; an empty one raises CallRefused."""
    envelopes: dict[str, CallEnvelope] = {}

    def consume(name: str, kind: str, request_id: str) -> None:
        if name not in envelopes:
            envelopes[name] = CallEnvelope(
                client, name, namespace, request_ttl=ttl, task_id=task_id
            )
        try:
            envelopes[name].try_consume(kind, request_id=request_id)
        except EnvelopeEmpty as exc:
            raise CallRefused("envelope", f"shared envelope {name!r}: {exc}") from None

    return consume


class TaskNotVerified(Exception):
    """What the RQ job of a task that did not end finished_verified raises, so that RQ marks
    the job failed (``rq info``, rq-dashboard, the FailedJobRegistry) with the task's state
    and detail as the reason, instead of listing it with the verified ones as finished."""


def job_failure(task_id: str, state: str, detail: str) -> str | None:
    """The reason an attempt's RQ job fails, or None if it finished: it did when its task
    ended finished_verified, or when it ran nothing (``skipped:…``, another attempt owns
    the task); any other end (halted, paused, expired, aborted, agent_failed, queued
    again, its claim lost) fails it."""
    if state == "finished_verified" or state.startswith("skipped:"):
        return None
    return f"task {task_id}: {state}" + (f": {detail}" if detail else "")


class HorseStop:
    """The stop asked of this work horse: its worker was stopped and sent it SIGTERM."""

    def __init__(self) -> None:
        self.installed = False
        self.signum: int | None = None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        self.installed = True

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    def asked(self) -> int | None:
        return self.signum


HORSE_STOP = HorseStop()


def stoppable(runner: StepRunner, asked: Callable[[], int | None]) -> StepRunner:
    """``runner``, except that a step is not started once a stop was asked for: it ends at
    once as the stop would have ended it (the loop records it as stopped, not lost)."""

    def run(req: StepRequest) -> StepOutcome:
        sig = asked()
        if sig is None:
            return runner(req)
        note = f"supervisor-signal-{sig}"
        return StepOutcome(128 + sig, "killed", note, None, "", "", limit=req.deadline)

    return run


def perform_task(namespace: str, task_id: str, attempt: int) -> str:
    """The RQ job: run one attempt of a task; returns the state it was left in, finished
    only if that is finished_verified (else raises :class:`TaskNotVerified`)."""
    from rq import get_current_job
    from rq.timeouts import JobTimeoutException

    job = get_current_job()
    settings = current_settings()
    # Command agents and verifiers inherit this process's environment: not the model key.
    os.environ.pop("OVERNIGHT_MODEL_API_KEY", None)
    if job is not None:
        client = text_client(job.connection)
    else:
        from overnight.config.context import redis_client

        client = redis_client()
    keys = Keys(namespace)
    config = loop_config(settings, namespace)
    # In a work horse, a SIGTERM is a stop the user asked of its worker.
    stops = (signal.SIGTERM,) if HORSE_STOP.installed else ()
    runner: StepRunner = supervised_runner(client, keys, stop_signals=stops)
    if HORSE_STOP.installed:
        runner, config.stop_asked = stoppable(runner, HORSE_STOP.asked), HORSE_STOP.asked
    loop = TaskLoop(
        TaskStore(client, keys, retention=settings.retention),
        runner,
        envelope_consume(client, namespace, task_id, settings.request_id_ttl),
        config,
    )
    who = Runner(
        host=hostname(),
        pid=os.getpid(),
        worker=os.environ.get("RQ_WORKER_ID", ""),
        job_id=job.id if job else "",
    )
    try:
        state = loop.run(task_id, attempt, who)
    except JobTimeoutException:
        # RQ's timeout (the task's deadline plus a margin) fired: a step in flight has
        # already been ended through its lease. Hand the task to recovery now, not once
        # its claim lapses.
        try:
            TaskStore(client, keys, retention=settings.retention).drop_claim(
                task_id, attempt, who.pid
            )
            lines = recover(client, job.connection if job else client, keys, settings)
        except Exception as exc:  # the claim lapses anyway, and a later pass recovers it
            log.warning("task %s: recovery after the RQ job timeout failed: %s", task_id, exc)
        else:
            for line in lines:
                log.warning("task %s: RQ job timeout; recovery: %s", task_id, line)
        raise
    if state == QUEUED.value and HORSE_STOP.signum is not None:
        # Stopped: due a recovery check now, so the next worker to start (or the recovery
        # lead) enqueues it again at once instead of after the queued grace.
        with contextlib.suppress(redis.RedisError):
            store = loop.store
            store.queued_checked([task_id], store.now() - store.queued_grace)
    reason = job_failure(
        task_id,
        state,
        _detail(loop.store, task_id)
        if state != "lost"
        else "its claim was lost; recovery decides what it becomes",
    )
    if reason is not None:
        raise TaskNotVerified(reason)
    return state


def _detail(store: TaskStore, task_id: str) -> str:
    try:
        rec = store.get(task_id)
    except (TaskCorrupt, redis.RedisError):
        return ""
    return rec.detail if rec is not None else ""


def _readable(store: TaskStore, task_id: str) -> TaskRecord | None:
    """The task, or None if it is gone or unreadable (one bad record must not stop a pass)."""
    try:
        return store.get(task_id)
    except TaskCorrupt as exc:
        log.warning("%s; left alone", exc)
        return None


def _records(store: TaskStore, task_ids: list[str]) -> list[TaskRecord]:
    """The readable ones of ``task_ids``, in one round trip."""
    pipe = store.client.pipeline(transaction=False)
    for task_id in task_ids:
        pipe.hgetall(store.keys.task(task_id))
    out = []
    for task_id, raw in zip(task_ids, pipe.execute(), strict=True):
        if raw and "spec" in raw:
            try:
                out.append(TaskRecord.from_hash(raw))
            except TaskCorrupt as exc:
                log.warning("task %s: %s; left alone", task_id, exc)
    return out


def _queued_without_job(store: TaskStore, rq_conn: redis.Redis, task_ids: list[str]) -> list[str]:
    """Those of ``task_ids`` that are queued and whose current attempt's RQ job is missing
    or has ended: two round trips, a few fields each, however many are asked about."""
    pipe = store.client.pipeline(transaction=False)
    for task_id in task_ids:
        pipe.hmget(store.keys.task(task_id), "state", "run", "attempt")
    queued = [
        (task_id, f"{task_id}-{run}-{attempt}")
        for task_id, (state, run, attempt) in zip(task_ids, pipe.execute(), strict=True)
        if state == QUEUED.value
    ]
    if not queued:
        return []
    rq_pipe = rq_conn.pipeline(transaction=False)
    for _task_id, job_id in queued:
        rq_pipe.hget(Job.key_for(job_id), "status")
    ended = {
        s.value
        for s in (JobStatus.FAILED, JobStatus.FINISHED, JobStatus.STOPPED, JobStatus.CANCELED)
    }
    gone = []
    for (task_id, _job_id), status in zip(queued, rq_pipe.execute(), strict=True):
        text = status.decode() if isinstance(status, bytes) else status
        if text is None or text in ended:
            gone.append(task_id)
    return gone


def recover(
    client: redis.Redis,
    rq_conn: redis.Redis,
    keys: Keys,
    settings: Settings,
    *,
    now: float | None = None,
) -> list[str]:
    """One recovery pass over the namespace's recovery index; returns one line per action.

    A running task whose claim lapsed (by the claim index) is re-queued from its checkpoint
    (``on_unknown = "retry"``, or no step was in flight), paused (``"pause"`` with a step in
    flight, or the lost-run cap reached) or expired (its deadline passed). A queued task due
    a check (queued longer than the grace, then once a grace) whose RQ job is missing or
    ended is enqueued again. ``now`` is Redis server time (read once if not given), the
    clock every task time is written in. The pass also ends what retention says is over
    (task index entries of expired records, old receipts, ended leases' index entries).
    """
    store = TaskStore(client, keys, retention=settings.retention)
    now = store.now() if now is None else now
    actions: list[str] = []
    requeue: list[TaskRecord] = []
    for task_id in store.lapsed_claims(int(now * 1000)):
        rec = _readable(store, task_id)
        if rec is None:
            continue
        cp, spec = rec.checkpoint, rec.spec
        started = rec.started_unix
        ended = None if started is None else expired(cp, spec, now, started + spec.deadline)
        nxt = ended or lost_step(cp, spec.on_unknown, settings.max_lost_leases)
        new, detail = nxt.state, nxt.detail
        if new == QUEUED and step_may_run(client, keys, rec, settings.grace, now):
            continue  # at most one live step per task: not while a lease of it may live
        attempt = rec.attempt + 1 if new == QUEUED else rec.attempt
        try:
            # The script checks the claim lapsed and the task runs; a stale index entry (the
            # task moved on) is dropped by it.
            store.orphan(rec, nxt, attempt)
        except TaskRefused:
            continue  # its worker came back, or another pass recovered it first
        log.warning("task %s: worker lost; now %s: %s", task_id, new, detail)
        actions.append(f"{task_id}: {new}: {detail}")
        if new == QUEUED:
            requeue.append(rec.model_copy(update={"attempt": attempt, "state": new}))
    due = store.queued_due(now)
    if due:
        lost = _queued_without_job(store, rq_conn, due)
        for rec in _records(store, lost) if lost else []:
            if rec.state == QUEUED:
                actions.append(f"{rec.id}: re-enqueued attempt {rec.attempt}")
                requeue.append(rec)
        store.queued_checked(due, now)
    if requeue:
        enqueue(rq_conn, requeue, keys.namespace, now, retention=settings.retention)
    forgotten = store.forget_expired(now)
    if forgotten:
        actions.append(f"retention: {forgotten} ended task(s) forgotten")
    receipts.trim_by_age(client, keys, settings.retention, now)
    _forget_leases(client, keys, settings.retention, now)
    return actions


def _forget_leases(client: redis.Redis, keys: Keys, retention: float, now: float) -> int:
    """Drop ended leases whose document expired from the lease list (oldest first, a batch
    per pass); returns how many went."""
    cutoff = int((now - retention) * 1000)
    old = [str(x) for x in client.zrangebyscore(keys.leases, "-inf", cutoff, 0, LEASE_PRUNE_BATCH)]
    if not old:
        return 0
    pipe = client.pipeline(transaction=False)
    for lease_id in old:
        pipe.exists(keys.lease(lease_id))
    gone = [lease_id for lease_id, there in zip(old, pipe.execute(), strict=True) if not there]
    if gone:
        client.zrem(keys.leases, *gone)
    return len(gone)


@functools.cache
def _lead_source() -> str:
    from importlib import resources

    return resources.files("overnight.coordinator").joinpath("lua", "recovery_lead.lua").read_text()


class RecoveryLead:
    """The recovery lead of a namespace: at most one process holds it (a key with a TTL
    and this process's token); whoever holds it runs the passes, the others do not. A
    holder that dies or stalls loses it after ``ttl`` seconds and another takes over."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl: float) -> None:
        self.client, self.keys, self.ttl = client, keys, ttl
        self.token = f"{hostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._script = client.register_script(_lead_source())

    def hold(self) -> bool:
        """Take or renew the lead; True if this process leads now."""
        ms = max(1000, int(self.ttl * 1000))
        return bool(self._script(keys=[self.keys.recovery_leader], args=[self.token, ms]))

    def release(self) -> None:
        """Give the lead up (best effort: it lapses anyway)."""
        with contextlib.suppress(Exception):
            if self.client.get(self.keys.recovery_leader) == self.token:
                self.client.delete(self.keys.recovery_leader)


def lead_ttl(settings: Settings) -> float:
    """How long the recovery lead outlives its last renewal: three passes."""
    return max(3.0, 3 * settings.recovery_interval)


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when ``parent`` dies, so a killed worker takes
    its work horse (and the in-process supervisor) with it; the step's tree is left to
    its lease and the reaper."""
    if not set_pdeathsig(signal.SIGKILL):
        return
    if os.getppid() != parent:
        os._exit(1)


class OvernightWorker(Worker):
    """An RQ worker for overnight tasks.

    ``rq worker -w overnight.coordinator.dispatch.core.OvernightWorker`` runs it too.

    It runs a :func:`recover` pass at start, then, while idle, tries for the namespace's
    recovery lead every ``OVERNIGHT_RECOVERY_INTERVAL`` seconds and runs a pass when it
    holds it; its work horse dies with it. A Redis that is away or refuses writes for a while
    (connection loss, OOM at maxmemory, LOADING, MISCONF, READONLY) never ends it: it logs
    once, backs off and goes on where it was.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from overnight.worker.supervise.procs import set_dumpable

        set_dumpable(False)  # `rq worker -w ...` does not come through overnight's CLI
        super().__init__(*args, **kwargs)
        self._last_recovery: float | None = None
        self._last_log_prune: float | None = None
        self._lead: RecoveryLead | None = None
        self._forced = False
        self._redis = Backoff(f"worker {self.name}", log)

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

    # --- Redis errors are transient: RQ's loop would quit on them ----------------------------
    def _stalled(self, exc: Exception) -> None:
        """A transient Redis error in the work loop: log (once per stall), wait, go on."""
        wait = self._redis.failed(exc)
        deadline = time.monotonic() + wait
        while not self._stop_requested and time.monotonic() < deadline:
            time.sleep(min(0.1, wait))

    def check_for_suspension(self, burst: bool) -> None:
        try:
            super().check_for_suspension(burst)
        except Exception as exc:
            if not transient(exc):
                raise
            self._stalled(exc)

    def register_birth(self) -> None:
        # A worker (re)started while Redis refuses writes waits instead of dying at birth;
        # RQ registers in one MULTI/EXEC, so a refused try wrote nothing.
        while True:
            try:
                super().register_birth()  # type: ignore[no-untyped-call]
            except Exception as exc:
                if not transient(exc) or self._stop_requested:
                    raise
                self._stalled(exc)
                continue
            self._redis.ok()
            return

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        try:
            super().heartbeat(timeout, pipeline)
        except Exception as exc:
            if not transient(exc):
                raise
            self._stalled(exc)

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        while True:
            try:
                found = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except Exception as exc:
                if not transient(exc):
                    raise
                self._stalled(exc)
                if self._stop_requested:
                    return None
                continue
            self._redis.ok()
            return found

    def execute_job(self, job: Job, queue: Queue) -> None:
        try:
            super().execute_job(job, queue)
        except Exception as exc:
            # The horse ran (or not) and the task's own writes tell which; its claim lapses
            # if nobody holds it, and recovery takes it from there.
            if not transient(exc):
                raise
            self._stalled(exc)

    def teardown(self) -> None:
        try:
            super().teardown()  # type: ignore[no-untyped-call]
        except Exception as exc:
            if not transient(exc):
                raise
            self.log.warning("worker %s: could not unregister: %s", self.name, exc)
        if self._lead is not None:
            self._lead.release()

    def run_maintenance_tasks(self) -> None:
        if super().should_run_maintenance_tasks:
            try:
                super().run_maintenance_tasks()  # type: ignore[no-untyped-call]
            except Exception as exc:
                if not transient(exc):
                    raise
                self._stalled(exc)
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
        if job.func_name != f"{__name__}.perform_task" or len(job.args) != 3:
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
        from overnight.worker.supervise.procs import set_dumpable

        set_dumpable(False)  # inherited through fork already; a horse holds the secrets too
        _die_with_parent(self.pid or os.getppid())
        super().main_work_horse(job, queue)
