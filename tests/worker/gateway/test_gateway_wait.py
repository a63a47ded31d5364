"""With replicas asked for, the gateway forwards a request only once a replica holds its
hold (WAIT): on a primary with no replica it is refused (503) and the hold given back at
once; the same request with a replica attached is held (the benign twin)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pytest
import redis

from overnight.config.connection import async_client_from_url
from overnight.config.keys import Keys
from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.gateway.grant import Grant, mint
from overnight.worker.gateway.meter import Hold, Meter, Refused
from overnight.worker.lease.store import Leases
from tests.helpers import wait_for

Factory = Callable[..., EmbeddedRedis]


def _reserve(server: EmbeddedRedis, namespace: str, token: str) -> Hold:
    async def go() -> Hold:
        client = async_client_from_url(server.url, timeout=2.0, max_connections=4)
        try:
            meter = Meter(client, namespace, "here", replicas=1, wait_ms=200)
            who = await meter.holder(token)
            assert who is not None
            return await meter.reserve(who, 100, "chat")
        finally:
            await client.aclose()
            await client.connection_pool.disconnect()

    return asyncio.run(go())


def test_a_hold_no_replica_acknowledges_is_refused_and_given_back(
    redis_factory: Factory, namespace: str
) -> None:
    primary = redis_factory(password=uuid.uuid4().hex)
    r = redis.Redis.from_url(primary.url, decode_responses=True)
    keys = Keys(namespace)
    doc = Leases(r, keys).acquire(budget_sec=120, gap_sec=30)
    token, _ = mint(r, keys, doc.lease_id, doc.token, Grant("http://x"), ttl=120, gap=30)
    envelope = CallEnvelope(r, "default", namespace)
    envelope.reset(5)
    with pytest.raises(Refused) as refused:
        _reserve(primary, namespace, token)
    assert refused.value.status == 503 and "0 of 1" in refused.value.detail
    state = envelope.snapshot()
    assert (state.remaining, state.consumed_model, state.reserved_tokens) == (5, 0, 0)
    # The twin: the same request once a replica follows the primary is held.
    assert primary.password is not None
    follow = ["--masterauth", primary.password, "--replicaof", "127.0.0.1", str(primary.port)]
    replica = redis_factory(password=primary.password, extra_args=follow)
    with redis.Redis.from_url(replica.url, decode_responses=True) as rep:
        wait_for(lambda: rep.info("replication").get("master_link_status") == "up", timeout=30)
    # Following, by the primary's own count: it has had an acknowledgement (a loaded machine
    # may take longer than the meter's 200 ms for the first one).
    wait_for(lambda: r.execute_command("WAIT", 1, 1000) == 1, timeout=30)
    assert _reserve(primary, namespace, token).tokens == 100
    assert envelope.snapshot().remaining == 4
    r.close()
