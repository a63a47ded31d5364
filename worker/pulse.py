"""Beats from inside a supervised step: ``beat()`` and the :func:`pulse` context manager.

Both read the lease from the environment the supervisor hands its child
(``OVERNIGHT_LEASE_ID``, ``OVERNIGHT_LEASE_TOKEN``, ``OVERNIGHT_REDIS_URL``,
``OVERNIGHT_NAMESPACE``), so any descendant of the child can use them. A beat is only
ever accepted for that lease, with its token, while it is running and not yet lapsed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from overnight.config.keys import Keys
from overnight.worker.lease import LeaseRefused, Leases

if TYPE_CHECKING:
    import redis

log = logging.getLogger("overnight.pulse")


class NoLease(LookupError):
    """This process does not run under a lease (the environment does not name one)."""


@dataclass(frozen=True)
class LeaseEnv:
    """The lease this process runs under, as the supervisor described it."""

    lease_id: str
    token: int
    redis_url: str
    namespace: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LeaseEnv:
        """Read the four variables; raises :class:`NoLease` if one is missing or bad."""
        env = os.environ if environ is None else environ
        lease_id = env.get("OVERNIGHT_LEASE_ID", "")
        token = env.get("OVERNIGHT_LEASE_TOKEN", "")
        if not lease_id or not token:
            raise NoLease("no lease in the environment (OVERNIGHT_LEASE_ID/_TOKEN unset)")
        if not token.isdigit():
            raise NoLease("OVERNIGHT_LEASE_TOKEN is not a number")
        return cls(
            lease_id=lease_id,
            token=int(token),
            redis_url=env.get("OVERNIGHT_REDIS_URL", "redis://127.0.0.1:6379/0"),
            namespace=env.get("OVERNIGHT_NAMESPACE", "overnight"),
        )


_lock = threading.Lock()
_clients: dict[tuple[int, str], redis.Redis] = {}


def _leases(lease: LeaseEnv) -> Leases:
    from overnight.worker.clients import client_for_url

    key = (os.getpid(), lease.redis_url)  # a forked child must not share a parent's socket
    with _lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = client_for_url(lease.redis_url, 4.0)
    return Leases(client, Keys(lease.namespace))


def beat(note: str | None = None, *, lease: LeaseEnv | None = None) -> float:
    """Renew the current lease (and set its note); returns seconds until it would lapse.

    Raises :class:`NoLease` outside a lease, :class:`~worker.lease.LeaseRefused` if the lease
    is ended, lapsed or the token is stale, and redis errors if Redis is unreachable.
    """
    lease = lease or LeaseEnv.from_env()
    return _leases(lease).beat(lease.lease_id, lease.token, note)


class Pulse:
    """A background thread that beats the current lease every ``interval`` seconds.

    Once a beat is refused the lease is over for good: the thread stops and keeps the
    refusal in :attr:`refused`. Redis errors are retried at the next tick, not fatal.
    """

    def __init__(self, lease: LeaseEnv, interval: float, note: str | None = None) -> None:
        self.lease = lease
        self.interval = interval
        self.note = note
        self.beats = 0
        self.refused: LeaseRefused | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"overnight-pulse-{lease.lease_id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop beating; returns once the thread is gone (at most one beat later)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def alive(self) -> bool:
        """True while the thread still beats."""
        return self._thread.is_alive()

    def _run(self) -> None:
        leases = _leases(self.lease)
        while not self._stop.wait(self.interval):
            try:
                leases.beat(self.lease.lease_id, self.lease.token, self.note)
                self.beats += 1
            except LeaseRefused as exc:
                self.refused = exc
                log.warning("lease=%s: pulse stopped: %s", self.lease.lease_id, exc.reason)
                return
            except Exception as exc:  # Redis blips: the next tick tries again
                log.warning("lease=%s: pulse beat failed: %s", self.lease.lease_id, exc)


@contextlib.contextmanager
def pulse(interval: float | None = None, note: str | None = None) -> Iterator[Pulse]:
    """Beat the current lease from a thread for the duration of the block.

    The first beat is made before the block starts (so a dead lease raises
    :class:`~worker.lease.LeaseRefused` at once). ``interval`` defaults to a third of the
    lease's gap, so one lost beat never lapses it. Use it only around work that is known
    to progress: a pulse keeps a lease alive even if the block hangs.
    """
    lease = LeaseEnv.from_env()
    left = beat(note, lease=lease)
    if interval is None:
        gap = _leases(lease).client.hget(Keys(lease.namespace).lease(lease.lease_id),
                                         "heartbeat_max_gap_sec")  # fmt: skip
        interval = max(0.05, float(gap or left) / 3)
    p = Pulse(lease, interval, note)
    p.start()
    try:
        yield p
    finally:
        p.stop()
