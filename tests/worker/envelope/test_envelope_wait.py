"""With ``replicas``, an envelope spend goes ahead only once a replica holds it (WAIT): on a
primary with no replica the call is refused; the same spend with a replica attached is
allowed (the benign twin), and the refused request's retry is charged once."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import redis

from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.envelope.envelope import CallEnvelope, EnvelopeEmpty, EnvelopeUnavailable
from tests.helpers import wait_for

Factory = Callable[..., EmbeddedRedis]


def _envelope(
    server: EmbeddedRedis, namespace: str, replicas: int, timeout: float = 10.0
) -> CallEnvelope:
    """``timeout`` bounds each WAIT: short where no replica can answer, generous where one
    must (a loaded machine's replica took over 200 ms to acknowledge)."""
    client = redis.Redis.from_url(server.url, decode_responses=True)
    return CallEnvelope(client, "w", namespace, replicas=replicas, replica_timeout=timeout)


def _attach_replica(redis_factory: Factory, primary: EmbeddedRedis) -> None:
    assert primary.password is not None
    follow = ["--masterauth", primary.password, "--replicaof", "127.0.0.1", str(primary.port)]
    replica = redis_factory(password=primary.password, extra_args=follow)
    with redis.Redis.from_url(replica.url, decode_responses=True) as r:
        wait_for(lambda: r.info("replication").get("master_link_status") == "up", timeout=30)


def test_a_spend_no_replica_acknowledges_is_refused_then_charged_once(
    redis_factory: Factory, namespace: str
) -> None:
    primary = redis_factory(password=uuid.uuid4().hex)
    env = _envelope(primary, namespace, replicas=1, timeout=0.2)
    env.reset(5)
    with pytest.raises(EnvelopeUnavailable, match="acknowledged by 0 of 1 replica"):
        env.try_consume("model", "req-1")
    with pytest.raises(EnvelopeUnavailable, match="acknowledged by 0 of 1 replica"):
        env.reserve("tool", 2)
    assert env.try_consume("model", dry_run=True).remaining == 5 - 1 - 2  # a dry run never waits
    _attach_replica(redis_factory, primary)
    env = _envelope(primary, namespace, replicas=1)
    assert env.try_consume("model", "req-1").consumed_model == 1  # the retry: charged once
    assert env.reserve("tool", 1).state.remaining == 1


def test_the_benign_twin_with_a_replica_spends_and_refuses_as_usual(
    redis_factory: Factory, namespace: str
) -> None:
    primary = redis_factory(password=uuid.uuid4().hex)
    _attach_replica(redis_factory, primary)
    env = _envelope(primary, namespace, replicas=1)
    env.reset(2)
    assert env.try_consume("model", "req-1").remaining == 1
    assert env.reserve("tool", 1).state.remaining == 0
    with pytest.raises(EnvelopeEmpty):
        env.try_consume("model", "req-2")


def test_without_replicas_asked_a_lone_primary_spends(
    redis_server: EmbeddedRedis, namespace: str
) -> None:
    env = _envelope(redis_server, namespace, replicas=0)
    env.reset(1)
    assert env.try_consume("model").remaining == 0
