"""A queued task always has a job that will run: recovery finds the ones that will not.

The rule is a pure table (:func:`job_lost`); on a real private Redis each way a job can be
lost (taken from its queue and dropped in RQ's intermediate list, its hash gone, started by
a worker that died) is made by hand, and one recovery pass enqueues the task again, while
its twin (a job waiting in its queue, or started by a live worker) is left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from rq import Queue, Worker
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job

from overnight.config.keys import Keys
from overnight.config.settings import load_settings
from overnight.coordinator.dispatch.enqueue import enqueue
from overnight.coordinator.dispatch.recovery import job_lost, recover
from overnight.coordinator.tasks.store import TaskRecord, TaskStore
from overnight.coordinator.tasks.taskfile import Rule, TaskSpec

CASES = [
    # status, waiting in its queue's list, its worker alive -> lost
    (None, False, False, True),
    ("finished", False, False, True),
    ("failed", False, False, True),
    ("stopped", False, False, True),
    ("canceled", False, False, True),
    ("queued", True, False, False),
    ("queued", False, False, True),
    ("queued", False, True, True),
    ("started", False, True, False),
    ("started", False, False, True),
    ("started", True, True, False),
]


@pytest.mark.parametrize(("status", "waiting", "alive", "lost"), CASES)
def test_job_lost_table(status: str | None, waiting: bool, alive: bool, lost: bool) -> None:
    assert job_lost(status, waiting, alive) is lost


def _spec(tmp_path: Path) -> TaskSpec:
    return TaskSpec(
        assignment="x",
        workdir=str(tmp_path),
        agent=["true"],
        max_calls=3,
        verifier=[Rule(name="r", run=["true"])],
    )


def _bytes(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def _one_task(
    r: redis.Redis, env: dict[str, str], namespace: str, tmp_path: Path
) -> tuple[TaskStore, TaskRecord, redis.Redis, Queue]:
    store = TaskStore(r, Keys(namespace), retention=3600, queued_grace=1)
    (rec,) = store.create([_spec(tmp_path)], namespace)
    rq_conn = _bytes(env["OVERNIGHT_REDIS_URL"])
    enqueue(rq_conn, [rec], namespace, retention=3600)
    queue = Queue(namespace, connection=rq_conn)
    assert queue.job_ids == [rec.job_id()]
    return store, rec, rq_conn, queue


def _pass(
    store: TaskStore, rq_conn: redis.Redis, r: redis.Redis, namespace: str, later: float = 5
) -> list[str]:
    """One recovery pass ``later`` seconds on: past the grace of the store that queued the
    task and of the pass (which pushes the next check one grace on)."""
    settings = load_settings()
    return recover(r, rq_conn, Keys(namespace), settings, now=store.now() + later)


def _taken(queue: Queue, rq_conn: redis.Redis) -> str:
    """What a worker's dequeue does first: move the job to the intermediate list."""
    job_id = rq_conn.lmove(queue.key, IntermediateQueue.get_intermediate_queue_key(queue.key))
    assert job_id is not None
    return job_id.decode()


def _dropped_between_take_and_start(queue: Queue, rq_conn: redis.Redis, job_id: str) -> None:
    _taken(queue, rq_conn)


def _hash_gone(queue: Queue, rq_conn: redis.Redis, job_id: str) -> None:
    rq_conn.delete(Job.key_for(job_id))


def _never_pushed(queue: Queue, rq_conn: redis.Redis, job_id: str) -> None:
    rq_conn.lrem(queue.key, 0, job_id)


def _started_by_a_dead_worker(queue: Queue, rq_conn: redis.Redis, job_id: str) -> None:
    _taken(queue, rq_conn)
    rq_conn.hset(Job.key_for(job_id), mapping={"status": "started", "worker_name": "gone-1"})


LOSSES: list[Callable[[Queue, redis.Redis, str], None]] = [
    _dropped_between_take_and_start,
    _hash_gone,
    _never_pushed,
    _started_by_a_dead_worker,
]


@pytest.mark.parametrize("lose", LOSSES, ids=lambda f: f.__name__.strip("_"))
def test_a_lost_job_is_enqueued_again_by_one_pass(
    r: redis.Redis,
    env: dict[str, str],
    namespace: str,
    tmp_path: Path,
    lose: Callable[[Queue, redis.Redis, str], None],
) -> None:
    store, rec, rq_conn, queue = _one_task(r, env, namespace, tmp_path)
    lose(queue, rq_conn, rec.job_id())
    actions = _pass(store, rq_conn, r, namespace)
    assert actions == [f"{rec.id}: re-enqueued attempt {rec.attempt}"]
    assert rec.job_id() in queue.job_ids
    job = Job.fetch(rec.job_id(), connection=rq_conn)
    assert job.get_status().value == "queued"
    # Nothing of it left in the intermediate list for RQ's clean-up to fail later.
    intermediate = IntermediateQueue.get_intermediate_queue_key(queue.key)
    assert rq_conn.lrange(intermediate, 0, -1) == []


def test_a_waiting_job_and_a_live_workers_job_are_left_alone(
    r: redis.Redis, env: dict[str, str], namespace: str, tmp_path: Path
) -> None:
    store, rec, rq_conn, queue = _one_task(r, env, namespace, tmp_path)
    assert _pass(store, rq_conn, r, namespace) == []
    assert queue.job_ids == [rec.job_id()]

    job_id = _taken(queue, rq_conn)
    rq_conn.hset(Job.key_for(job_id), mapping={"status": "started", "worker_name": "alive-1"})
    rq_conn.hset(Worker.redis_worker_namespace_prefix + "alive-1", "birth", "now")
    assert _pass(store, rq_conn, r, namespace, later=1000) == []
    assert queue.job_ids == []
    # The same job once its worker is gone: enqueued again.
    rq_conn.delete(Worker.redis_worker_namespace_prefix + "alive-1")
    again = _pass(store, rq_conn, r, namespace, later=2000)
    assert again == [f"{rec.id}: re-enqueued attempt {rec.attempt}"]
    assert queue.job_ids == [rec.job_id()]
