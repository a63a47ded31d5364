"""One ``overnight up`` at a time: per state folder (a file lock, held for the life of the
process) and per namespace (redis-py's ``Lock`` on the namespace's ``up`` key, renewed while
it runs)."""

from __future__ import annotations

import fcntl
import logging
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from overnight.config.exits import EXIT_REFUSED, CommandError
from overnight.config.folders import make_folders
from overnight.config.keys import Keys

if TYPE_CHECKING:
    import redis
    from redis.lock import Lock

log = logging.getLogger("overnight.up")
INSTANCE_TTL_MS = 15_000


def lock_state_dir(state_dir: Path) -> TextIO:
    """Hold ``state_dir``'s ``up.lock`` (made 0700 if missing) or refuse: another ``up``
    uses the folder."""
    make_folders(state_dir, 0o700)  # its own mode whatever the umask: never open to all
    fh = open(state_dir / "up.lock", "a+")  # noqa: SIM115 - held for the life of `up`
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise CommandError(
            f"another overnight up uses {state_dir}/; stop it first or run from another folder",
            EXIT_REFUSED,
        ) from None
    return fh


def claim_instance(client: redis.Redis, keys: Keys, me: str) -> Lock:
    """Take the namespace's ``up`` lock (redis-py's ``Lock``, holding ``me``) or refuse."""
    from redis.lock import Lock

    lock = Lock(
        client,
        keys.instance("up"),
        timeout=INSTANCE_TTL_MS / 1000,
        blocking=False,
        thread_local=False,
        raise_on_release_error=False,
    )
    if lock.acquire(token=me):
        return lock
    holder = client.get(keys.instance("up"))
    holder = holder.decode() if isinstance(holder, bytes) else holder
    raise CommandError(
        f"another overnight up ({holder}) runs on namespace {keys.namespace!r}; "
        "stop it or set another OVERNIGHT_NAMESPACE",
        EXIT_REFUSED,
    )


def renew_instance(lock: Lock, keys: Keys) -> None:
    """Push the lock's TTL back to the full term; take it again if it lapsed meanwhile."""
    from redis.exceptions import LockNotOwnedError

    try:
        lock.reacquire()
    except LockNotOwnedError:
        if not lock.acquire(token=lock.local.token):
            log.warning("namespace %r: another overnight up holds the lock now", keys.namespace)
