"""The reaper's rule for one lapsed lease: what was observed in, what to do out. Pure: no
Redis, no ``/proc``, no clock."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from overnight.worker.lease.store import LeaseDoc, Status, lapsed_reason, status_for

Action = Literal["skip", "prune", "reap", "end"]


@dataclass(frozen=True)
class Facts:
    """What a pass observed about one lapsed lease: the whole input of :func:`decide`.

    ``unproven`` says why the lease's processes may not be signalled (no local proof from
    its supervisor, or one that does not match the document); empty when the proof vouches.
    """

    doc: LeaseDoc | None
    alive: bool = False
    host_reaper_live: bool = False
    holder_same: bool = False
    holder_exists: bool = False
    supervisor_present: bool = False
    unproven: str = "no proof"


@dataclass(frozen=True)
class Decision:
    """What to do with one lapsed lease. ``why`` is a short word for logs and reports.

    ``reap`` signals the lease's tree, then ends it; ``end`` only ends it."""

    action: Action
    why: str
    status: Status | None = None
    note: str = ""
    signal_group: bool = False


def decide(facts: Facts, *, host: str, boot: str, now: float, hold_off: float) -> Decision:
    """The reaper's rule for one lease found in the expiry index.

    ``now`` is Redis server time; ``hold_off`` is how long past its lapse a supervisor
    that is still present is left to end its own lease before the reaper steps in.
    Nothing is ever signalled for a lease without a proof (``facts.unproven`` empty).
    """
    doc = facts.doc
    if doc is None:
        return Decision("prune", "no-document")
    if doc.status != "running":
        return Decision("prune", f"already-{doc.status}")
    if facts.alive:
        return Decision("skip", "alive")
    if doc.host != host:
        if facts.host_reaper_live:
            return Decision("skip", "host-has-reaper")
        return Decision("end", "host-lost", "killed", "reaped: host-lost")
    cause = lapsed_reason(doc, now)
    status = status_for(cause)
    if doc.boot_id and boot and doc.boot_id != boot:
        return Decision("end", "host-rebooted", status, f"reaped: {cause}, host-rebooted")
    if facts.supervisor_present and now < doc.lapse_unix + hold_off:
        return Decision("skip", "supervisor-acting")
    if doc.holder_pid <= 0 and facts.unproven:
        return Decision("end", "never-attached", status, f"reaped: {cause}, never-attached")
    if facts.unproven:
        return Decision("end", "unproven", status, f"reaped: {cause}, unproven: {facts.unproven}")
    if facts.holder_same:
        why = "supervisor-stuck" if facts.supervisor_present else "supervisor-gone"
    elif facts.holder_exists:
        why = "pid-reused"
    else:
        why = "child-gone"
    return Decision("reap", why, status, f"reaped: {cause}, {why}", signal_group=facts.holder_same)
