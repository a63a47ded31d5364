"""A worker made during a Sentinel failover waits for the new primary instead of exiting 69.

RQ's ``Worker.__init__`` names its connection (CLIENT SETNAME, CLIENT INFO) before any loop
of ours runs, and ``overnight worker`` makes its worker again after a Redis error escaped
RQ's start-up: while the sentinels name no primary yet (``MasterNotFoundError``) or the old
one is gone (connection refused), that call raised out of the command. The error is injected
here, a given number of times, into a client of the session's real Redis."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from redis.sentinel import MasterNotFoundError

from overnight.config.keys import Keys
from overnight.coordinator.dispatch import worker as worker_module
from overnight.coordinator.dispatch.enqueue import JOB_FUNC
from overnight.coordinator.dispatch.worker import OvernightWorker
from overnight.coordinator.tasks.scripts import QUEUED_GRACE


class Failover(redis.Redis):
    """A client whose first ``fails`` CLIENT SETNAMEs raise ``error`` (what a Sentinel
    client raises mid-failover), then reach the server."""

    def __init__(self, url: str, error: Exception, fails: int) -> None:
        pool = redis.ConnectionPool.from_url(url)
        super().__init__(connection_pool=pool)
        self.error, self.fails, self.tries = error, fails, 0

    def client_setname(self, name: str) -> Any:
        self.tries += 1
        if self.tries <= self.fails:
            raise self.error
        return super().client_setname(name)


ERRORS = [
    MasterNotFoundError("No master found for 'night'"),
    redis.ConnectionError("Error 111 connecting to 10.231.0.1:6390. Connection refused."),
]


@pytest.fixture(autouse=True)
def _keep_this_process_dumpable(monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker makes its own process undumpable; here that process is pytest's.
    monkeypatch.setattr(worker_module, "set_dumpable", lambda _on: None)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("error", ERRORS, ids=["no-primary-named", "primary-gone"])
def test_a_worker_made_mid_failover_waits_for_the_primary(
    env: dict[str, str], namespace: str, error: Exception
) -> None:
    client = Failover(env["OVERNIGHT_REDIS_URL"], error, fails=3)
    w = OvernightWorker([namespace], connection=client)
    assert client.tries == 4  # three refused, backed off (0.1 s, 0.2 s, 0.4 s), then named
    assert w.ip_address not in ("", "unknown")
    assert w.work(burst=True) is False  # it works: no job, a clean burst
    client.close()


@pytest.mark.timeout(30)
def test_its_twin_a_primary_that_never_comes_back_is_given_up_after_the_patience(
    env: dict[str, str], namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_module, "STARTUP_WAIT", 0.5)
    client = Failover(env["OVERNIGHT_REDIS_URL"], ERRORS[0], fails=10**6)
    with pytest.raises(MasterNotFoundError):
        OvernightWorker([namespace], connection=client)
    assert 2 <= client.tries <= 4  # 0.1 + 0.2 s waited, the next wait past the patience
    client.close()


@pytest.mark.timeout(30)
def test_a_job_given_up_in_a_stall_is_ended_so_recovery_enqueues_its_task_again(
    env: dict[str, str], namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stall comes between the dequeue and the task's claim: the job reads ``started``
    by this worker, alive, which recovery took as running, so its still-queued task was never
    enqueued again (seen once in 100 tasks on three hosts through a Sentinel failover)."""
    from rq import Queue
    from rq.job import JobStatus
    from rq.registry import StartedJobRegistry

    from overnight.coordinator.dispatch.recovery import job_lost

    conn = redis.Redis.from_url(env["OVERNIGHT_REDIS_URL"])
    w = OvernightWorker([namespace], connection=conn)
    queue = Queue(namespace, connection=conn)
    keys = Keys(namespace)
    # An overnight job of a queued task whose recovery check is a grace away.
    conn.zadd(keys.task_queued, {"t": time.time() + QUEUED_GRACE})
    queue.enqueue(JOB_FUNC, namespace, "t", 1, job_id=f"{namespace}-t-1")
    job, _ = w.dequeue_job_and_maintain_ttl(1) or pytest.fail("no job dequeued")

    def stalled_fork(job: Any, queue: Any) -> None:
        # What a horse writes first (started, by this worker); then Redis goes away.
        job.set_status(JobStatus.STARTED)
        conn.hset(job.key, "worker_name", w.name)
        raise MasterNotFoundError("No master found for 'night'")

    monkeypatch.setattr(w, "fork_work_horse", stalled_fork)
    w.execute_job(job, queue)  # ridden out: logged, backed off, given up
    status = job.get_status(refresh=True)
    assert not job_lost(status, waiting=False, worker_alive=True)  # the stall's state

    assert w.dequeue_job_and_maintain_ttl(1, max_idle_time=1) is None  # the job ends first
    status = job.get_status(refresh=True)
    assert status == JobStatus.FAILED and job_lost(status, waiting=False, worker_alive=True)
    assert w.executions == {} and StartedJobRegistry(queue=queue).get_job_ids() == []
    due = conn.zscore(keys.task_queued, "t")
    assert due is not None and due <= time.time()  # the next recovery pass checks it
    conn.close()


@pytest.mark.timeout(60)
def test_a_worker_started_mid_failover_waits_for_the_primary_before_its_password_check(
    env: dict[str, str], namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``overnight worker`` asks the primary whether anyone gets in without a password: a
    primary gone since its first PING (connection refused) is waited for like the PING, not
    exit 69."""
    from click.testing import CliRunner

    from overnight.config import connection, context
    from overnight.coordinator.cli.worker import worker_command
    from overnight.worker.sandbox import launch

    calls: list[int] = []
    real = connection.anyone_gets_in

    def gone_twice(client: redis.Redis) -> bool:
        calls.append(1)
        if len(calls) <= 2:
            raise ERRORS[1]
        return real(client)

    monkeypatch.setattr(connection, "anyone_gets_in", gone_twice)
    for key, value in {**env, "OVERNIGHT_QUEUE": namespace}.items():
        monkeypatch.setenv(key, value)
    cached = (context.settings, context.rq_connection, launch.configured)
    for fn in cached:
        fn.cache_clear()
    try:
        result = CliRunner().invoke(worker_command, ["--burst"], catch_exceptions=False)
    finally:
        for fn in cached:
            fn.cache_clear()
    assert result.exit_code == 0, result.output
    assert len(calls) == 3  # refused twice, then answered
