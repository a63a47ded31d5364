"""How a worker stops listening on its RQ command channel without waiting on the listener.

RQ's ``Worker.unsubscribe`` sends UNSUBSCRIBE, then stops its listener thread; since redis-py 6
``PubSubWorkerThread.stop()`` waits for the thread to end. The thread reads with a 60 s
timeout: when the reply to UNSUBSCRIBE reaches it before the stop flag is down, it is no longer
subscribed and waits up to 60 s for a subscription (redis-py's ``subscribed_event``), and the
stop waits that long, so an idle worker asked to stop (the end of a night) took up to a
minute to exit. Here the flag goes down first, then UNSUBSCRIBE; the event is set so a
listener waiting on it reads the reply, and the reply ends its loop either way.
"""

from __future__ import annotations

import contextlib
from typing import Any

import redis

# How long the stop waits for the listener to end (it closes its own connection as it ends;
# a daemon thread left reading dies with the process).
JOIN_SEC = 1.0


def stop_listening(worker: Any) -> None:
    """Stop ``worker``'s (an ``rq.Worker``) command listener: flag down, UNSUBSCRIBE, a
    bounded join."""
    thread, pubsub = getattr(worker, "pubsub_thread", None), getattr(worker, "pubsub", None)
    if thread is None or pubsub is None:
        return
    worker.log.info(
        "Worker %s: unsubscribing from channel %s", worker.name, worker.pubsub_channel_name
    )
    try:
        thread.stop(timeout=0)
    except TypeError:  # redis-py before 6: stop() only lowers the flag
        thread.stop()
    with contextlib.suppress(redis.RedisError, OSError):
        pubsub.unsubscribe()
    pubsub.subscribed_event.set()  # the listener closes (and so resets) the pubsub as it ends
    thread.join(JOIN_SEC)
