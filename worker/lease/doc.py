"""The lease document and the pure rules read from it: when a lease lapses, and why.

Like the store, this module imports neither redis nor pydantic (``overnight supervise`` and
``overnight beat`` start fast): :class:`LeaseDoc` is a plain dataclass.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from overnight.config.errors import OvernightError

Status = Literal["running", "done", "expired", "killed"]
STATUSES: frozenset[str] = frozenset({"running", "done", "expired", "killed"})
TERMINAL: frozenset[str] = frozenset({"done", "expired", "killed"})

CONTRACT_FIELDS = (
    "lease_id",
    "token",
    "holder_pid",
    "pgid",
    "host",
    "budget_sec",
    "started_unix",
    "deadline_unix",
    "heartbeat_unix",
    "heartbeat_max_gap_sec",
    "status",
    "note",
    "exit_code",
    "ended_unix",
)
_REQUIRED = (
    "lease_id",
    "token",
    "budget_sec",
    "started_unix",
    "deadline_unix",
    "heartbeat_unix",
    "heartbeat_max_gap_sec",
    "status",
)


class LeaseCorrupt(OvernightError, ValueError):
    """A lease record in Redis is missing a field or holds a value of the wrong type."""


@dataclass
class LeaseDoc:
    """The lease document, as ``overnight lease show`` prints it (contract section 2)."""

    lease_id: str
    token: int
    budget_sec: float
    started_unix: float
    deadline_unix: float
    heartbeat_unix: float
    heartbeat_max_gap_sec: float
    status: Status
    holder_pid: int = 0
    pgid: int = 0
    host: str = ""
    note: str = ""
    exit_code: int | None = None
    ended_unix: float | None = None
    supervisor_pid: int = 0
    child_start_ticks: int | None = None
    boot_id: str = ""
    task_id: str | None = None

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> LeaseDoc:
        """Parse a lease hash; raises :class:`LeaseCorrupt` naming the bad field."""
        data = {as_text(k): as_text(v) for k, v in raw.items()}
        lease_id = data.get("lease_id") or "?"
        for key in _REQUIRED:
            if not data.get(key):
                raise LeaseCorrupt(f"lease {lease_id}: record has no {key}")
        if data["status"] not in STATUSES:
            raise LeaseCorrupt(f"lease {lease_id}: bad status {data['status']!r}")
        values: dict[str, Any] = {"lease_id": data["lease_id"], "status": data["status"]}
        for f in dataclasses.fields(cls):
            if f.name in values or f.name not in data:
                continue
            text = data[f.name]
            kind = str(f.type)
            try:
                if kind in ("str", "Status"):
                    values[f.name] = text
                elif kind == "str | None":
                    values[f.name] = text or None
                elif not text:
                    values[f.name] = 0 if kind == "int" else None
                elif "int" in kind:
                    values[f.name] = int(text)
                else:
                    number = float(text)
                    if not math.isfinite(number):
                        raise ValueError(text)
                    values[f.name] = number
            except ValueError:
                raise LeaseCorrupt(f"lease {lease_id}: bad {f.name} {text!r}") from None
        return cls(**values)

    @property
    def lapse_unix(self) -> float:
        """When the liveness key lapses unless renewed (server clock)."""
        return min(self.heartbeat_unix + self.heartbeat_max_gap_sec, self.deadline_unix)

    def model_dump(self) -> dict[str, Any]:
        """Every field as a dict (named like pydantic's, for callers that expect it)."""
        return dataclasses.asdict(self)

    def public(self) -> dict[str, Any]:
        """The document as JSON data: the contract's keys first, then the extra ones."""
        data = self.model_dump()
        return {**{k: data[k] for k in CONTRACT_FIELDS}, **data}

    def to_json(self, indent: int | None = 2) -> str:
        """The :meth:`public` document as JSON text."""
        return json.dumps(self.public(), indent=indent)


def lapse_reason(doc: LeaseDoc, now: float) -> str | None:
    """Why a running lease is over at server time ``now``, or None while it is live.

    ``budget-exceeded`` once the deadline is crossed, else ``heartbeat-gap-X.Xs`` once the
    last beat is older than the allowed gap. Pure: no Redis, no clock.
    """
    if now >= doc.deadline_unix:
        return "budget-exceeded"
    silent = now - doc.heartbeat_unix
    if silent >= doc.heartbeat_max_gap_sec:
        return f"heartbeat-gap-{silent:.1f}s"
    return None


def lapsed_reason(doc: LeaseDoc, now: float) -> str:
    """Why a lease whose liveness key is already gone lapsed, at server time ``now``.

    The key's TTL is rounded to whole milliseconds, so it may vanish a moment before
    :func:`lapse_reason` would agree; this never returns None.
    """
    at = max(now, doc.lapse_unix)
    if at >= doc.deadline_unix - 0.002:
        return "budget-exceeded"
    return f"heartbeat-gap-{at - doc.heartbeat_unix:.1f}s"


def status_for(reason: str) -> Status:
    """The terminal status a lapse reason ends a lease with."""
    return "expired" if reason == "budget-exceeded" else "killed"


def as_text(value: Any) -> str:
    """A Redis reply value as text, whether the client decodes replies or not."""
    return value.decode() if isinstance(value, bytes) else str(value)
