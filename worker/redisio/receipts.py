"""Typed receipts on the namespace's Redis Stream: the morning-after record of what happened.

A stream entry has two fields: ``kind`` and ``data`` (a JSON object). Lua scripts may
append entries in the same atomic step as the transition they record; Python appends
through :func:`append`. Readers get :class:`Receipt` models back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from overnight.config.keys import Keys
from overnight.worker.supervise import procs

if TYPE_CHECKING:
    import redis

# Approximate cap so a stream left alone for months stays bounded.
STREAM_MAXLEN = 1_000_000

# Processes of a lease's tree still alive after SIGKILL (data: pids, via cgroup|proc).
SURVIVORS = "lease_survivors"

KINDS = (
    "lease_acquired",
    "lease_ended",
    SURVIVORS,
    "subprocess_lease_expired",
    "envelope_reset",
    "envelope_refused",
    "task_submitted",
    "task_state",
    "verdict",
    "step_finished",
    "call_refused",
    "task_stuck",
    "model_call",
)


class Receipt(BaseModel):
    """One receipt. ``kind`` says what happened; ``data`` carries kind-specific fields."""

    model_config = ConfigDict(extra="allow")

    id: str = ""
    kind: str
    ts: float = Field(default_factory=time.time)
    host: str = Field(default_factory=procs.hostname)
    task_id: str | None = None
    lease_id: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)

    def to_json(self) -> str:
        return self.model_dump_json()


def append(client: redis.Redis, keys: Keys, receipt: Receipt) -> str:
    """Append ``receipt`` to the stream; returns the stream entry id."""
    body = receipt.model_dump(exclude={"id", "kind"})
    entry_id = client.xadd(
        keys.receipts,
        {"kind": receipt.kind, "data": json.dumps(body)},
        maxlen=STREAM_MAXLEN,
        approximate=True,
    )
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def trim_by_age(client: redis.Redis, keys: Keys, retention: float, now: float) -> int:
    """Drop receipts older than ``retention`` seconds at ``now`` (Redis server time), as
    well as the count cap every append keeps; returns how many entries went."""
    min_id = f"{max(0, int((now - retention) * 1000))}-0"
    return int(client.xtrim(keys.receipts, minid=min_id, approximate=False))


def emit(
    client: redis.Redis,
    keys: Keys,
    kind: str,
    *,
    task_id: str | None = None,
    lease_id: str | None = None,
    **data: Any,
) -> str:
    """Shorthand: build and append a receipt."""
    return append(client, keys, Receipt(kind=kind, task_id=task_id, lease_id=lease_id, data=data))


def parse(entry_id: str, fields: dict[str, str]) -> Receipt:
    """A stream entry as a :class:`Receipt` (tolerates entries written by Lua)."""
    try:
        body = json.loads(fields.get("data", "{}"))
    except json.JSONDecodeError:
        body = {"raw": fields.get("data")}
    if not isinstance(body, dict):
        body = {"raw": body}
    return Receipt(id=entry_id, kind=fields.get("kind", "unknown"), **body)


def read(
    client: redis.Redis,
    keys: Keys,
    *,
    task_id: str | None = None,
    after: str = "-",
    count: int | None = None,
) -> list[Receipt]:
    """Receipts in stream order, optionally only one task's, starting after ``after``."""
    start = after if after == "-" else f"({after}"
    rows: Any = client.xrange(keys.receipts, min=start, max="+", count=count)
    out = [parse(_text(eid), _decode(fields)) for eid, fields in rows]
    return [rc for rc in out if task_id is None or rc.task_id == task_id]


def follow(
    client: redis.Redis, keys: Keys, *, task_id: str | None = None, block_ms: int = 1000
) -> Iterator[Receipt]:
    """Every existing receipt, then new ones as they arrive (blocks; never returns)."""
    last = "0-0"
    while True:
        rows: Any = client.xread({keys.receipts: last}, block=block_ms, count=500)
        for _stream, entries in rows or []:
            for eid, fields in entries:
                last = _text(eid)
                rc = parse(last, _decode(fields))
                if task_id is None or rc.task_id == task_id:
                    yield rc


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _decode(fields: dict[Any, Any]) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in fields.items()}
