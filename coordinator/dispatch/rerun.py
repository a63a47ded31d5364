"""When a task whose worker was lost may be run again: never while a lease of its step could
still be alive on some host.

A host cut off from Redis keeps its step running until its supervisor gives up (before the
lease's liveness key lapses, counting its own socket timeouts), then the grace to end the
tree. A lease ended ``reaped: host-lost`` by another host's reaper says nothing about that
tree: it was ended in Redis, not on its host. So a step's lease is proven over only when
its own host ended it (its supervisor, or the reaper beside it, kill before they write);
otherwise it may run until its lapse plus the kill margin (grace plus :data:`KILL_MARGIN`).

:func:`alive_until` and :func:`rerun_at` are pure; :func:`step_leases` reads the leases.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from overnight.worker.lease.store import LeaseCorrupt, LeaseDoc

if TYPE_CHECKING:
    import redis

    from overnight.config.keys import Keys
    from overnight.coordinator.tasks.record import TaskRecord

log = logging.getLogger("overnight.recovery")

# Beyond the grace: the supervisor's last poll and the delivery of SIGKILL.
KILL_MARGIN = 1.0
# Leases started this long before the step's begin are still looked at (clock drift).
BEGIN_SLACK = 60.0
HOST_LOST = "reaped: host-lost"


def kill_margin(grace: float) -> float:
    """How long after its lapse a lease's tree may still be alive on a cut-off host."""
    return grace + KILL_MARGIN


def alive_until(doc: LeaseDoc, margin: float) -> float | None:
    """The server time until which ``doc``'s tree could still be alive, or None if its own
    host ended it (so it is gone)."""
    if doc.status == "running" or doc.note.startswith(HOST_LOST):
        return doc.lapse_unix + margin
    return None


def rerun_at(docs: Iterable[LeaseDoc], margin: float) -> tuple[float, LeaseDoc] | None:
    """The latest :func:`alive_until` of ``docs`` and its lease, or None if all are over."""
    latest: tuple[float, LeaseDoc] | None = None
    for doc in docs:
        until = alive_until(doc, margin)
        if until is not None and (latest is None or until > latest[0]):
            latest = (until, doc)
    return latest


def step_leases(client: redis.Redis, keys: Keys, task_id: str, since_unix: float) -> list[LeaseDoc]:
    """The leases of ``task_id`` started since ``since_unix`` (less :data:`BEGIN_SLACK`)."""
    low = f"{(since_unix - BEGIN_SLACK) * 1000:.0f}"
    ids: list[str | bytes] = list(client.zrangebyscore(keys.leases, low, "+inf"))  # type: ignore[arg-type]
    pipe = client.pipeline(transaction=False)
    for lease_id in ids:
        pipe.hgetall(keys.lease(lease_id if isinstance(lease_id, str) else lease_id.decode()))
    docs: list[LeaseDoc] = []
    for raw in pipe.execute():
        if not raw:
            continue
        try:
            doc = LeaseDoc.from_hash(raw)
        except LeaseCorrupt:
            continue
        if doc.task_id == task_id:
            docs.append(doc)
    return docs


def wait_for_step(
    client: redis.Redis, keys: Keys, task_id: str, begun_unix: float, grace: float, now: float
) -> tuple[float, LeaseDoc] | None:
    """If a step of ``task_id`` begun at ``begun_unix`` could still be running on some host
    at server time ``now``: until when, and its lease. None: the task may be run again."""
    found = rerun_at(step_leases(client, keys, task_id, begun_unix), kill_margin(grace))
    if found is None or found[0] <= now:
        return None
    return found


def step_may_run(
    client: redis.Redis, keys: Keys, rec: TaskRecord, grace: float, now: float
) -> bool:
    """True while a lease of ``rec``'s step in flight could still be alive on some host at
    server time ``now``: recovery must not run the task anywhere else yet (a later pass
    will). False when no step is in flight."""
    flight = rec.checkpoint.in_flight
    if flight is None:
        return False
    found = wait_for_step(client, keys, rec.id, flight.started_unix, grace, now)
    if found is None:
        return False
    until, doc = found
    log.info(
        "task %s: worker lost, but lease %s (host %s) may still run for %.1fs; "
        "not re-run before then",
        rec.id,
        doc.lease_id,
        doc.host,
        until - now,
    )
    return True
