"""A task's record in Redis: its spec, state and checkpointed loop state.

Every write is one Lua script in ``coordinator/lua/task_*.lua``. A running task is held
through a claim key with a TTL that its worker renews; all of the holder's writes carry
the claim token, so a worker that lost its claim (it stalled, or was declared dead and
its task recovered) cannot overwrite the task any more. State-change receipts are
appended by the same script as the change, so the stream never disagrees with the record.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import BaseModel, Field, ValidationError

from overnight.config.keys import Keys
from overnight.coordinator.states import LIVE, QUEUED, RUNNING, Op, State, lua_prelude
from overnight.coordinator.taskfile import TaskSpec
from overnight.worker.receipts import STREAM_MAXLEN, Receipt

if TYPE_CHECKING:
    import redis
    from redis.commands.core import Script

# Why a task script refused a write. ``state``: the record is in a state the write may not
# come from; ``illegal``: the table has no such write at all (a bug in the caller).
Reason = Literal[
    "unknown",
    "stale-attempt",
    "state",
    "illegal",
    "claimed",
    "lost",
    "alive",
    "ceiling",
    "taken",
    "not-runner",
]


class RuleResult(BaseModel):
    """One verifier rule's run in one turn."""

    name: str
    passed: bool
    exit_code: int | None = None
    note: str = ""
    lease_id: str | None = None
    tail: str = ""


class AgentResult(BaseModel):
    """The agent step of one turn: how it ended and a digest of what it printed."""

    exit_code: int | None = None
    note: str = ""
    lease_id: str | None = None
    digest: str = ""
    tail: str = ""


class Verdict(BaseModel):
    """The verifier's answer for one turn."""

    turn: int
    passed: list[str] = Field(default_factory=list)
    failed: list[str] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed


class Memory(BaseModel):
    """Counterexample memory: what the next prompt must tell the agent."""

    unmet: list[str]
    rule: str
    note: str = ""
    evidence: str = ""


class InFlight(BaseModel):
    """A step that was started and has not been recorded as ended."""

    turn: int
    step: int
    name: str
    request_id: str
    started_unix: float


class Checkpoint(BaseModel):
    """Loop state saved after every step; ``(turn, step)`` names the next step to run."""

    turn: int = 1
    step: int = 0
    turns: int = 0
    in_flight: InFlight | None = None
    agent: AgentResult | None = None
    results: list[RuleResult] = Field(default_factory=list)
    last_verdict: Verdict | None = None
    memory: Memory | None = None
    fingerprint: str | None = None
    repeats: int = 0
    lost_leases: int = 0


class Runner(BaseModel):
    """Which worker process holds the task."""

    host: str = ""
    pid: int = 0
    worker: str = ""
    job_id: str = ""


class TaskRecord(BaseModel):
    """A task as stored: what ``overnight status TASK`` shows."""

    id: str
    run: str
    attempt: int
    state: State
    queue: str = ""
    detail: str = ""
    calls_used: int = 0
    spec: TaskSpec
    checkpoint: Checkpoint
    submitted_unix: float
    started_unix: float | None = None
    ended_unix: float | None = None
    updated_unix: float | None = None
    runner: Runner | None = None

    @property
    def turns(self) -> int:
        """Turns begun so far (a turn counts once its agent step was granted a call)."""
        return self.checkpoint.turns

    def job_id(self, attempt: int | None = None) -> str:
        """The RQ job id of one attempt (RQ allows letters, digits, '_' and '-')."""
        return f"{self.id}-{self.run}-{attempt or self.attempt}"

    @classmethod
    def from_hash(cls, raw: dict[str, str]) -> TaskRecord:
        """Parse a task hash; raises :class:`TaskCorrupt` (one line) if it is unreadable."""
        try:
            return cls._parse(raw)
        except (KeyError, ValueError) as exc:
            raise TaskCorrupt(str(raw.get("id") or "?"), exc) from None

    @classmethod
    def _parse(cls, raw: dict[str, str]) -> TaskRecord:
        def number(key: str) -> float | None:
            value = raw.get(key)
            return float(value) if value else None

        runner = raw.get("runner")
        return cls(
            id=raw["id"],
            run=raw.get("run", ""),
            attempt=int(raw.get("attempt") or 1),
            state=State(raw.get("state", "")),
            queue=raw.get("queue", ""),
            detail=raw.get("detail", ""),
            calls_used=int(raw.get("calls_used") or 0),
            spec=TaskSpec.model_validate_json(raw["spec"]),
            checkpoint=Checkpoint.model_validate_json(raw.get("checkpoint") or "{}"),
            submitted_unix=number("submitted_unix") or 0.0,
            started_unix=number("started_unix"),
            ended_unix=number("ended_unix"),
            updated_unix=number("updated_unix"),
            runner=Runner.model_validate_json(runner) if runner else None,
        )


class TaskCorrupt(ValueError):
    """A task record in Redis is missing a field or holds one that does not parse."""

    def __init__(self, task_id: str, exc: Exception) -> None:
        if isinstance(exc, ValidationError):
            err = exc.errors()[0]
            where = ".".join(str(part) for part in err["loc"]) or exc.title
            why = f"bad {where}: {err['msg']}"
        elif isinstance(exc, KeyError):
            why = f"record has no {exc.args[0]}"
        else:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        super().__init__(f"task {task_id!r}: unreadable record: {why}")
        self.task_id = task_id


class TaskRefused(Exception):
    """A task script refused a write; ``reason`` says why and ``state`` names the state that
    made it refuse (the record's for ``state``, the target's for ``illegal``)."""

    def __init__(self, task_id: str, reason: Reason, state: str = "") -> None:
        self.task_id, self.reason, self.state = task_id, reason, state
        super().__init__(f"task {task_id!r}: refused: {self.why}")

    @property
    def why(self) -> str:
        """The script's word for the refusal, e.g. ``stale-attempt`` or ``state:aborted``."""
        return f"{self.reason}:{self.state}" if self.state else self.reason


class TaskIdTaken(TaskRefused):
    """A submitted id names a task that is still live."""

    def __init__(self, task_id: str) -> None:
        super().__init__(task_id, "taken")

    def __str__(self) -> str:
        return f"id {self.task_id!r} names a task that is still live"


def _checked(task_id: str, result: list[Any]) -> list[Any]:
    """A script's reply ``{1, ...}``, or :class:`TaskRefused` for its ``{0, reason}``."""
    if int(result[0]) == 1:
        return result
    word, _, state = str(result[1]).partition(":")
    if word not in get_args(Reason):
        raise ValueError(f"task {task_id!r}: script gave an unknown refusal {result[1]!r}")
    raise TaskRefused(task_id, word, state)  # type: ignore[arg-type]


def receipt_body(task_id: str, lease_id: str | None = None, **data: Any) -> str:
    """The JSON ``data`` field of a receipt, for scripts that append it themselves."""
    rc = Receipt(kind="_", task_id=task_id, lease_id=lease_id, data=data)
    return json.dumps(rc.model_dump(exclude={"id", "kind"}))


@cache
def _source(name: str) -> str:
    """A task script, after the Lua lines of its rows of the transitions table."""
    text = resources.files("overnight.coordinator").joinpath("lua", f"task_{name}.lua").read_text()
    return lua_prelude(name if name in get_args(Op) else None) + text  # type: ignore[arg-type]


_SCRIPTS = (
    "create",
    "claim",
    "renew",
    "save",
    "charge",
    "uncharge",
    "orphan",
    "resume",
    "abort",
    "drop_claim",
)


class TaskStore:
    """Reads and atomic writes of task records in one namespace."""

    def __init__(
        self, client: redis.Redis, keys: Keys, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.client = client
        self.keys = keys
        self.clock = clock
        self._scripts: dict[str, Script] = {
            name: client.register_script(_source(name)) for name in _SCRIPTS
        }

    def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return self._scripts[name](keys=keys, args=args)

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
        now = self.clock()
        keys: list[str] = [self.keys.tasks, self.keys.receipts]
        args: list[Any] = [repr(now), STREAM_MAXLEN]
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
            [self.keys.task(task_id), self.keys.task_claim(task_id), self.keys.receipts],
            [
                attempt,
                token,
                int(ttl * 1000),
                repr(self.clock()),
                runner.model_dump_json(),
                STREAM_MAXLEN,
                body,
            ],
        )
        _checked(task_id, result)
        rec = self.get(task_id)
        if rec is None:
            raise TaskRefused(task_id, "unknown")
        return rec

    def renew(self, task_id: str, token: str, ttl: float) -> None:
        """Extend the claim held under ``token``; raises :class:`TaskRefused` (lost)."""
        result = self._run("renew", [self.keys.task_claim(task_id)], [token, int(ttl * 1000)])
        _checked(task_id, result)

    def save(
        self,
        task_id: str,
        token: str,
        checkpoint: Checkpoint,
        *,
        state: State = RUNNING,
        detail: str = "",
        receipts: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Checkpoint a task held under ``token`` and move it to ``state`` (RUNNING: it goes
        on). Raises :class:`TaskRefused`: illegal, lost or state."""
        args: list[Any] = [
            token,
            checkpoint.model_dump_json(),
            state.value,
            detail,
            repr(self.clock()),
            STREAM_MAXLEN,
        ]
        for kind, body in receipts:
            args += [kind, body]
        result = self._run(
            "save",
            [self.keys.task(task_id), self.keys.task_claim(task_id), self.keys.receipts],
            args,
        )
        _checked(task_id, result)

    def charge(self, task_id: str, token: str, request_id: str, max_calls: int) -> int:
        """Charge one call to the task's own ceiling, once per ``request_id``; returns
        ``calls_used``. Raises :class:`TaskRefused`: ceiling or lost."""
        keys = [self.keys.task(task_id), self.keys.task_claim(task_id)]
        result = self._run(
            "charge", [*keys, self.keys.task_charged(task_id)], [token, request_id, max_calls]
        )
        return int(_checked(task_id, result)[1])

    def uncharge(self, task_id: str, token: str, request_id: str) -> int:
        """Give back the call charged for ``request_id``; returns ``calls_used``. Raises
        :class:`TaskRefused` (lost)."""
        keys = [self.keys.task(task_id), self.keys.task_claim(task_id)]
        result = self._run(
            "uncharge", [*keys, self.keys.task_charged(task_id)], [token, request_id]
        )
        return int(_checked(task_id, result)[1])

    def drop_claim(self, task_id: str, attempt: int, runner_pid: int) -> None:
        """Drop the claim held by a work horse known to be dead (``runner_pid``). Raises
        :class:`TaskRefused`: state, stale-attempt, not-runner or lost."""
        keys = [self.keys.task(task_id), self.keys.task_claim(task_id)]
        _checked(task_id, self._run("drop_claim", keys, [attempt, runner_pid, RUNNING.value]))

    def orphan(
        self, rec: TaskRecord, state: State, checkpoint: Checkpoint, detail: str, attempt: int
    ) -> None:
        """Move a running task whose claim lapsed to ``state``. Raises :class:`TaskRefused`:
        illegal, alive, state or stale-attempt."""
        body = receipt_body(rec.id, state=state, detail=detail, attempt=attempt, recovered=True)
        result = self._run(
            "orphan",
            [self.keys.task(rec.id), self.keys.task_claim(rec.id), self.keys.receipts],
            [
                rec.attempt,
                state.value,
                checkpoint.model_dump_json(),
                detail,
                attempt,
                repr(self.clock()),
                STREAM_MAXLEN,
                body,
            ],
        )
        _checked(rec.id, result)

    def resume(self, rec: TaskRecord, checkpoint: Checkpoint) -> None:
        """Queue a paused task again for its next attempt. Raises :class:`TaskRefused`:
        state or stale-attempt."""
        attempt = rec.attempt + 1
        body = receipt_body(rec.id, state=QUEUED, attempt=attempt, reconciled="resume")
        result = self._run(
            "resume",
            [self.keys.task(rec.id), self.keys.receipts],
            [
                rec.attempt,
                checkpoint.model_dump_json(),
                attempt,
                repr(self.clock()),
                STREAM_MAXLEN,
                body,
            ],
        )
        _checked(rec.id, result)

    def abort(self, task_id: str, detail: str) -> None:
        """End a live task as aborted. Raises :class:`TaskRefused` (state: it has ended)."""
        body = receipt_body(task_id, state=State.ABORTED, detail=detail, reconciled="abort")
        result = self._run(
            "abort",
            [self.keys.task(task_id), self.keys.task_claim(task_id), self.keys.receipts],
            [detail, repr(self.clock()), STREAM_MAXLEN, body],
        )
        _checked(task_id, result)
