"""A turn's decisions as tables: where an attempt ends, what ends a task before its next
step, and what a step's outcome makes of it. No Redis, no processes, no clock."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from overnight.coordinator.tasks.judge import begin
from overnight.coordinator.tasks.record import Checkpoint, InFlight, Next
from overnight.coordinator.tasks.states import PAUSED, QUEUED, RUNNING, State
from overnight.coordinator.tasks.steps import StepOutcome
from overnight.coordinator.tasks.taskfile import Rule, TaskSpec
from overnight.coordinator.tasks.turn import (
    Ending,
    LoopEnd,
    after_step,
    before_step,
    resumed,
    spent_nothing,
)

NOW = 1_000_000.0
DEADLINE = NOW + 100
TERM = int(signal.SIGTERM)


def spec(on_unknown: str = "retry") -> TaskSpec:
    return TaskSpec(
        assignment="x",
        workdir=str(Path.cwd()),
        agent=["true"],
        max_calls=10,
        deadline=100,
        on_unknown=on_unknown,
        verifier=[Rule(name="a", run=["true"])],
    )


def out(code: int = 0, status: str = "done", note: str = "", started: bool = True) -> StepOutcome:
    return StepOutcome(code, status, note, "L1", "", "d1", started=started)


def in_flight(lost: int = 0) -> Checkpoint:
    flight = InFlight(turn=1, step=0, name="agent", request_id="r", started_unix=NOW)
    return Checkpoint(in_flight=flight, lost_leases=lost)


@pytest.mark.parametrize(
    ("end", "how", "label"),
    [
        (LoopEnd.skipped("night-ended"), Ending.SKIPPED, "skipped:night-ended"),
        (LoopEnd.skipped("stale-attempt"), Ending.SKIPPED, "skipped:stale-attempt"),
        (LoopEnd.lost(), Ending.LOST, "lost"),
        (LoopEnd.left(State.FINISHED_VERIFIED), Ending.LEFT, "finished_verified"),
        (LoopEnd.left(PAUSED), Ending.LEFT, "paused_for_reconciliation"),
        (LoopEnd.left(QUEUED), Ending.LEFT, "queued"),
    ],
)
def test_where_an_attempt_ends_in_words(end: LoopEnd, how: Ending, label: str) -> None:
    assert (end.how, end.label) == (how, label)


@pytest.mark.parametrize(
    ("case", "cp", "on_unknown", "cap", "paused", "lost_leases"),
    [
        ("nothing in flight", Checkpoint(), "retry", 3, False, 0),
        ("in flight, retried", in_flight(), "retry", 3, False, 1),
        ("in flight, pause asked", in_flight(), "pause", 3, True, 1),
        ("in flight, cap reached", in_flight(lost=2), "retry", 3, True, 3),
    ],
)
def test_a_claimed_checkpoint_with_a_step_in_flight(
    case: str, cp: Checkpoint, on_unknown: str, cap: int, paused: bool, lost_leases: int
) -> None:
    after, pause = resumed(cp, spec(on_unknown), cap)
    if paused:
        assert pause is not None and pause.state == PAUSED, case
        assert after == cp, case
        assert pause.checkpoint.lost_leases == lost_leases, case
    else:
        assert pause is None, case
        assert after.in_flight is None and after.lost_leases == lost_leases, case


@pytest.mark.parametrize(
    ("case", "now", "stop_at", "asked", "state", "kind"),
    [
        ("nothing ends it", NOW, None, None, None, None),
        ("the night has not ended", NOW, NOW + 1, None, None, None),
        ("its deadline passed", DEADLINE, None, None, State.EXPIRED, None),
        ("deadline before the night", DEADLINE, NOW, TERM, State.EXPIRED, None),
        ("the night ended", NOW, NOW, None, QUEUED, "task_stopped"),
        ("night before a stop asked", NOW, NOW - 1, TERM, QUEUED, "task_stopped"),
        ("a stop asked", NOW, None, TERM, QUEUED, "task_stopped"),
    ],
)
def test_what_ends_a_task_before_its_next_step(
    case: str,
    now: float,
    stop_at: float | None,
    asked: int | None,
    state: State | None,
    kind: str | None,
) -> None:
    nxt = before_step(
        Checkpoint(), spec(), now=now, deadline=DEADLINE, stop_at=stop_at, asked=asked
    )
    if state is None:
        assert nxt is None, case
        return
    assert nxt is not None and nxt.state == state, case
    assert [e.kind for e in nxt.events][-1:] == ([kind] if kind else []), case
    if stop_at is not None and stop_at <= now and now < DEADLINE:
        assert "night ended" in nxt.detail, case


def _flying() -> Checkpoint:
    return begin(Checkpoint(), spec(), "r", NOW)


@pytest.mark.parametrize(
    ("case", "outcome", "cut", "stop_at", "asked", "state", "stopped"),
    [
        ("judged: the agent ran", out(), False, None, None, RUNNING, False),
        ("cut by the night and expired", out(1, "expired"), True, NOW, None, QUEUED, True),
        ("cut by the night, ended itself", out(1), True, NOW, None, RUNNING, False),
        ("expired, not cut", out(1, "expired"), False, NOW, None, RUNNING, False),
        (
            "ended by the stop asked",
            out(143, "killed", f"supervisor-signal-{TERM}"),
            False,
            None,
            TERM,
            QUEUED,
            True,
        ),
        ("a stop asked, ended itself", out(), False, None, TERM, RUNNING, False),
    ],
)
def test_what_a_steps_outcome_makes_of_the_task(
    case: str,
    outcome: StepOutcome,
    cut: bool,
    stop_at: float | None,
    asked: int | None,
    state: State,
    stopped: bool,
) -> None:
    nxt = after_step(
        _flying(),
        spec(),
        outcome,
        now=NOW + 1,
        deadline=DEADLINE,
        log="",
        cut_by_night=cut,
        stop_at=stop_at,
        asked=asked,
    )
    assert nxt.state == state, case
    [step] = [e for e in nxt.events if e.kind == "step_finished"]
    assert bool(step.data.get("stopped")) is stopped, case


@pytest.mark.parametrize(
    ("case", "state", "started", "given_back"),
    [
        ("ran and judged", RUNNING, True, False),
        ("never started", RUNNING, False, True),
        ("agent could not start", State.AGENT_FAILED, True, True),
        ("paused after running", PAUSED, True, False),
    ],
)
def test_a_step_that_spent_nothing_gives_its_call_back(
    case: str, state: State, started: bool, given_back: bool
) -> None:
    nxt = Next(Checkpoint(), state)
    assert spent_nothing(nxt, out(started=started)) is given_back, case
