"""Fewer round trips, same documents: what acquire and end return is what Redis holds."""

from __future__ import annotations

import os

import fakeredis
import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.lease.store import LeaseRefused, Leases


def _leases(request: pytest.FixtureRequest, namespace: str) -> Leases:
    client: redis.Redis
    if request.param == "fake":
        client = fakeredis.FakeRedis(decode_responses=True)
    else:
        server: EmbeddedRedis = request.getfixturevalue("redis_server")
        client = redis.Redis.from_url(server.url, decode_responses=request.param == "real")
    return Leases(client, Keys(namespace))


@pytest.fixture(params=["fake", "real", "real-bytes"])
def leases(request: pytest.FixtureRequest, namespace: str) -> Leases:
    """Text and bytes clients, on fakeredis (lupa) and on real Redis."""
    return _leases(request, namespace)


@pytest.fixture(params=["real", "real-bytes"])
def holders(request: pytest.FixtureRequest, namespace: str) -> Leases:
    """Text and bytes clients on real Redis: the holder's end needs redis.sha1hex."""
    return _leases(request, namespace)


@pytest.mark.parametrize("task_id", [None, "task-1"])
def test_acquire_returns_the_stored_document(leases: Leases, task_id: str | None) -> None:
    doc = leases.acquire(
        budget_sec=60, gap_sec=2.5, note="boot", supervisor_pid=os.getpid(), task_id=task_id
    )
    assert doc == leases.get(doc.lease_id)


def test_end_with_fetch_returns_the_ended_document(holders: Leases) -> None:
    leases = holders
    doc = leases.acquire(budget_sec=60, gap_sec=5)
    leases.attach(doc.lease_id, doc.token, pid=4242, pgid=4242, start=99)
    leases.beat(doc.lease_id, doc.token, note="working")
    ended = leases.end(doc.lease_id, doc.token, "killed", "worker-exit-3", exit_code=3, fetch=True)
    assert ended is not None and ended == leases.get(doc.lease_id)
    assert (ended.status, ended.note, ended.exit_code, ended.holder_pid) == (
        "killed",
        "worker-exit-3",
        3,
        4242,
    )
    assert ended.ended_unix is not None and ended.heartbeat_unix >= doc.heartbeat_unix


def test_end_without_fetch_returns_nothing_and_a_refusal_still_raises(
    holders: Leases,
) -> None:
    leases = holders
    doc = leases.acquire(budget_sec=60, gap_sec=5)
    assert leases.end(doc.lease_id, doc.token, "done", "worker-complete", exit_code=0) is None
    with pytest.raises(LeaseRefused):
        leases.end(doc.lease_id, doc.token, "killed", "late", fetch=True)
