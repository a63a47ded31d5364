"""Recovery of tasks whose worker died, and retention.

A worker that dies stops renewing the task's claim; a recovery pass (:func:`recover`) then
re-queues the task from its checkpoint, or pauses it when the step in flight had an unknown
outcome. A pass reads the recovery index (claim expiries, queued tasks due a check), so its
cost follows what changed, not how many tasks there are; it runs in the one process of the
namespace that holds the recovery lead (:class:`coordinator.dispatch.lead.RecoveryLead`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import redis
from rq import Queue, Worker
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus

from overnight.config.keys import Keys
from overnight.coordinator.dispatch.enqueue import enqueue
from overnight.coordinator.dispatch.rerun import step_leases, step_may_run
from overnight.coordinator.tasks.judge import expired, lost_step
from overnight.coordinator.tasks.states import QUEUED
from overnight.coordinator.tasks.store import TaskCorrupt, TaskRecord, TaskRefused, TaskStore
from overnight.worker.redisio import receipts

if TYPE_CHECKING:
    from overnight.config.settings import Settings

log = logging.getLogger("overnight.dispatch")

# How many ended leases a pass looks at for retention (oldest first).
LEASE_PRUNE_BATCH = 1000


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


ENDED_JOB = frozenset(
    s.value for s in (JobStatus.FAILED, JobStatus.FINISHED, JobStatus.STOPPED, JobStatus.CANCELED)
)


def job_lost(status: str | None, waiting: bool, worker_alive: bool) -> bool:
    """Whether the RQ job of a task still queued past its grace will never run its task.

    It will run only if it waits in its queue's list, or a live worker has started it (its
    work horse claims the task in a moment). A job taken from the list but never started (a
    worker met an error between the two, e.g. a Redis at maxmemory) sits in RQ's
    intermediate list until RQ's own maintenance fails it, ten minutes and more later; a
    job whose hash says queued but whose id is in no list never runs at all.
    """
    if status is None or status in ENDED_JOB:
        return True
    if waiting:
        return False
    if status == JobStatus.STARTED.value:
        return not worker_alive
    return True


def _text(value: object) -> str | None:
    return value.decode() if isinstance(value, bytes) else None if value is None else str(value)


def _queued_without_job(store: TaskStore, rq_conn: redis.Redis, task_ids: list[str]) -> list[str]:
    """Those of ``task_ids`` that are queued and whose current attempt's RQ job will never
    run (:func:`job_lost`): three round trips however many are asked about. A lost job's id
    is taken out of its queue's intermediate list, so RQ's clean-up never fails the job
    that is enqueued again under the same id."""
    pipe = store.client.pipeline(transaction=False)
    for task_id in task_ids:
        pipe.hmget(store.keys.task(task_id), "state", "run", "attempt", "queue")
    queued = [
        (task_id, f"{task_id}-{run}-{attempt}", Queue(str(queue), connection=rq_conn).key)
        for task_id, (state, run, attempt, queue) in zip(task_ids, pipe.execute(), strict=True)
        if state == QUEUED.value
    ]
    if not queued:
        return []
    rq_pipe = rq_conn.pipeline(transaction=False)
    for _task_id, job_id, queue_key in queued:
        rq_pipe.hmget(Job.key_for(job_id), "status", "worker_name")
        rq_pipe.lpos(queue_key, job_id)
    rows = rq_pipe.execute()
    jobs = [(rows[i], rows[i + 1]) for i in range(0, len(rows), 2)]
    alive_pipe = rq_conn.pipeline(transaction=False)
    for (_status, worker), _pos in jobs:
        name = _text(worker) or "-"
        alive_pipe.exists(Worker.redis_worker_namespace_prefix + name)
    alive = alive_pipe.execute()
    gone = []
    drop = rq_conn.pipeline(transaction=False)
    for (task_id, job_id, queue_key), ((status, _worker), pos), live in zip(
        queued, jobs, alive, strict=True
    ):
        if job_lost(_text(status), pos is not None, bool(live)):
            gone.append(task_id)
            drop.lrem(IntermediateQueue.get_intermediate_queue_key(queue_key), 0, job_id)
    if gone:
        drop.execute()
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
        flight = cp.in_flight
        started = flight is None or bool(step_leases(client, keys, rec.id, flight.started_unix))
        cap = settings.max_lost_leases
        nxt = ended or lost_step(cp, spec.on_unknown, cap, started=started)
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
