"""The recovery lead of a namespace: at most one process runs recovery passes at a time."""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import TYPE_CHECKING

from redis.exceptions import LockNotOwnedError
from redis.lock import Lock

from overnight.worker.supervise.procs import hostname

if TYPE_CHECKING:
    import redis

    from overnight.config.keys import Keys
    from overnight.config.settings import Settings


class RecoveryLead:
    """The recovery lead of a namespace: at most one process holds it (redis-py's ``Lock``
    on the namespace's leader key, holding this process's token); whoever holds it runs the
    passes, the others do not. A holder that dies or stalls loses it after ``ttl`` seconds
    and another takes over."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl: float) -> None:
        self.token = f"{hostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._lock = Lock(
            client,
            keys.recovery_leader,
            timeout=max(1000, int(ttl * 1000)) / 1000,
            blocking=False,
            thread_local=False,
            raise_on_release_error=False,
        )

    def hold(self) -> bool:
        """Take or renew the lead; True if this process leads now."""
        if self._lock.local.token is not None:
            with contextlib.suppress(LockNotOwnedError):
                self._lock.reacquire()
                return True
        return bool(self._lock.acquire(token=self.token))

    def release(self) -> None:
        """Give the lead up (best effort: it lapses anyway)."""
        with contextlib.suppress(Exception):
            self._lock.release()


def lead_ttl(settings: Settings) -> float:
    """How long the recovery lead outlives its last renewal: three passes."""
    return max(3.0, 3 * settings.recovery_interval)
