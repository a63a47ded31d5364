"""Enqueueing: one RQ job per attempt of a task, on the task's queue.

A job names its function by the stable path ``overnight.coordinator.dispatch.perform_task``
(:data:`JOB_FUNC`), not by the module that defines it, so a job queued before a move of
that module still finds it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import redis
from rq import Queue

from overnight.config.context import settings as current_settings
from overnight.coordinator.tasks.store import TaskRecord, server_time

JOB_FUNC = "overnight.coordinator.dispatch.perform_task"
# RQ's own job timeout is the task's deadline plus this, so the task's deadline fires first.
JOB_MARGIN = 120


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
            JOB_FUNC,
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
