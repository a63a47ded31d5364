"""A task as stored: its record, and the loop state checkpointed into it after every step.

The record is written only by the task scripts (through :mod:`coordinator.tasks.store`);
these are the shapes it is read into and the loop's checkpoint is saved from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from overnight.config.errors import OvernightError
from overnight.coordinator.tasks.states import RUNNING, State
from overnight.coordinator.tasks.taskfile import TaskSpec
from overnight.worker.redisio.receipts import Receipt


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
    said: str = ""  # an agent preset's CLI's own one-line account of the step


class StepLog(BaseModel):
    """One step as kept in the record for the last turns: how it ended and its output tail
    (the whole output is in ``log``, a file on the host that ran it)."""

    turn: int
    name: str
    exit_code: int | None = None
    status: str = ""
    note: str = ""
    ending: str = ""  # how its lease ended when that was not a clean exit, in words
    tail: str = ""
    log: str = ""


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
    stopped: str = ""  # how the turn's agent step was cut short (a limit), in words


class InFlight(BaseModel):
    """A step that was started and has not been recorded as ended."""

    turn: int
    step: int
    name: str
    request_id: str
    started_unix: float


class CheckedTree(BaseModel):
    """What the verifier checked in a turn: the commit (or the snapshot digest, outside git)
    and the digest of each protected file put back from the base."""

    commit: str | None = None
    snapshot: str | None = None
    protected: dict[str, str] = Field(default_factory=dict)


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
    steps: list[StepLog] = Field(default_factory=list)  # the last few steps, newest last
    endings: list[str] = Field(default_factory=list)  # lease endings that were not clean exits
    # The task's branch (worktree mode), its commit after the last agent step, the branch's
    # diffstat against the base, and the protected paths that commit changed (coordinator.
    # taskspace); what the verifier checked in the current turn.
    branch: str | None = None
    head: str | None = None
    diffstat: str = ""
    protected_changed: list[str] = Field(default_factory=list)
    checked: CheckedTree | None = None


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


class TaskCorrupt(OvernightError, ValueError):
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


@dataclass(frozen=True)
class Event:
    """A receipt written with the change: its kind, its data, and the lease it is about."""

    kind: str
    data: dict[str, Any]
    lease_id: str | None = None


@dataclass(frozen=True)
class Next:
    """The write after a decision: the checkpoint, the state (RUNNING: the task goes on),
    why, and the receipts that go with it."""

    checkpoint: Checkpoint
    state: State = RUNNING
    detail: str = ""
    events: tuple[Event, ...] = ()

    @property
    def goes_on(self) -> bool:
        return self.state == RUNNING


def receipt_body(task_id: str, lease_id: str | None = None, **data: Any) -> str:
    """The JSON ``data`` field of a receipt, for scripts that append it themselves."""
    rc = Receipt(kind="_", task_id=task_id, lease_id=lease_id, data=data)
    return json.dumps(rc.model_dump(exclude={"id", "kind"}))
