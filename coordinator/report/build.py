"""The morning report, built: a pure function from (task records, receipts, envelope states,
now) to a :class:`~coordinator.report.model.Report`. Nothing here reads Redis, git or the
clock."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from overnight.coordinator.report.model import (
    LEASE_ENDS,
    LOST,
    RUNNING,
    Attention,
    Bar,
    Card,
    EnvelopeView,
    Ledger,
    Mark,
    Report,
    concurrency,
    ending_class,
)
from overnight.coordinator.tasks.record import TaskRecord
from overnight.coordinator.tasks.states import PAUSED, TERMINAL, State
from overnight.worker.redisio.receipts import Receipt


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def build(
    records: Iterable[TaskRecord],
    receipts: Iterable[Receipt],
    envelopes: Mapping[str, Mapping[str, Any]],
    now: float,
    *,
    namespace: str = "",
    diffs: Mapping[str, str] | None = None,
    notices: Iterable[str] = (),
    sandbox: str = "",
) -> Report:
    """The report of ``records`` as ``receipts`` tell it, with each envelope's state
    (``CallEnvelope.snapshot().model_dump()`` by name) at ``now``. ``diffs`` maps a task id to
    its branch's diff against its base, when the caller could compute it; ``notices`` are
    lines the page shows first (what the night ran without that it should have had);
    ``sandbox`` says how steps were contained, host by host."""
    recs = sorted(records, key=lambda r: (r.submitted_unix, r.id))
    ids = {r.id for r in recs}
    rcs = [rc for rc in receipts if rc.task_id is None or rc.task_id in ids]
    bars, workers = _bars(recs, rcs, now)
    marks = _marks(rcs)
    cards = tuple(_card(r, rcs, (diffs or {}).get(r.id, ""), bars) for r in recs)
    counts: dict[str, int] = {}
    for rec in recs:
        counts[rec.state.value] = counts.get(rec.state.value, 0) + 1
    times = [r.submitted_unix for r in recs] + [b.start for b in bars]
    start = min(times) if times else now
    finished = all(r.state in TERMINAL | {PAUSED} for r in recs) and recs
    ends = [r.ended_unix or r.updated_unix or r.submitted_unix for r in recs] + [
        b.end for b in bars
    ]
    end = max(ends) if finished and ends else now
    task_env = {r.id: r.spec.envelope for r in recs}
    return Report(
        namespace=namespace,
        generated=now,
        start=start,
        end=max(start, end),
        counts=counts,
        attention=tuple(_attention(recs, rcs)),
        envelopes=tuple(
            _envelope(name, envelopes.get(name, {}), rcs, bars, task_env)
            for name in sorted(set(task_env.values()) | set(envelopes))
        ),
        bars=tuple(bars),
        marks=tuple(marks),
        cards=cards,
        concurrency=concurrency(bars),
        workers=tuple(workers),
        notices=tuple(notices),
        sandbox=sandbox,
    )


def _bars(recs: list[TaskRecord], rcs: list[Receipt], now: float) -> tuple[list[Bar], list[str]]:
    running = {r.id for r in recs if r.state == State.RUNNING}
    flights = {r.id: r.checkpoint.in_flight for r in recs if r.checkpoint.in_flight}
    starts: dict[str, Receipt] = {}
    ends: dict[str, Receipt] = {}
    finished: dict[str, Receipt] = {}
    refused: set[str] = set()
    claims: dict[str, list[tuple[float, str]]] = {}
    for rc in rcs:
        lease = rc.lease_id or ""
        if rc.kind == "lease_acquired" and rc.task_id and lease:
            starts[lease] = rc
        elif rc.kind in LEASE_ENDS and lease:
            ends.setdefault(lease, rc)
        elif rc.kind == "step_finished" and lease:
            finished[lease] = rc
        elif rc.kind == "call_refused" and lease:
            refused.add(lease)
        elif rc.kind == "task_state" and rc.task_id and rc.data.get("state") == State.RUNNING:
            worker = str(rc.data.get("worker") or rc.host)
            claims.setdefault(rc.task_id, []).append((rc.ts, worker))
    bars = []
    for lease, rc in starts.items():
        task_id = str(rc.task_id)
        end_rc, step_rc = ends.get(lease), finished.get(lease)
        step = step_rc.data if step_rc is not None else {}
        status = str(end_rc.data.get("status", "")) if end_rc is not None else ""
        note = str(end_rc.data.get("note", "")) if end_rc is not None else ""
        if end_rc is not None:
            end = end_rc.ts
        elif step_rc is not None:
            end = step_rc.ts
            status, note = str(step.get("status", "")), str(step.get("note", ""))
        else:
            end = now
        ending = ending_class(
            status, note, stopped=bool(step.get("stopped")), refused=lease in refused
        )
        if ending == RUNNING and task_id not in running:
            ending = LOST
        flight = flights.get(task_id) if step_rc is None else None
        name = str(step.get("step", "")) or (flight.name if flight else "") or "step"
        turn = step.get("turn", flight.turn if flight else None)
        worker = next((w for t, w in reversed(claims.get(task_id, [])) if t <= rc.ts + 1e-3), "")
        bars.append(
            Bar(
                task_id=task_id,
                kind="agent" if name == "agent" else "verifier",
                name=name,
                turn=_int(turn) if turn is not None else None,
                start=rc.ts,
                end=max(rc.ts, end),
                ending=ending,
                status=status,
                note=note,
                said=str(step.get("ending", "")),
                exit_code=_int(step.get("exit_code"), 0)
                if step.get("exit_code") is not None
                else None,
                host=rc.host,
                worker=worker or rc.host,
                lease_id=lease,
            )
        )
    bars.sort(key=lambda b: (b.start, b.task_id))
    workers = sorted({b.worker for b in bars})
    return bars, workers


def _marks(rcs: list[Receipt]) -> list[Mark]:
    out = []
    for rc in rcs:
        if not rc.task_id:
            continue
        data = rc.data
        if rc.kind == "task_state":
            state = str(data.get("state", ""))
            if state == PAUSED:
                out.append(Mark(rc.task_id, rc.ts, "pause", str(data.get("detail", ""))))
            elif state == State.QUEUED and data.get("recovered"):
                out.append(Mark(rc.task_id, rc.ts, "retry", str(data.get("detail", ""))))
        elif rc.kind == "call_refused":
            out.append(Mark(rc.task_id, rc.ts, "refused", str(data.get("detail", ""))))
        elif rc.kind == "task_stopped":
            out.append(Mark(rc.task_id, rc.ts, "stop", str(data.get("detail", ""))))
        elif rc.kind == "verdict":
            failed = data.get("failed") or []
            text = "every rule passed" if not failed else "failing: " + ", ".join(map(str, failed))
            out.append(Mark(rc.task_id, rc.ts, "verdict", f"turn {data.get('turn')}: {text}"))
    return out


def _ledger(task_id: str, rcs: list[Receipt]) -> Ledger | None:
    calls = [rc.data for rc in rcs if rc.kind == "model_call" and rc.task_id == task_id]
    if not calls:
        return None
    return Ledger(
        requests=len(calls),
        model_units=sum(_int(d.get("model_units"), 1) for d in calls),
        tool_calls=sum(_int(d.get("tool_calls")) for d in calls),
        tokens=sum(_int(d.get("tokens")) for d in calls),
        input_tokens=sum(_int(d.get("input_tokens")) for d in calls),
        output_tokens=sum(_int(d.get("output_tokens")) for d in calls),
        refunded=sum(1 for d in calls if d.get("refunded")),
        failed=sum(1 for d in calls if _int(d.get("status")) >= 400),
    )


def _card(rec: TaskRecord, rcs: list[Receipt], diff: str, bars: list[Bar]) -> Card:
    cp = rec.checkpoint
    verdict = cp.last_verdict
    memory = cp.memory
    return Card(
        task_id=rec.id,
        state=rec.state.value,
        detail=rec.detail,
        assignment=rec.spec.assignment,
        turns=rec.turns,
        calls_used=rec.calls_used,
        max_calls=rec.spec.max_calls,
        envelope=rec.spec.envelope,
        attempt=rec.attempt,
        started=rec.started_unix,
        ended=rec.ended_unix,
        verdict_turn=verdict.turn if verdict else None,
        passed=tuple(verdict.passed) if verdict else (),
        failed=tuple(verdict.failed) if verdict else (),
        failing_rule=memory.rule if memory and verdict and verdict.failed else "",
        evidence=memory.evidence if memory and verdict and verdict.failed else "",
        endings=tuple(cp.endings),
        branch=cp.branch or "",
        head=cp.head or "",
        diffstat=cp.diffstat,
        diff=diff,
        protected_changed=tuple(cp.protected_changed),
        ledger=_ledger(rec.id, rcs),
        steps=sum(1 for b in bars if b.task_id == rec.id),
    )


def _attention(recs: list[TaskRecord], rcs: list[Receipt]) -> list[Attention]:
    out = []
    for rec in recs:
        if rec.state == PAUSED:
            out.append(Attention(rec.id, "paused", rec.detail or "paused for reconciliation"))
        if rec.state == State.AGENT_FAILED:
            out.append(Attention(rec.id, "agent_failed", rec.detail or "the agent could not start"))
        if rec.checkpoint.protected_changed:
            paths = ", ".join(rec.checkpoint.protected_changed)
            out.append(Attention(rec.id, "tampering", f"changed protected paths: {paths}"))
    for rc in rcs:
        if rc.kind == "lease_survivors" and rc.task_id:
            pids = rc.data.get("pids") or []
            out.append(
                Attention(
                    rc.task_id, "survivors", f"{len(pids)} processes outlived their lease's kill"
                )
            )
    return out


def _envelope(
    name: str,
    state: Mapping[str, Any],
    rcs: list[Receipt],
    bars: list[Bar],
    task_env: Mapping[str, str],
) -> EnvelopeView:
    resets = [
        rc for rc in rcs if rc.kind == "envelope_reset" and rc.data.get("envelope", name) == name
    ]
    since = resets[-1].ts if resets else float("-inf")
    ledger_tasks = {rc.task_id for rc in rcs if rc.kind == "model_call"}
    spends: list[tuple[float, int]] = []
    for bar in bars:
        if task_env.get(bar.task_id) != name or bar.start < since:
            continue
        if bar.kind == "agent" and bar.task_id in ledger_tasks:
            continue  # metered per request below
        spends.append((bar.start, 1))
    for rc in rcs:
        if rc.kind == "model_call" and rc.task_id and task_env.get(rc.task_id) == name:
            units = _int(rc.data.get("model_units"), 1) + _int(rc.data.get("tool_units_charged"))
            if units and rc.ts >= since:
                spends.append((rc.ts, units))
    spends.sort()
    burn: list[tuple[float, int]] = [(since, 0)] if resets else []
    total = 0
    for at, units in spends:
        total += units
        burn.append((at, total))
    consumed_model = _int(state.get("consumed_model"))
    consumed_tool = _int(state.get("consumed_tool"))
    remaining = _int(state.get("remaining"))
    budget = _int(state.get("budget")) or remaining + consumed_model + consumed_tool
    return EnvelopeView(
        name=name,
        exists=bool(state.get("exists", bool(state))),
        budget=budget,
        remaining=remaining,
        consumed_model=consumed_model,
        consumed_tool=consumed_tool,
        consumed_tokens=_int(state.get("consumed_tokens")),
        max_tokens=_int(state["max_tokens"]) if state.get("max_tokens") is not None else None,
        burn=tuple(burn),
    )
