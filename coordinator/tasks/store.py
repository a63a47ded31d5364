"""Reads and atomic writes of task records (the shapes are in :mod:`record`).

Every write is one Lua script in ``coordinator/lua/task_*.lua``, run through
:class:`~coordinator.tasks.scripts.TaskScripts`. A running task is held
through a claim key with a TTL that its worker renews; all of the holder's writes carry
the claim token, so a worker that lost its claim (it stalled, or was declared dead and
its task recovered) cannot overwrite the task any more. State-change receipts are
appended by the same script as the change, so the stream never disagrees with the record.
"""

from __future__ import annotations

import uuid
from typing import Any

# The record's shapes, re-exported: callers that only read tasks import them from here too.
from overnight.coordinator.tasks.record import (
    AgentResult,
    Checkpoint,
    InFlight,
    Memory,
    Next,
    RuleResult,
    Runner,
    TaskCorrupt,
    TaskRecord,
    Verdict,
    receipt_body,
)
from overnight.coordinator.tasks.scripts import (
    Begun,
    Reason,
    TaskIdTaken,
    TaskRefused,
    TaskScripts,
    checked,
    server_time,
)
from overnight.coordinator.tasks.states import LIVE, QUEUED, RUNNING, State
from overnight.coordinator.tasks.taskfile import TaskSpec
from overnight.worker.redisio.receipts import STREAM_MAXLEN

__all__ = [
    "AgentResult",
    "Begun",
    "Checkpoint",
    "InFlight",
    "Memory",
    "Next",
    "Reason",
    "RuleResult",
    "Runner",
    "TaskCorrupt",
    "TaskIdTaken",
    "TaskRecord",
    "TaskRefused",
    "TaskStore",
    "Verdict",
    "receipt_body",
    "server_time",
]


class TaskStore(TaskScripts):
    """Reads and atomic writes of task records in one namespace."""

    # --- reading -----------------------------------------------------------------------
    def get(self, task_id: str) -> TaskRecord | None:
        raw = self.client.hgetall(self.keys.task(task_id))
        return TaskRecord.from_hash(raw) if raw and "spec" in raw else None  # type: ignore[arg-type]

    def ids(self) -> list[str]:
        return [str(x) for x in self.client.zrange(self.keys.tasks, 0, -1)]

    def all(self) -> list[TaskRecord]:
        """Every readable task of the namespace (unreadable records are skipped)."""
        ids = self.ids()
        pipe = self.client.pipeline(transaction=False)
        for task_id in ids:
            pipe.hgetall(self.keys.task(task_id))
        out = []
        for raw in pipe.execute():
            if raw and "spec" in raw:
                try:
                    out.append(TaskRecord.from_hash(raw))
                except TaskCorrupt:
                    continue  # `overnight status TASK` names what is wrong with it
        return out

    def live_ids(self, ids: list[str]) -> list[str]:
        """Those of ``ids`` that name a queued, running or paused task."""
        pipe = self.client.pipeline(transaction=False)
        for task_id in ids:
            pipe.hget(self.keys.task(task_id), "state")
        return [i for i, state in zip(ids, pipe.execute(), strict=True) if state in LIVE]

    def claim_alive(self, task_id: str) -> bool:
        return bool(self.client.exists(self.keys.task_claim(task_id)))

    # --- writing -----------------------------------------------------------------------
    def create(self, specs: list[TaskSpec], queue: str) -> list[TaskRecord]:
        """Create all tasks (ids generated where absent) or none; raises :class:`TaskIdTaken`."""
        keys: list[str] = [
            self.keys.tasks,
            self.keys.receipts,
            self.keys.task_queued,
            self.keys.tasks_ended,
        ]
        args: list[Any] = [STREAM_MAXLEN, self.queued_grace]
        filled = []
        for spec in specs:
            task_id = spec.id or f"task-{uuid.uuid4().hex[:10]}"
            spec = spec.model_copy(update={"id": task_id})
            run = uuid.uuid4().hex[:8]
            body = receipt_body(task_id, state=QUEUED, run=run, workdir=spec.workdir)
            keys += [
                self.keys.task(task_id),
                self.keys.task_claim(task_id),
                self.keys.task_charged(task_id),
            ]
            args += [task_id, spec.model_dump_json(), run, queue, body]
            filled.append((spec, run))
        result = self._run("create", keys, args)
        if int(result[0]) != 1:
            raise TaskIdTaken(str(result[1]))
        now = float(result[1])
        return [
            TaskRecord(
                id=str(spec.id),
                run=run,
                attempt=1,
                state=QUEUED,
                spec=spec,
                queue=queue,
                checkpoint=Checkpoint(),
                submitted_unix=now,
                updated_unix=now,
            )
            for spec, run in filled
        ]

    def claim(
        self, task_id: str, attempt: int, token: str, ttl: float, runner: Runner
    ) -> TaskRecord:
        """Take a queued task for ``attempt`` under ``token``; returns the record.

        Raises :class:`TaskRefused`: unknown, stale-attempt, state or claimed.
        """
        body = receipt_body(task_id, state=RUNNING, attempt=attempt, worker=runner.worker)
        result = self._run(
            "claim",
            [
                self.keys.task(task_id),
                self.keys.task_claim(task_id),
                self.keys.receipts,
                self.keys.task_claims,
                self.keys.task_queued,
            ],
            [
                attempt,
                token,
                int(ttl * 1000),
                runner.model_dump_json(),
                STREAM_MAXLEN,
                body,
                task_id,
            ],
        )
        checked(task_id, result)
        rec = self.get(task_id)
        if rec is None:
            raise TaskRefused(task_id, "unknown")
        return rec

    def renew(self, task_id: str, token: str, ttl: float) -> None:
        """Extend the claim held under ``token``; raises :class:`TaskRefused` (lost)."""
        result = self._run(
            "renew",
            [self.keys.task_claim(task_id), self.keys.task_claims],
            [token, int(ttl * 1000), task_id],
        )
        checked(task_id, result)

    def save(self, rec: TaskRecord, token: str, nxt: Next) -> float:
        """Write ``nxt`` for the task held under ``token``: the checkpoint, the state and the
        receipts, and a ``task_state`` receipt when the state changes; one script call.
        Returns the Redis server time it wrote.

        Raises :class:`TaskRefused`: illegal, lost or state.
        """
        cp = nxt.checkpoint
        args: list[Any] = [
            token,
            cp.model_dump_json(),
            nxt.state.value,
            nxt.detail,
            STREAM_MAXLEN,
            rec.id,
            self.retention,
            self.queued_grace,
        ]
        for event in nxt.events:
            args += [event.kind, receipt_body(rec.id, event.lease_id, **event.data)]
        if not nxt.goes_on:
            verdict = cp.last_verdict.model_dump() if cp.last_verdict else None
            body = receipt_body(
                rec.id,
                state=nxt.state,
                detail=nxt.detail,
                turns=cp.turns,
                attempt=rec.attempt,
                last_verdict=verdict,
            )
            args += ["task_state", body]
        result = self._run(
            "save",
            [
                self.keys.task(rec.id),
                self.keys.task_claim(rec.id),
                self.keys.receipts,
                self.keys.task_claims,
                self.keys.tasks_ended,
                self.keys.task_charged(rec.id),
                self.keys.task_queued,
            ],
            args,
        )
        return float(checked(rec.id, result)[1])

    def begin(self, rec: TaskRecord, token: str, checkpoint: Checkpoint, max_calls: int) -> Begun:
        """Begin the step in flight in ``checkpoint``: charge its call to the task's own
        ceiling (once per request id) and save the checkpoint, in one write. Raises
        :class:`TaskRefused`: lost, state or ceiling."""
        flight = checkpoint.in_flight
        if flight is None:
            raise ValueError(f"task {rec.id!r}: begin needs a step in flight")
        keys = [self.keys.task(rec.id), self.keys.task_claim(rec.id)]
        result = self._run(
            "begin",
            [*keys, self.keys.task_charged(rec.id)],
            [token, flight.request_id, max_calls, checkpoint.model_dump_json()],
        )
        reply = checked(rec.id, result)
        return Begun(int(reply[1]), float(reply[2]))

    def uncharge(self, task_id: str, token: str, request_id: str) -> int:
        """Give back the call charged for ``request_id``; returns ``calls_used`` once the
        request holds no charge of the task (given back now, or by an earlier try whose
        reply was lost). Raises :class:`TaskRefused` (lost)."""
        keys = [self.keys.task(task_id), self.keys.task_claim(task_id)]
        result = self._run(
            "uncharge", [*keys, self.keys.task_charged(task_id)], [token, request_id], again=True
        )
        return int(checked(task_id, result)[1])

    def drop_claim(self, task_id: str, attempt: int, runner_pid: int) -> None:
        """Drop the claim held by a work horse known to be dead (``runner_pid``). Raises
        :class:`TaskRefused`: state, stale-attempt, not-runner or lost."""
        keys = [self.keys.task(task_id), self.keys.task_claim(task_id), self.keys.task_claims]
        args = [attempt, runner_pid, RUNNING.value, task_id]
        checked(task_id, self._run("drop_claim", keys, args))

    def orphan(self, rec: TaskRecord, nxt: Next, attempt: int) -> None:
        """Move a running task whose claim lapsed (read as ``rec``) to ``nxt`` under
        ``attempt``. Raises :class:`TaskRefused`: illegal, alive, state or stale-attempt."""
        state, detail = nxt.state, nxt.detail
        body = receipt_body(rec.id, state=state, detail=detail, attempt=attempt, recovered=True)
        result = self._run(
            "orphan",
            [
                self.keys.task(rec.id),
                self.keys.task_claim(rec.id),
                self.keys.receipts,
                self.keys.task_claims,
                self.keys.task_queued,
                self.keys.tasks_ended,
                self.keys.task_charged(rec.id),
            ],
            [
                rec.attempt,
                state.value,
                nxt.checkpoint.model_dump_json(),
                detail,
                attempt,
                STREAM_MAXLEN,
                body,
                rec.id,
                self.queued_grace,
                self.retention,
            ],
        )
        checked(rec.id, result)

    def resume(self, rec: TaskRecord, checkpoint: Checkpoint) -> None:
        """Queue a paused task again for its next attempt. Raises :class:`TaskRefused`:
        state or stale-attempt."""
        attempt = rec.attempt + 1
        body = receipt_body(rec.id, state=QUEUED, attempt=attempt, reconciled="resume")
        result = self._run(
            "resume",
            [self.keys.task(rec.id), self.keys.receipts, self.keys.task_queued],
            [
                rec.attempt,
                checkpoint.model_dump_json(),
                attempt,
                STREAM_MAXLEN,
                body,
                rec.id,
                self.queued_grace,
            ],
        )
        checked(rec.id, result)

    def rerun(self, rec: TaskRecord, spec: TaskSpec, checkpoint: Checkpoint, run: str) -> None:
        """Queue an ended task again for its next attempt, with ``spec``, ``checkpoint`` and
        ``run``; its calls_used and receipts stay, its deadline starts again. Raises
        :class:`TaskRefused`: state (it has not ended) or stale-attempt."""
        attempt = rec.attempt + 1
        body = receipt_body(
            rec.id, state=QUEUED, attempt=attempt, rerun=True, run=run, was=rec.state
        )
        result = self._run(
            "rerun",
            [
                self.keys.task(rec.id),
                self.keys.receipts,
                self.keys.task_queued,
                self.keys.tasks_ended,
                self.keys.task_charged(rec.id),
                self.keys.task_claim(rec.id),
            ],
            [
                rec.attempt,
                checkpoint.model_dump_json(),
                attempt,
                spec.model_dump_json(),
                run,
                STREAM_MAXLEN,
                body,
                rec.id,
                self.queued_grace,
            ],
        )
        checked(rec.id, result)

    def abort(self, task_id: str, detail: str) -> None:
        """End a live task as aborted. Raises :class:`TaskRefused` (state: it has ended)."""
        body = receipt_body(task_id, state=State.ABORTED, detail=detail, reconciled="abort")
        result = self._run(
            "abort",
            [
                self.keys.task(task_id),
                self.keys.task_claim(task_id),
                self.keys.receipts,
                self.keys.task_claims,
                self.keys.task_queued,
                self.keys.tasks_ended,
                self.keys.task_charged(task_id),
            ],
            [detail, STREAM_MAXLEN, body, task_id, self.retention],
        )
        checked(task_id, result)

    # --- the recovery index and retention ---------------------------------------------
    def lapsed_claims(self, now_ms: int, limit: int = 1000) -> list[str]:
        """Running tasks whose claim lapsed by ``now_ms`` (server ms), by the claim index."""
        rows = self.client.zrangebyscore(self.keys.task_claims, "-inf", now_ms, 0, limit)
        return [str(x) for x in rows]

    def queued_due(self, now: float, limit: int = 500) -> list[str]:
        """Queued tasks whose RQ job recovery should check by ``now`` (server seconds)."""
        rows = self.client.zrangebyscore(self.keys.task_queued, "-inf", now, 0, limit)
        return [str(x) for x in rows]

    def queued_checked(self, task_ids: list[str], now: float) -> None:
        """Push the next check of these queued tasks one grace past ``now`` (only those
        still in the queued index: a task claimed meanwhile is not put back)."""
        if task_ids:
            due = now + self.queued_grace
            self.client.zadd(self.keys.task_queued, dict.fromkeys(task_ids, due), xx=True)

    def forget_expired(self, now: float, limit: int = 1000) -> int:
        """Drop tasks whose retention is over (their record expired) from the task index;
        returns how many. Reads only those ended longer ago than the retention."""
        cutoff = now - self.retention
        ids = [
            str(x)
            for x in self.client.zrangebyscore(self.keys.tasks_ended, "-inf", cutoff, 0, limit)
        ]
        if not ids:
            return 0
        keys = [self.keys.tasks, self.keys.tasks_ended, *(self.keys.task(i) for i in ids)]
        return int(self._run("forget", keys, ids))
