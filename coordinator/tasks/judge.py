"""What a task's next write is: the rules of the turn loop as pure functions.

Each takes the checkpoint (never changed in place), the spec and ``now`` (Redis server time)
and returns a :class:`Next` for the store to write in one script call. No Redis, no clock,
no processes: the loop and recovery ask here and write what they are told.
"""

from __future__ import annotations

import hashlib
import re
import signal
from typing import TYPE_CHECKING

from overnight.coordinator.tasks.record import (
    AgentResult,
    Checkpoint,
    Event,
    InFlight,
    Memory,
    Next,
    RuleResult,
    StepLog,
    Verdict,
)
from overnight.coordinator.tasks.states import PAUSED, QUEUED, State

if TYPE_CHECKING:
    from overnight.coordinator.tasks.steps import StepOutcome
    from overnight.coordinator.tasks.taskfile import TaskSpec

STUCK_TURNS = 3
# The lease note of a step the gateway ended because a call was refused (worker.supervise.outcome).
CALL_REFUSED = "call-refused: "
# The lease note of a step whose tree went over one of its limits (worker.sandbox.limits).
OVER_LIMIT = "over-limit: "
# How many steps' tails, and how many unclean lease endings, a task's record keeps.
KEEP_STEPS = 8
KEEP_ENDINGS = 20
# An agent that exits so could not be started (as a shell says: 127 not found, 126 not runnable).
CANNOT_START = (126, 127)


def _signame(number: str) -> str:
    try:
        return signal.Signals(int(number)).name
    except ValueError:
        return f"signal {number}"


def ending(turn: int, name: str, rule: bool, status: str, note: str, limit: float) -> str:
    """How a step's lease ended, in words, when that was not a clean exit of the step's own
    (done, or an exit code): "turn 1 agent killed: heartbeat gap 2.0 s", "turn 2 rule tests
    timed out after 20 s". A clean exit gives ""."""
    what = f"turn {turn} {'rule ' if rule else ''}{name}"
    if status == "done":
        return ""
    exit_code = re.fullmatch(r"worker-exit-(\d+)", note)
    if exit_code:
        code = int(exit_code.group(1))
        return f"{what} could not start (exit {code})" if not rule and code in CANNOT_START else ""
    gap = re.fullmatch(r"heartbeat-gap-([\d.]+)s", note)
    if gap:
        return f"{what} killed: heartbeat gap {gap.group(1)} s"
    if note == "budget-exceeded":
        return f"{what} timed out after {limit:g} s"
    by_signal = re.fullmatch(r"(worker|supervisor)-signal-(\d+)", note)
    if by_signal and by_signal.group(1) == "worker":
        return f"{what} killed by {_signame(by_signal.group(2))}"
    if by_signal:
        return f"{what} stopped: its supervisor got {_signame(by_signal.group(2))}"
    if note.startswith(OVER_LIMIT):
        return f"{what} killed: {note.removeprefix(OVER_LIMIT)}"
    if note == "lease-lost":
        return f"{what} killed: lease lost (Redis unreachable longer than the gap)"
    return f"{what} {status or 'ended'}: {note or 'no note'}"


def agent_failed(cp: Checkpoint, command: str, why: str) -> Next:
    """The agent command cannot be started: the task ends at once, naming it."""
    detail = f"{why}; the agent command {command!r} could not start"
    event = Event("agent_failed", {"turn": cp.turn, "command": command, "detail": detail})
    out = cp.model_copy(deep=True)
    out.in_flight = None
    return Next(out, State.AGENT_FAILED, detail, (event,))


def rule_cannot_start(cp: Checkpoint, name: str, command: str, why: str) -> Next:
    """A verifier rule's command cannot be started: no turn can be judged, so the task
    pauses for a person (who installs it, or fixes the rule) instead of burning turns; the
    same step runs again on ``overnight reconcile --resume``."""
    detail = (
        f"rule {name}: command {command!r} {why}; install it or fix the rule's run, then "
        "overnight reconcile --resume"
    )
    event = Event("rule_cannot_start", {"turn": cp.turn, "rule": name, "detail": detail})
    out = cp.model_copy(deep=True)
    out.in_flight = None
    return Next(out, PAUSED, detail, (event,))


def _kept(cp: Checkpoint, entry: StepLog) -> None:
    cp.steps = [*cp.steps, entry][-KEEP_STEPS:]
    if entry.ending:
        cp.endings = [*cp.endings, entry.ending][-KEEP_ENDINGS:]


PROTECTED_RULE = "protected-paths"


def protected_result(changed: list[str]) -> RuleResult:
    """The synthetic rule a turn fails when its commit changed a protected path."""
    names = ", ".join(changed)
    evidence = (
        f"this turn changed protected paths: {names}. The verifier ran on them as they were "
        "at the base; change the code under test, not the checks."
    )
    return RuleResult(
        name=PROTECTED_RULE, passed=False, note="protected paths changed", tail=evidence
    )


def step_name(spec: TaskSpec, step: int) -> str:
    """Step 0 is the agent; step i runs verifier rule i."""
    return "agent" if step == 0 else spec.verifier[step - 1].name


def request_id(task_id: str, run: str, cp: Checkpoint) -> str:
    """The charge id of the step ``cp`` names: fixed by (task, run, turn, step), so a step
    that is run again is never charged twice."""
    return f"{task_id}:{run}:{cp.turn}:{cp.step}"


def expired(cp: Checkpoint, spec: TaskSpec, now: float, deadline: float) -> Next | None:
    """Before a step: the task ends as expired once its own deadline has passed."""
    if now < deadline:
        return None
    return Next(cp, State.EXPIRED, f"task deadline of {spec.deadline:g}s passed")


def refused(cp: Checkpoint, spec: TaskSpec, who: str, detail: str) -> Next:
    """A step's call was refused (``who``: the task's max_calls or the envelope): it halts."""
    name = step_name(spec, cp.step)
    event = Event("call_refused", {"who": who, "detail": detail, "step": name, "turn": cp.turn})
    return Next(cp, State.HALTED_AT_CALL_CEILING, detail, (event,))


def begin(cp: Checkpoint, spec: TaskSpec, request: str, now: float) -> Checkpoint:
    """The checkpoint saved before a step runs: that step in flight since ``now``."""
    out = cp.model_copy(deep=True)
    if out.step == 0:
        out.turns = out.turn
    out.in_flight = InFlight(
        turn=out.turn,
        step=out.step,
        name=step_name(spec, out.step),
        request_id=request,
        started_unix=now,
    )
    return out


def lost_step(cp: Checkpoint, on_unknown: str, cap: int, *, started: bool = True) -> Next:
    """What a task whose worker died becomes (QUEUED again, or PAUSED); counts the loss.
    ``started`` False: the step in flight never started (no lease of it was ever taken), so
    its outcome is known and it runs again, still charged once (its request id)."""
    out = cp.model_copy(deep=True)
    out.lost_leases += 1
    flight = out.in_flight
    if out.lost_leases >= cap:
        return Next(out, PAUSED, f"lost {out.lost_leases} runs (cap {cap}); reconcile to go on")
    if flight is None:
        return Next(out, QUEUED, "worker died between steps; resuming from the checkpoint")
    what = f"{flight.name} step of turn {flight.turn}"
    if not started:
        out.in_flight = None
        return Next(out, QUEUED, f"its worker died before the {what} started; it runs again")
    if on_unknown == "pause":
        return Next(out, PAUSED, f"outcome of the {what} is unknown: its worker died")
    out.in_flight = None
    return Next(out, QUEUED, f"retrying the {what} after its worker died")


def judge(
    cp: Checkpoint,
    spec: TaskSpec,
    out: StepOutcome,
    *,
    now: float,
    deadline: float,
    log: str = "",
) -> Next:
    """What the step ``cp`` names, ended as ``out`` at ``now``, makes of the task.

    ``deadline`` is the task's own (its first start plus ``spec.deadline``). A step cut
    short by it expires the task; the last rule of a turn gives the verdict: every rule
    passed (finished_verified), the same agent output and verdict ``STUCK_TURNS`` turns
    running (halted_stuck), or the next turn with the unmet rules in memory. An agent
    that could not start (exit 126/127) ends the task as agent_failed. ``log`` is the
    file that holds the step's whole output.
    """
    cp = cp.model_copy(deep=True)
    cp.in_flight = None
    name = step_name(spec, cp.step)
    said = ending(cp.turn, name, cp.step > 0, out.status, out.note, out.limit)
    if not said and out.said is not None and not out.said.ok:
        said = f"turn {cp.turn} {name} reported a failure: {out.said.summary}"
    data = {
        "step": name,
        "turn": cp.turn,
        "exit_code": out.exit_code,
        "status": out.status,
        "note": out.note,
        "digest": out.digest,
    }
    if out.said is not None:
        data["agent_said"] = out.said.summary
        data["agent_ok"] = out.said.ok
    if said:
        data["ending"] = said
    events = [Event("step_finished", data, out.lease_id)]
    _kept(
        cp,
        StepLog(
            turn=cp.turn,
            name=name,
            exit_code=out.exit_code,
            status=out.status,
            note=out.note,
            ending=said,
            tail=out.tail,
            log=log,
        ),
    )
    if out.note.startswith(CALL_REFUSED):
        # The gateway refused one of the step's model calls: the budget is spent.
        detail = out.note.removeprefix(CALL_REFUSED)
        halted = refused(cp, spec, "task" if detail.startswith("task ") else "envelope", detail)
        return Next(halted.checkpoint, halted.state, detail, (*events, *halted.events))
    if cp.step == 0 and out.exit_code in CANNOT_START and out.note.startswith("worker-exit-"):
        failed = agent_failed(cp, spec.command(), f"exit {out.exit_code}")
        return Next(failed.checkpoint, failed.state, failed.detail, (*events, *failed.events))
    if cp.step > 0 and not out.started:
        why = "was not found" if out.exit_code == 127 else "could not start"
        rule = spec.verifier[cp.step - 1].run[0]
        paused = rule_cannot_start(cp, name, rule, f"{why} (exit {out.exit_code})")
        return Next(paused.checkpoint, PAUSED, paused.detail, (*events, *paused.events))
    if cp.step == 0 and cp.protected_changed:
        cp.results.append(protected_result(cp.protected_changed))
    if cp.step == 0:
        cp.agent = AgentResult(
            exit_code=out.exit_code,
            note=out.note,
            lease_id=out.lease_id,
            digest=out.digest,
            tail=out.tail,
            said=out.said.summary if out.said is not None else "",
        )
    else:
        cp.results.append(
            RuleResult(
                name=name,
                passed=out.passed,
                exit_code=out.exit_code,
                note=out.note,
                lease_id=out.lease_id,
                tail=out.tail,
            )
        )
    if out.status == "expired" and now >= deadline:
        detail = f"task deadline of {spec.deadline:g}s passed during the {name} step"
        return Next(cp, State.EXPIRED, detail, tuple(events))
    cp.step += 1
    if cp.step <= len(spec.verifier):
        return Next(cp, detail=said, events=tuple(events))
    verdict = Verdict(
        turn=cp.turn,
        passed=[r.name for r in cp.results if r.passed],
        failed=[r.name for r in cp.results if not r.passed],
    )
    cp.last_verdict = verdict
    checked = cp.checked.model_dump() if cp.checked is not None else {}
    events.append(Event("verdict", {**verdict.model_dump(), "ok": verdict.ok, **checked}))
    if verdict.ok:
        cp.memory = None
        return Next(cp, State.FINISHED_VERIFIED, "every rule passed", tuple(events))
    first = next(r for r in cp.results if not r.passed)
    first_said = next(
        (
            s.ending
            for s in reversed(cp.steps)
            if s.turn == cp.turn and s.name == first.name and s.ending
        ),
        "",
    )
    agent_note = cp.agent.note if cp.agent is not None else ""
    stopped = ""
    if agent_note.startswith(OVER_LIMIT):
        stopped = ending(cp.turn, "agent", False, "killed", agent_note, 0)
    cp.memory = Memory(
        unmet=verdict.failed,
        rule=first.name,
        note=first_said or first.note,
        evidence=first.tail,
        stopped=stopped,
    )
    agent_digest = cp.agent.digest if cp.agent else ""
    fingerprint = hashlib.sha256(f"{agent_digest}|{verdict.failed}".encode()).hexdigest()[:32]
    cp.repeats = cp.repeats + 1 if fingerprint == cp.fingerprint else 1
    cp.fingerprint = fingerprint
    if cp.repeats >= STUCK_TURNS:
        detail = f"same agent output and same verdict {cp.repeats} turns running"
        events.append(Event("task_stuck", {"turn": cp.turn, "detail": detail}))
        return Next(cp, State.HALTED_STUCK, detail, tuple(events))
    cp.turn, cp.step, cp.agent, cp.results = cp.turn + 1, 0, None, []
    return Next(cp, detail=said, events=tuple(events))
