"""The turn loop's rules as a table: checkpoint, spec, step outcome and now in; the write out.

No Redis, no processes, no clock: ``now`` and the task's deadline are arguments.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from overnight.coordinator.tasks.judge import (
    STUCK_TURNS,
    begin,
    expired,
    judge,
    lost_step,
    refused,
    request_id,
)
from overnight.coordinator.tasks.record import AgentResult, Checkpoint, InFlight, RuleResult
from overnight.coordinator.tasks.states import PAUSED, QUEUED, RUNNING, State
from overnight.coordinator.tasks.steps import StepOutcome
from overnight.coordinator.tasks.taskfile import Rule, TaskSpec

NOW = 1_000_000.0
DEADLINE = NOW + 100


def spec(*rules: str, deadline: float = 100) -> TaskSpec:
    return TaskSpec(
        assignment="x",
        workdir=str(Path.cwd()),
        agent=["true"],
        max_calls=10,
        deadline=deadline,
        verifier=[Rule(name=r, run=["true"]) for r in rules],
    )


def out(code: int = 0, status: str = "done", digest: str = "d1", tail: str = "") -> StepOutcome:
    return StepOutcome(code, status, "", "L1", tail, digest)


def after_agent(digest: str = "d1", **kw: object) -> Checkpoint:
    agent = AgentResult(exit_code=0, lease_id="L0", digest=digest)
    data: dict[str, object] = {"step": 1, "turns": 1, "agent": agent, **kw}
    return Checkpoint.model_validate(data)


FAILED_A = RuleResult(name="a", passed=False, exit_code=1, tail="E")


@pytest.mark.parametrize(
    ("case", "cp", "rules", "outcome", "now", "state", "step", "turn", "kinds"),
    [
        ("agent ran", Checkpoint(), ("a",), out(), NOW, RUNNING, 1, 1, ["step_finished"]),
        (
            "middle rule",
            after_agent(),
            ("a", "b"),
            out(),
            NOW,
            RUNNING,
            2,
            1,
            ["step_finished"],
        ),
        (
            "last rule passes",
            after_agent(),
            ("a",),
            out(),
            NOW,
            State.FINISHED_VERIFIED,
            2,
            1,
            ["step_finished", "verdict"],
        ),
        (
            "last rule fails: next turn",
            after_agent(),
            ("a",),
            out(1),
            NOW,
            RUNNING,
            0,
            2,
            ["step_finished", "verdict"],
        ),
        (
            "a rule fails and a later one passes: next turn",
            after_agent(step=2, results=[FAILED_A]),
            ("a", "b"),
            out(),
            NOW,
            RUNNING,
            0,
            2,
            ["step_finished", "verdict"],
        ),
        (
            "step cut short by the task deadline",
            Checkpoint(),
            ("a",),
            out(2, "expired"),
            DEADLINE,
            State.EXPIRED,
            0,
            1,
            ["step_finished"],
        ),
        (
            "step's own lease expired before the task deadline: a failed step",
            after_agent(),
            ("a",),
            out(2, "expired"),
            DEADLINE - 1,
            RUNNING,
            0,
            2,
            ["step_finished", "verdict"],
        ),
    ],
)
def test_judge(
    case: str,
    cp: Checkpoint,
    rules: tuple[str, ...],
    outcome: StepOutcome,
    now: float,
    state: State,
    step: int,
    turn: int,
    kinds: list[str],
) -> None:
    before = cp.model_dump_json()
    nxt = judge(cp, spec(*rules), outcome, now=now, deadline=DEADLINE)
    assert (nxt.state, nxt.checkpoint.step, nxt.checkpoint.turn) == (state, step, turn), case
    assert [e.kind for e in nxt.events] == kinds, case
    assert nxt.checkpoint.in_flight is None
    assert cp.model_dump_json() == before, "the judge never changes its input"


def test_a_failed_turn_remembers_the_first_unmet_rule() -> None:
    nxt = judge(after_agent(), spec("a"), out(1, tail="boom"), now=NOW, deadline=DEADLINE)
    cp = nxt.checkpoint
    assert cp.memory is not None and (cp.memory.unmet, cp.memory.evidence) == (["a"], "boom")
    assert cp.last_verdict is not None and cp.last_verdict.failed == ["a"]
    assert (cp.agent, cp.results, cp.repeats) == (None, [], 1)
    verdict = nxt.events[1].data
    assert verdict["ok"] is False and verdict["turn"] == 1
    finished = nxt.events[0]
    assert (finished.lease_id, finished.data["step"], finished.data["exit_code"]) == ("L1", "a", 1)


def test_success_clears_the_memory() -> None:
    cp = judge(after_agent(), spec("a"), out(1), now=NOW, deadline=DEADLINE).checkpoint
    cp = cp.model_copy(update={"step": 1, "agent": AgentResult(digest="d2")})
    nxt = judge(cp, spec("a"), out(0), now=NOW, deadline=DEADLINE)
    assert nxt.state == State.FINISHED_VERIFIED and nxt.detail == "every rule passed"
    assert nxt.checkpoint.memory is None


@pytest.mark.parametrize(
    ("digests", "state", "repeats"),
    [
        (["same"] * STUCK_TURNS, State.HALTED_STUCK, STUCK_TURNS),
        (["same"] * (STUCK_TURNS - 1), RUNNING, STUCK_TURNS - 1),
        (["same", "other", "same"], RUNNING, 1),
    ],
)
def test_stuck_after_the_same_output_and_verdict(
    digests: list[str], state: State, repeats: int
) -> None:
    cp = Checkpoint()
    nxt = None
    for digest in digests:
        cp = cp.model_copy(update={"step": 1, "agent": AgentResult(digest=digest)})
        nxt = judge(cp, spec("a"), out(1), now=NOW, deadline=DEADLINE)
        cp = nxt.checkpoint
    assert nxt is not None and (nxt.state, cp.repeats) == (state, repeats)
    if state == State.HALTED_STUCK:
        assert nxt.events[-1].kind == "task_stuck" and "3 turns" in nxt.detail


@pytest.mark.parametrize(
    ("now", "ends"), [(DEADLINE - 0.001, False), (DEADLINE, True), (DEADLINE + 5, True)]
)
def test_expired_before_a_step(now: float, ends: bool) -> None:
    nxt = expired(Checkpoint(), spec("a", deadline=100), now, DEADLINE)
    assert (nxt is not None) is ends
    if nxt is not None:
        assert nxt.state == State.EXPIRED and nxt.detail == "task deadline of 100s passed"


def test_a_refused_call_halts_at_the_ceiling() -> None:
    nxt = refused(after_agent(), spec("a"), "envelope", "envelope 'default' empty")
    assert (nxt.state, nxt.detail) == (State.HALTED_AT_CALL_CEILING, "envelope 'default' empty")
    [event] = nxt.events
    assert event.kind == "call_refused"
    assert event.data == {
        "who": "envelope",
        "detail": "envelope 'default' empty",
        "step": "a",
        "turn": 1,
    }


def test_begin_marks_the_step_in_flight_and_counts_the_turn() -> None:
    cp = Checkpoint(turn=2)
    request = request_id("t", "run", cp)
    started = begin(cp, spec("a"), request, NOW)
    assert request == "t:run:2:0"
    assert started.in_flight == InFlight(
        turn=2, step=0, name="agent", request_id=request, started_unix=NOW
    )
    assert (started.turns, cp.turns, cp.in_flight) == (2, 0, None)
    rule = begin(started.model_copy(update={"step": 1}), spec("a"), "r", NOW)
    assert rule.in_flight is not None and rule.in_flight.name == "a"


FLIGHT = InFlight(turn=1, step=0, name="agent", request_id="x", started_unix=NOW)


@pytest.mark.parametrize(
    ("on_unknown", "lost", "flight", "started", "state", "keeps_flight"),
    [
        ("pause", 0, FLIGHT, True, PAUSED, True),
        ("retry", 0, FLIGHT, True, QUEUED, False),
        ("retry", 0, None, True, QUEUED, False),
        ("pause", 0, None, True, QUEUED, False),
        ("retry", 2, FLIGHT, True, PAUSED, True),
        ("retry", 2, None, True, PAUSED, False),
        # A step that never started has a known outcome: it runs again, even under "pause".
        ("pause", 0, FLIGHT, False, QUEUED, False),
        ("pause", 2, FLIGHT, False, PAUSED, True),
    ],
)
def test_lost_step(
    on_unknown: str,
    lost: int,
    flight: InFlight | None,
    started: bool,
    state: State,
    keeps_flight: bool,
) -> None:
    cp = Checkpoint(lost_leases=lost, in_flight=flight)
    nxt = lost_step(cp, on_unknown, 3, started=started)
    assert nxt.state == state and nxt.detail
    assert nxt.checkpoint.lost_leases == lost + 1 and cp.lost_leases == lost
    assert (nxt.checkpoint.in_flight is not None) is keeps_flight
