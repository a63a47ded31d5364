"""The RQ job: :func:`perform_task` runs one attempt of one task in a work horse.

A job only runs if its attempt is the task's current one and the task is queued, so a
duplicate or stale job is harmless. In a work horse, a SIGTERM is a stop the user asked of
its worker (:data:`HORSE_STOP`): the step in flight ends through its lease and the task goes
back to ``queued`` from its checkpoint (:mod:`coordinator.tasks.stop`).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import weakref
from collections.abc import Callable
from typing import Any

import redis

from overnight.config.connection import same_server

# Imported here so a forked work horse finds them loaded and starts each task at once.
from overnight.config.context import settings as current_settings
from overnight.config.errors import OvernightError
from overnight.config.keys import Keys
from overnight.coordinator.dispatch.job_config import envelope_consume, loop_config
from overnight.coordinator.dispatch.recovery import recover
from overnight.coordinator.tasks.loop import TaskLoop
from overnight.coordinator.tasks.states import QUEUED, State
from overnight.coordinator.tasks.steps import (
    StepOutcome,
    StepRequest,
    StepRunner,
    supervised_runner,
)
from overnight.coordinator.tasks.store import Runner, TaskCorrupt, TaskStore
from overnight.coordinator.tasks.turn import Ending, LoopEnd
from overnight.worker.redisio import scripts
from overnight.worker.sandbox import cgroup
from overnight.worker.supervise.procs import boot_id, hostname

# What a step imports or reads on first use, loaded here once for every horse (each would
# otherwise pay for it again with every task).
importlib.import_module("overnight.config.stopat")
importlib.import_module("overnight.worker.sandbox.relay")
scripts.preload()
cgroup.cgroup2_mount()
boot_id()

log = logging.getLogger("overnight.dispatch")

# Per connection pool, its text twin: made once in a worker, inherited by its work horses.
_text_clients: weakref.WeakKeyDictionary[Any, redis.Redis] = weakref.WeakKeyDictionary()


def text_client(conn: redis.Redis) -> redis.Redis:
    """A ``decode_responses=True`` client on the same server, user and TLS as ``conn`` (the
    same Sentinel-managed primary, if it is one)."""
    pool = conn.connection_pool
    found = _text_clients.get(pool)
    if found is None:
        # driver_info=None: no CLIENT SETINFO round trips, and no look-up of redis-py's
        # version, on each of a work horse's connects.
        found = same_server(conn, decode_responses=True, driver_info=None)
        _text_clients[pool] = found
    return found


class TaskNotVerified(OvernightError):
    """What the RQ job of a task that did not end finished_verified raises, so that RQ marks
    the job failed (``rq info``, rq-dashboard, the FailedJobRegistry) with the task's state
    and detail as the reason, instead of listing it with the verified ones as finished."""


def job_failure(task_id: str, end: LoopEnd, detail: str) -> str | None:
    """The reason an attempt's RQ job fails, or None if it finished: it did when its task
    ended finished_verified, or when it ran nothing (skipped: another attempt owns the task,
    or the night had ended); any other end (halted, paused, expired, aborted, agent_failed,
    queued again, its claim lost) fails it."""
    if end.how is Ending.SKIPPED or end.state == State.FINISHED_VERIFIED:
        return None
    return f"task {task_id}: {end.label}" + (f": {detail}" if detail else "")


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
        envelope_consume(client, namespace, task_id, settings),
        config,
    )
    who = Runner(
        host=hostname(),
        pid=os.getpid(),
        worker=os.environ.get("RQ_WORKER_ID", ""),
        job_id=job.id if job else "",
    )
    try:
        end = loop.run(task_id, attempt, who)
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
    if end.state == QUEUED and HORSE_STOP.signum is not None:
        # Stopped: due a recovery check now, so the next worker to start (or the recovery
        # lead) enqueues it again at once instead of after the queued grace.
        with contextlib.suppress(redis.RedisError):
            store = loop.store
            store.queued_checked([task_id], store.now() - store.queued_grace)
    reason = job_failure(
        task_id,
        end,
        _detail(loop.store, task_id)
        if end.how is not Ending.LOST
        else "its claim was lost; recovery decides what it becomes",
    )
    if reason is not None:
        raise TaskNotVerified(reason)
    return end.label


def _detail(store: TaskStore, task_id: str) -> str:
    try:
        rec = store.get(task_id)
    except (TaskCorrupt, redis.RedisError):
        return ""
    return rec.detail if rec is not None else ""
