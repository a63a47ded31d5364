"""The token fields of ``overnight status``: what the gateway charged each task.

``tokens_used`` is what the gateway's commit added to the task's record (input + output, or
its estimate or hold when the upstream reported none): the count its ``max_tokens`` is held
against. ``input_tokens`` and ``output_tokens`` are the upstream's own figures, totalled from
the task's ``model_call`` receipts since it was submitted (a resubmitted id starts again).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from overnight.worker.redisio.receipts import Receipt, read

if TYPE_CHECKING:
    import redis

    from overnight.config.keys import Keys
    from overnight.coordinator.tasks.record import TaskRecord

# Contract-facing names: tokens_used beside calls_used, max_tokens as in the task file and the
# envelope state, input_/output_tokens as in the model_call receipts.
FIELDS = ("tokens_used", "input_tokens", "output_tokens", "max_tokens")


def _ms(entry_id: str) -> int:
    head = entry_id.split("-", 1)[0]
    return int(head) if head.isdigit() else 0


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def ledger_tokens(receipts: Iterable[Receipt], since_ms: dict[str, int]) -> dict[str, list[int]]:
    """[input, output] per task of ``since_ms``, from its ``model_call`` receipts whose stream
    id is at or after the task's submission (in ms)."""
    totals = {task: [0, 0] for task in since_ms}
    for rc in receipts:
        task = rc.task_id
        if rc.kind != "model_call" or task not in totals or _ms(rc.id) < since_ms[task]:
            continue
        totals[task][0] += _count(rc.data.get("input_tokens"))
        totals[task][1] += _count(rc.data.get("output_tokens"))
    return totals


def token_fields(
    client: redis.Redis, keys: Keys, records: list[TaskRecord]
) -> dict[str, dict[str, int | None]]:
    """The token fields of each task in ``records``, by task id."""
    if not records:
        return {}
    pipe = client.pipeline(transaction=False)
    for rec in records:
        pipe.hget(keys.task(rec.id), "tokens_used")
    used = pipe.execute()
    since = {rec.id: int(rec.submitted_unix * 1000) for rec in records}
    start = min(since.values())
    rows = read(client, keys, after=f"{start - 1}-18446744073709551615" if start > 0 else "-")
    ledger = ledger_tokens(rows, since)
    out: dict[str, dict[str, int | None]] = {}
    for rec, raw in zip(records, used, strict=True):
        text = raw.decode() if isinstance(raw, bytes) else raw
        out[rec.id] = {
            "tokens_used": int(text) if text and text.lstrip("-").isdigit() else 0,
            "input_tokens": ledger[rec.id][0],
            "output_tokens": ledger[rec.id][1],
            "max_tokens": rec.spec.max_tokens,
        }
    return out


def with_tokens(status: dict[str, Any], tokens: dict[str, int | None]) -> dict[str, Any]:
    """``status`` with the token fields placed right after ``max_calls``."""
    out: dict[str, Any] = {}
    for key, value in status.items():
        out[key] = value
        if key == "max_calls":
            out.update(tokens)
    out.update({k: v for k, v in tokens.items() if k not in out})
    return out
