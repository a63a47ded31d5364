"""The lease: a Redis document plus a liveness key whose TTL lapses at min(beat + gap, deadline).

Every transition is one Lua script in ``worker/lua/lease_*.lua`` that checks the fencing
token and the ``running`` status itself, so a terminal status is written once and a stale
holder is refused. Times inside scripts are Redis server time; callers keep local
deadlines on a monotonic clock.

This module imports neither redis nor pydantic, so ``overnight supervise`` and
``overnight beat`` start fast; :class:`LeaseDoc` is a plain dataclass.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from overnight.config import defaults
from overnight.config.errors import OvernightError
from overnight.config.keys import Keys
from overnight.worker.lease.doc import (
    CONTRACT_FIELDS,
    STATUSES,
    TERMINAL,
    LeaseCorrupt,
    LeaseDoc,
    Status,
    as_text,
    lapse_reason,
    lapsed_reason,
    status_for,
)
from overnight.worker.redisio.scripts import register
from overnight.worker.supervise import procs

if TYPE_CHECKING:
    import redis

__all__ = [
    "CONTRACT_FIELDS",
    "RETENTION_SEC",
    "STATUSES",
    "STREAM_MAXLEN",
    "TERMINAL",
    "LeaseCorrupt",
    "LeaseDoc",
    "LeaseRefused",
    "Leases",
    "Status",
    "lapse_reason",
    "lapsed_reason",
    "new_lease_id",
    "status_for",
]


def _retention() -> int:
    # OVERNIGHT_RETENTION, read without the settings model (it loads pydantic); a bad value
    # is reported by the command's own settings check, so the default stands in here.
    raw = os.environ.get("OVERNIGHT_RETENTION", "")
    return int(raw) if raw.strip().isdigit() and int(raw) > 0 else defaults.RETENTION


# Ended lease documents stay readable this long (`overnight lease show`), then expire.
RETENTION_SEC = _retention()
# Same cap as worker.redisio.receipts.STREAM_MAXLEN (a test keeps them equal); not imported from
# there because that module loads pydantic.
STREAM_MAXLEN = 1_000_000
# Leases per script call in beat_many (a script's unpack() takes a few thousand values).
BEAT_BATCH = 500


class LeaseRefused(OvernightError):
    """A lease transition was refused; ``reason`` is the script's word for why."""

    def __init__(self, lease_id: str, reason: str) -> None:
        super().__init__(f"lease {lease_id}: refused: {reason}")
        self.lease_id = lease_id
        self.reason = reason


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
        self._beat_many = register(client, "lease_beat_many")
        self._note = register(client, "lease_note")
        self._end = register(client, "lease_end")
        self._reap = register(client, "lease_reap")
        # lease id -> end key of the leases this instance acquired; only a SHA-1 is in Redis.
        self._end_keys: dict[str, str] = {}

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
        end_key = secrets.token_hex(16)
        res = self._acquire(
            keys=[
                k.lease(lease_id),
                k.lease_alive(lease_id),
                k.lease_seq,
                k.lease_expiry,
                k.leases,
                k.receipts,
            ],
            args=[
                lease_id,
                procs.hostname(),
                supervisor_pid,
                _num(budget_sec),
                _num(gap_sec),
                note,
                procs.boot_id(),
                task_id or "",
                STREAM_MAXLEN,
                RETENTION_SEC,
                hashlib.sha1(end_key.encode()).hexdigest(),
            ],
        )
        _check(lease_id, res)
        self._end_keys[lease_id] = end_key
        # The document as the script just wrote it (same strings, same parse): no read back.
        started = as_text(res[2])
        return LeaseDoc.from_hash(
            {
                "lease_id": lease_id,
                "token": as_text(res[1]),
                "holder_pid": "0",
                "pgid": "0",
                "host": procs.hostname(),
                "budget_sec": _num(budget_sec),
                "started_unix": started,
                "deadline_unix": as_text(res[3]),
                "heartbeat_unix": started,
                "heartbeat_max_gap_sec": _num(gap_sec),
                "status": "running",
                "note": note,
                "exit_code": "",
                "ended_unix": "",
                "supervisor_pid": str(supervisor_pid),
                "child_start_ticks": "",
                "boot_id": procs.boot_id(),
                "task_id": task_id or "",
            }
        )

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

    def beat_many(self, items: Sequence[tuple[str, int]]) -> list[float | str]:
        """Renew many ``(lease_id, token)`` in one round trip per :data:`BEAT_BATCH` of them
        (``lease_beat_many.lua``), each with its own checks and lapse; per item, the seconds
        until it lapses or the refusal reason (as :meth:`beat` would raise it)."""
        k = self.keys
        out: list[float | str] = []
        for start in range(0, len(items), BEAT_BATCH):
            chunk = items[start : start + BEAT_BATCH]
            keys = [k.lease_expiry]
            for lease_id, _token in chunk:
                keys += [k.lease(lease_id), k.lease_alive(lease_id)]
            replies = self._beat_many(keys=keys, args=[token for _id, token in chunk])
            out += [int(r[1]) / 1000.0 if int(r[0]) == 1 else as_text(r[1]) for r in replies]
        return out

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
        receipt_kind: str = "lease_ended",
        fetch: bool = False,
    ) -> LeaseDoc | None:
        """The holder's end (``lease_end.lua``): write a terminal status once, with the end key
        this instance got at :meth:`acquire`. Raises :class:`LeaseRefused` if someone else won
        or this instance does not hold the end key.

        With ``fetch``, returns the ended document, read in the same script; else None.
        """
        k = self.keys
        res = self._end(
            keys=[k.lease(lease_id), k.lease_alive(lease_id), k.lease_expiry, k.receipts],
            args=[
                token,
                status,
                note,
                "" if exit_code is None else exit_code,
                receipt_kind,
                STREAM_MAXLEN,
                RETENTION_SEC,
                procs.hostname(),
                "1" if fetch else "0",
                self._end_keys.get(lease_id, ""),
            ],
        )
        _check(lease_id, res)
        self._end_keys.pop(lease_id, None)
        if not fetch:
            return None
        flat = res[2]
        return LeaseDoc.from_hash(dict(zip(flat[::2], flat[1::2], strict=True)))

    def reap(
        self,
        ends: list[tuple[str, int, Status, str]],
        *,
        receipt_kind: str = "subprocess_lease_expired",
    ) -> list[str | None]:
        """The reaper's end (``lease_reap.lua``) for many ``(lease_id, token, status, note)``
        in one round trip: each ends only if its liveness key has lapsed, never as ``done``.

        Each end is still its own atomic script call; returns, per item, None if it was
        written or the refusal reason.
        """
        k = self.keys
        pipe = self.client.pipeline(transaction=False)
        for lease_id, token, status, note in ends:
            self._reap(
                keys=[k.lease(lease_id), k.lease_alive(lease_id), k.lease_expiry, k.receipts],
                args=[
                    token,
                    status,
                    note,
                    receipt_kind,
                    STREAM_MAXLEN,
                    RETENTION_SEC,
                    procs.hostname(),
                ],
                client=pipe,
            )
        return [None if int(res[0]) == 1 else as_text(res[1]) for res in pipe.execute()]

    def get(self, lease_id: str) -> LeaseDoc | None:
        """The lease document, or None if there is no such lease."""
        raw = self.client.hgetall(self.keys.lease(lease_id))
        return LeaseDoc.from_hash(raw) if raw else None

    def probe(self, lease_id: str) -> tuple[int, LeaseDoc | None, float]:
        """One round trip: ms left on the liveness key (-2 = gone), the document, server time."""
        pipe = self.client.pipeline(transaction=False)
        pipe.pttl(self.keys.lease_alive(lease_id))
        pipe.hgetall(self.keys.lease(lease_id))
        pipe.time()
        pttl, raw, (secs, micros) = pipe.execute()
        doc = LeaseDoc.from_hash(raw) if raw else None
        return int(pttl), doc, int(secs) + int(micros) / 1e6

    def is_alive(self, lease_id: str) -> bool:
        """True while the liveness key exists."""
        return bool(self.client.exists(self.keys.lease_alive(lease_id)))

    def recent(self, limit: int = 1000) -> list[LeaseDoc]:
        """The most recent leases of the namespace, newest first; unreadable ones are skipped
        (``overnight lease show ID`` names what is wrong with one)."""
        ids = self.client.zrevrange(self.keys.leases, 0, limit - 1)
        pipe = self.client.pipeline(transaction=False)
        for lease_id in ids:
            pipe.hgetall(self.keys.lease(as_text(lease_id)))
        docs = []
        for raw in pipe.execute():
            if raw:
                try:
                    docs.append(LeaseDoc.from_hash(raw))
                except LeaseCorrupt:
                    continue
        return docs

    def lapsed_ids(self, limit: int = 1000) -> list[str]:
        """Ids of running leases whose lapse time (server clock) has passed: O(log N + expired)."""
        secs, micros = self.client.time()
        now_ms = int(secs) * 1000 + int(micros) // 1000
        ids = self.client.zrangebyscore(self.keys.lease_expiry, "-inf", now_ms, start=0, num=limit)
        return [as_text(i) for i in ids]


def _check(lease_id: str, res: list[Any]) -> Any:
    ok, value = res[0], res[1]
    if int(ok) != 1:
        raise LeaseRefused(lease_id, as_text(value))
    return as_text(value) if isinstance(value, bytes) else value


def _num(value: float) -> str:
    return f"{value:g}" if float(value).is_integer() else repr(float(value))
