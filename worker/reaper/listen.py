"""The reaper's ear: a pass as soon as a lease's liveness key lapses, not at the next tick.

Redis publishes an ``expired`` keyspace event when it deletes a key whose TTL ran out. The
reaper turns those events on for the server where ``CONFIG SET`` is allowed (adding ``K``
and ``x`` to what is set, never removing a flag), listens for its namespace's liveness
keys, and wakes its loop on each. Events are a hint, never a record: a pass still reads
the expiry index, and the timed passes stay as the backstop (events are not delivered
while the connection is down, nor where ``CONFIG SET`` is refused and nobody enabled them).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis

    from overnight.config.keys import Keys

log = logging.getLogger("overnight.reaper")
POLL = 0.05  # how often a wait looks at the stop flag


def wanted_flags(current: str) -> str | None:
    """The ``notify-keyspace-events`` value that adds keyspace events for expired keys to
    ``current``, or None if it has them already."""
    has_expired = "x" in current or "A" in current
    if "K" in current and has_expired:
        return None
    return current + ("" if "K" in current else "K") + ("" if has_expired else "x")


class Listener:
    """Wakes :meth:`wait` when a liveness key of the namespace expires (a daemon thread)."""

    def __init__(self, client: redis.Redis, keys: Keys, stop: threading.Event) -> None:
        self.client = client
        self.stop = stop
        self.woken = threading.Event()
        db = int(client.connection_pool.connection_kwargs.get("db", 0) or 0)
        self.pattern = f"__keyspace@{db}__:{keys.lease_alive('*')}"
        self.heard = 0
        self.enabled: bool | None = None
        self.thread = threading.Thread(target=self._run, name="reaper-listener", daemon=True)

    def start(self) -> Listener:
        self.thread.start()
        return self

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True if an expiry (or stop) cut it short."""
        end = time.monotonic() + timeout
        while not self.stop.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return False
            if self.woken.wait(min(left, POLL)):
                self.woken.clear()
                return True
        return True

    def _enable(self) -> None:
        import redis as redis_mod

        try:
            raw = self.client.config_get("notify-keyspace-events")
            current = _text(next(iter(raw.values()), ""))
            flags = wanted_flags(current)
            if flags is not None:
                self.client.config_set("notify-keyspace-events", flags)
            self.enabled = True
        except redis_mod.ResponseError as exc:
            if self.enabled is not False:
                log.info(
                    "reaper: keyspace events not enabled (%s); lapsed leases are found "
                    "by the timed passes",
                    exc,
                )
            self.enabled = False

    def _run(self) -> None:
        while not self.stop.is_set():
            pubsub: Any = None
            try:
                self._enable()
                pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call,unused-ignore]
                pubsub.psubscribe(self.pattern)
                while not self.stop.is_set():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg is not None and _text(msg.get("data")) == "expired":
                        self.heard += 1
                        self.woken.set()
            except Exception as exc:  # a lost connection: the timed passes go on meanwhile
                log.debug("reaper listener: %s: %s", type(exc).__name__, exc)
                self.stop.wait(1.0)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
