"""How a supervised step ends: the rows of contract section 2's table, as plain values.

Each function is one row: the terminal status and note the lease is ended with, the
``supervise`` exit code, and the first signal the tree gets. Pure: no Redis, no processes,
no clock.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from overnight.config.exits import EXIT_HEARTBEAT_GAP, EXIT_LEASE_LOST, EXIT_REFUSED
from overnight.worker.lease.store import Status, status_for


@dataclass(frozen=True)
class Outcome:
    """One way a step ends. ``write`` is False when another writer already ended the lease;
    ``lost`` when the lease could not be kept (Redis gone, record gone)."""

    status: Status
    note: str
    exit_code: int
    receipt_kind: str = "lease_ended"
    first_signal: int = signal.SIGTERM
    write: bool = True
    lost: bool = False


def child_ended(exited: bool, status: int) -> Outcome:
    """The child exited with code ``status`` (``exited``) or was killed by signal ``status``."""
    if not exited:
        return Outcome("killed", f"worker-signal-{status}", 128 + status)
    if status == 0:
        return Outcome("done", "worker-complete", 0)
    return Outcome("killed", f"worker-exit-{status}", status)


def not_started(exc: OSError) -> Outcome:
    """The command could not be started: 127 if it does not exist, else 126 (as a shell)."""
    code = 127 if isinstance(exc, FileNotFoundError) else 126
    return Outcome("killed", f"worker-exit-{code}", code)


def by_signal(sig: int) -> Outcome:
    """The supervisor got ``sig``: the tree gets it first, the exit is 128 + ``sig``."""
    return Outcome("killed", f"supervisor-signal-{sig}", 128 + sig, first_signal=sig)


def lapsed(reason: str) -> Outcome:
    """The lease lapsed: ``budget-exceeded`` (expired, exit 2) or a heartbeat gap (exit 3)."""
    status = status_for(reason)
    code = EXIT_REFUSED if status == "expired" else EXIT_HEARTBEAT_GAP
    return Outcome(status, reason, code, receipt_kind="subprocess_lease_expired")


def ended_elsewhere(status: str) -> Outcome:
    """Another writer (the reaper) ended the lease with ``status``: nothing left to write."""
    code = EXIT_REFUSED if status == "expired" else EXIT_HEARTBEAT_GAP
    return Outcome("killed", f"ended-elsewhere:{status}", code, write=False)


def call_refused(detail: str) -> Outcome:
    """The gateway refused one of the step's model calls (its budget is spent): the step is
    ended, so a client's retry loop burns nothing more (exit 2, note ``call-refused: …``)."""
    line = " ".join(detail.split())[:300]
    return Outcome("killed", f"call-refused: {line}", EXIT_REFUSED)


def over_limit(note: str) -> Outcome:
    """The step's tree went over one of its limits (``note``: ``over-limit: <words>``, from
    :func:`worker.sandbox.limits.note`): killed at once, no grace (exit 2)."""
    return Outcome("killed", note, EXIT_REFUSED, first_signal=signal.SIGKILL)


def lost() -> Outcome:
    """The lease cannot be kept (Redis unreachable for the gap, or its record gone)."""
    return Outcome("killed", "lease-lost", EXIT_LEASE_LOST, lost=True)


def aborted(exc: BaseException) -> Outcome:
    """The supervisor itself failed with ``exc``."""
    return Outcome("killed", f"supervisor-error:{type(exc).__name__}", 1)
