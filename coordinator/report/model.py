"""The morning report as data: the shapes a :class:`Report` is made of (step bars, marks,
task cards, envelopes, what needs a person), built by :mod:`coordinator.report.build` and
rendered by :mod:`coordinator.report.html` and :mod:`coordinator.report.text`.

Parts of a task card appear only when their data exists (see :class:`Card`): the worktree
fields of the checkpoint (``branch``, ``head``, ``diffstat``, ``protected_changed``), a diff
handed in by the caller, and the gateway's ``model_call`` receipts (``tokens``,
``input_tokens``, ``output_tokens``, ``tool_calls``, ``model_units``, ``refunded``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

# How a step's lease ended, as the timeline colours it.
CLEAN, FAILED, GAP, DEADLINE, REFUSED, STOP, KILLED, LOST, RUNNING = (
    "clean",
    "failed",
    "gap",
    "deadline",
    "refused",
    "stop",
    "killed",
    "lost",
    "running",
)
ENDINGS = (CLEAN, FAILED, GAP, DEADLINE, REFUSED, STOP, KILLED, LOST, RUNNING)
LEASE_ENDS = ("lease_ended", "subprocess_lease_expired")


def ending_class(status: str, note: str, *, stopped: bool = False, refused: bool = False) -> str:
    """How a step's lease ended, from its final status and note (contract section 2):
    a clean exit (0, or a verifier's failing exit: ``failed``), a heartbeat-gap kill, the
    deadline, a refused call, a stop the user asked for, another kill, a lease the reaper
    ended (``lost``), or still ``running``."""
    if stopped:
        return STOP
    if refused or note.startswith("call-refused"):
        return REFUSED
    if status == "running" or not status:
        return RUNNING
    if status == "done":
        return CLEAN
    if note.startswith("reaped:"):
        return LOST if "host-lost" in note else (DEADLINE if status == "expired" else GAP)
    if re.fullmatch(r"worker-exit-\d+", note):
        return FAILED
    if note.startswith("heartbeat-gap"):
        return GAP
    if status == "expired" or note == "budget-exceeded":
        return DEADLINE
    return KILLED


@dataclass(frozen=True)
class Bar:
    """One step under a lease: an agent step (``kind`` "agent") or a verifier run."""

    task_id: str
    kind: str
    name: str
    turn: int | None
    start: float
    end: float
    ending: str
    status: str = ""
    note: str = ""
    said: str = ""  # the loop's words for an ending that was not a clean exit
    exit_code: int | None = None
    host: str = ""
    worker: str = ""
    lease_id: str = ""


@dataclass(frozen=True)
class Mark:
    """A point event on a task's lane: a pause, a retry after a lost worker, a refused call,
    a requested stop, a verdict."""

    task_id: str
    at: float
    kind: str
    text: str


@dataclass(frozen=True)
class Ledger:
    """What the gateway metered for one task (from its ``model_call`` receipts)."""

    requests: int = 0
    model_units: int = 0
    tool_calls: int = 0
    tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    refunded: int = 0
    failed: int = 0  # answered with an HTTP status >= 400


@dataclass(frozen=True)
class Card:
    """One task: its state and why, its counts, its last verdict and the failing rule's
    evidence; ``branch``/``diffstat``/``diff``/``protected_changed``/``ledger`` are empty or
    None when the data does not exist."""

    task_id: str
    state: str
    detail: str
    assignment: str
    turns: int
    calls_used: int
    max_calls: int
    envelope: str
    attempt: int
    started: float | None
    ended: float | None
    verdict_turn: int | None = None
    passed: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    failing_rule: str = ""
    evidence: str = ""
    endings: tuple[str, ...] = ()
    branch: str = ""
    head: str = ""
    diffstat: str = ""
    diff: str = ""
    protected_changed: tuple[str, ...] = ()
    ledger: Ledger | None = None
    steps: int = 0


@dataclass(frozen=True)
class EnvelopeView:
    """An envelope's budget against what was used (tokens when metered)."""

    name: str
    exists: bool
    budget: int
    remaining: int
    consumed_model: int
    consumed_tool: int
    consumed_tokens: int = 0
    max_tokens: int | None = None
    burn: tuple[tuple[float, int], ...] = ()  # (time, calls spent so far), from receipts


@dataclass(frozen=True)
class Attention:
    """Something a person must look at: which task and why."""

    task_id: str
    what: str  # paused | tampering | agent_failed | survivors
    text: str


@dataclass(frozen=True)
class Report:
    """Everything the morning page shows."""

    namespace: str
    generated: float
    start: float
    end: float
    counts: dict[str, int]
    attention: tuple[Attention, ...]
    envelopes: tuple[EnvelopeView, ...]
    bars: tuple[Bar, ...]
    marks: tuple[Mark, ...]
    cards: tuple[Card, ...]
    concurrency: tuple[tuple[float, int], ...]
    workers: tuple[str, ...] = field(default=())
    # What the night ran without that it should have had (a Redis with no password).
    notices: tuple[str, ...] = field(default=())
    # How steps were contained, host by host ("sandbox: bwrap (host vm)").
    sandbox: str = ""

    @property
    def wall_sec(self) -> float:
        return max(0.0, self.end - self.start)


def concurrency(bars: Iterable[Bar]) -> tuple[tuple[float, int], ...]:
    """How many steps ran at once: (time, count from then on), one point per change."""
    edges = sorted(
        [(b.start, 1) for b in bars] + [(b.end, -1) for b in bars], key=lambda e: (e[0], e[1])
    )
    out: list[tuple[float, int]] = []
    level = 0
    for at, delta in edges:
        level += delta
        if out and out[-1][0] == at:
            out[-1] = (at, level)
        else:
            out.append((at, level))
    return tuple(out)


def needs_person(report: Report) -> list[dict[str, str]]:
    """The ``attention`` list as JSON rows (for the notification)."""
    return [{"task": a.task_id, "what": a.what, "text": a.text} for a in report.attention]
