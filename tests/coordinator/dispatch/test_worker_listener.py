"""An idle worker asked to stop does not wait on its command listener: RQ stops the listener
after sending UNSUBSCRIBE, and when the reply reached the listener first it was back in a
60 s read that the stop then waited out (the end of a night: "workers still busy 7s after the
stop; forcing it")."""

from __future__ import annotations

import pytest
import redis

from overnight.coordinator.dispatch.listener import stop_listening
from tests.helpers import wait_for


@pytest.fixture
def worker(env: dict[str, str]) -> object:
    from rq import Worker

    w = Worker(["listener-test"], connection=redis.Redis.from_url(env["OVERNIGHT_REDIS_URL"]))
    w.subscribe()
    yield w
    if w.pubsub_thread is not None and w.pubsub_thread.is_alive():
        w.pubsub.connection.disconnect()  # wakes a listener left reading; it ends
        w.pubsub_thread.join(10)


@pytest.mark.timeout(30)
def test_the_listener_ends_even_when_the_unsubscribe_reply_came_first(
    worker: object, r: redis.Redis
) -> None:
    w = worker
    thread, pubsub = w.pubsub_thread, w.pubsub  # type: ignore[attr-defined]
    wait_for(lambda: pubsub.subscribed and r.pubsub_numsub(w.pubsub_channel_name)[0][1] == 1)  # type: ignore[attr-defined]
    # The race, forced: the reply to an UNSUBSCRIBE is handled while the stop flag is still
    # up, so the listener is back in a fresh 60 s read with nothing more to come.
    pubsub.unsubscribe()
    wait_for(lambda: not pubsub.subscribed)
    wait_for(lambda: r.pubsub_numsub(w.pubsub_channel_name)[0][1] == 0)  # type: ignore[attr-defined]
    assert thread.is_alive() and thread._running.is_set()  # the state RQ's stop waited in

    stop_listening(w)
    assert not thread.is_alive()  # ended by the reply, not by a timeout


@pytest.mark.timeout(30)
def test_its_twin_a_listener_still_subscribed_ends_too(worker: object, r: redis.Redis) -> None:
    w = worker
    thread, pubsub = w.pubsub_thread, w.pubsub  # type: ignore[attr-defined]
    wait_for(lambda: pubsub.subscribed and r.pubsub_numsub(w.pubsub_channel_name)[0][1] == 1)  # type: ignore[attr-defined]
    stop_listening(w)
    assert not thread.is_alive()
    assert r.pubsub_numsub(w.pubsub_channel_name)[0][1] == 0  # type: ignore[attr-defined]
