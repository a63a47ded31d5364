"""The lease: a Redis document plus a liveness key whose TTL lapses at min(beat + gap, deadline).

Every transition is one Lua script in ``worker/lua/lease_*.lua`` that checks the fencing
token and the ``running`` status itself, so a terminal status is written once and a stale
holder is refused. Times inside scripts are Redis server time; callers keep local
deadlines on a monotonic clock.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from config.keys import Keys
from worker import procs
from worker.receipts import STREAM_MAXLEN
from worker.scripts import register

if TYPE_CHECKING:
    import redis

Status = Literal["running", "done", "expired", "killed"]
TERMINAL: frozenset[str] = frozenset({"done", "expired", "killed"})
# Ended lease documents stay readable this long (`overnight lease show`), then expire.
RETENTION_SEC = 7 * 86_400
CONTRACT_FIELDS = (
    "lease_id", "token", "holder_pid", "pgid", "host", "budget_sec", "started_unix",
    "deadline_unix", "heartbeat_unix", "heartbeat_max_gap_sec", "status", "note",
    "exit_code", "ended_unix",
)  # fmt: skip


class LeaseRefused(Exception):
    """A lease transition was refused; ``reason`` is the script's word for why."""

    def __init__(self, lease_id: str, reason: str) -> None:
        super().__init__(f"lease {lease_id}: refused: {reason}")
        self.lease_id = lease_id
        self.reason = reason


class LeaseDoc(BaseModel):
    """The lease document, as ``overnight lease show`` prints it (contract section 2)."""

    lease_id: str
    token: int
    holder_pid: int = 0
    pgid: int = 0
    host: str = ""
    budget_sec: float
    started_unix: float
    deadline_unix: float
    heartbeat_unix: float
    heartbeat_max_gap_sec: float
    status: Status
    note: str = ""
    exit_code: int | None = None
    ended_unix: float | None = None
    supervisor_pid: int = 0
    child_start_ticks: int | None = None
    boot_id: str = ""
    task_id: str | None = None

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> LeaseDoc:
        data = {_text(k): _text(v) for k, v in raw.items()}
        clean: dict[str, Any] = {k: (None if v == "" else v) for k, v in data.items()}
        for key in ("holder_pid", "pgid", "supervisor_pid"):
            clean[key] = clean.get(key) or 0
        for key in ("host", "note", "boot_id"):
            clean[key] = clean.get(key) or ""
        return cls.model_validate(clean)

    @property
    def lapse_unix(self) -> float:
        """When the liveness key lapses unless renewed (server clock)."""
        return min(self.heartbeat_unix + self.heartbeat_max_gap_sec, self.deadline_unix)

    def public(self) -> dict[str, Any]:
        """The document as JSON data: the contract's keys first, then the extra ones."""
        data = self.model_dump()
        return {**{k: data[k] for k in CONTRACT_FIELDS}, **data}


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


def new_lease_id() -> str:
    return uuid.uuid4().hex[:16]


class Leases:
    """Lease transitions for one namespace. ``client`` may decode responses or not."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._acquire = register(client, "lease_acquire")
        self._attach = register(client, "lease_attach")
        self._beat = register(client, "lease_beat")
        self._note = register(client, "lease_note")
        self._end = register(client, "lease_end")

    def acquire(
        self,
        *,
        budget_sec: float,
        gap_sec: float,
        lease_id: str | None = None,
        note: str = "boot",
        supervisor_pid: int = 0,
        task_id: str | None = None,
    ) -> LeaseDoc:
        """Create a running lease; raises :class:`LeaseRefused` ('exists') if the id is taken."""
        lease_id = lease_id or new_lease_id()
        k = self.keys
        res = self._acquire(
            keys=[k.lease(lease_id), k.lease_alive(lease_id), k.lease_seq, k.lease_expiry,
                  k.leases, k.receipts],
            args=[lease_id, procs.hostname(), supervisor_pid, _num(budget_sec), _num(gap_sec),
                  note, procs.boot_id(), task_id or "", STREAM_MAXLEN, RETENTION_SEC],
        )  # fmt: skip
        _check(lease_id, res)
        doc = self.get(lease_id)
        assert doc is not None
        return doc

    def attach(self, lease_id: str, token: int, *, pid: int, pgid: int, start: int | None) -> None:
        """Record the supervised child on the lease."""
        k = self.keys
        res = self._attach(
            keys=[k.lease(lease_id), k.lease_alive(lease_id)],
            args=[token, pid, pgid, "" if start is None else start],
        )
        _check(lease_id, res)

    def beat(self, lease_id: str, token: int, note: str | None = None) -> float:
        """Renew the lease; returns seconds until it lapses. Raises :class:`LeaseRefused`."""
        k = self.keys
        res = self._beat(
            keys=[k.lease(lease_id), k.lease_alive(lease_id), k.lease_expiry],
            args=[token, "0" if note is None else "1", note or ""],
        )
        return int(_check(lease_id, res)) / 1000.0

    def set_note(self, lease_id: str, token: int, note: str) -> None:
        """Set the note of a live lease without renewing it."""
        k = self.keys
        res = self._note(keys=[k.lease(lease_id), k.lease_alive(lease_id)], args=[token, note])
        _check(lease_id, res)

    def end(
        self,
        lease_id: str,
        token: int,
        status: Status,
        note: str,
        *,
        exit_code: int | None = None,
        only_if_lapsed: bool = False,
        writer: str = "supervisor",
        receipt_kind: str = "lease_ended",
    ) -> None:
        """Write a terminal status once. Raises :class:`LeaseRefused` if someone else won."""
        k = self.keys
        res = self._end(
            keys=[k.lease(lease_id), k.lease_alive(lease_id), k.lease_expiry, k.receipts],
            args=[token, status, note, "" if exit_code is None else exit_code,
                  "1" if only_if_lapsed else "0", writer, receipt_kind, STREAM_MAXLEN,
                  RETENTION_SEC, procs.hostname()],
        )  # fmt: skip
        _check(lease_id, res)

    def get(self, lease_id: str) -> LeaseDoc | None:
        """The lease document, or None if there is no such lease."""
        raw = self.client.hgetall(self.keys.lease(lease_id))
        return LeaseDoc.from_hash(raw) if raw else None

    def is_alive(self, lease_id: str) -> bool:
        """True while the liveness key exists."""
        return bool(self.client.exists(self.keys.lease_alive(lease_id)))

    def recent(self, limit: int = 1000) -> list[LeaseDoc]:
        """The most recent leases of the namespace, newest first."""
        ids = self.client.zrevrange(self.keys.leases, 0, limit - 1)
        pipe = self.client.pipeline(transaction=False)
        for lease_id in ids:
            pipe.hgetall(self.keys.lease(_text(lease_id)))
        return [LeaseDoc.from_hash(raw) for raw in pipe.execute() if raw]

    def lapsed_ids(self, limit: int = 1000) -> list[str]:
        """Ids of running leases whose lapse time (server clock) has passed: O(log N + expired)."""
        secs, micros = self.client.time()
        now_ms = int(secs) * 1000 + int(micros) // 1000
        ids = self.client.zrangebyscore(self.keys.lease_expiry, "-inf", now_ms, start=0, num=limit)
        return [_text(i) for i in ids]


def _check(lease_id: str, res: list[Any]) -> Any:
    ok, value = res[0], res[1]
    if int(ok) != 1:
        raise LeaseRefused(lease_id, _text(value))
    return _text(value) if isinstance(value, bytes) else value


def _num(value: float) -> str:
    return f"{value:g}" if float(value).is_integer() else repr(float(value))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
