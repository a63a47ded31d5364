"""A stop the user asked for, as the turn loop sees it: pure rules, no clock, no Redis.

The night's end (``up --until``, ``OVERNIGHT_STOP_AT``): from the stop time no step starts;
a step running then gets the grace to finish its turn (its lease deadline is cut to
``stop + grace``), and one the cut ends is recorded as ended by the stop.

A stop asked for by a signal (``up`` got SIGTERM or Ctrl-C, or a worker was stopped, warm or
forced): the work horse gets SIGTERM; a step in flight is ended through its lease (its tree
gets SIGTERM and the grace; a second signal skips the rest of the grace) and recorded as
ended by the stop; no step starts after it.

Either way the task goes back to ``queued`` from its checkpoint, claim and lease released,
and the same step runs again (under the same request id, so it is not charged twice); it is
not a lost step: ``lost_leases`` is not counted, ``on_unknown`` does not apply.
"""

from __future__ import annotations

import signal
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

from overnight.coordinator.tasks.record import Checkpoint, Event, Next
from overnight.coordinator.tasks.states import QUEUED

if TYPE_CHECKING:
    from overnight.coordinator.tasks.steps import StepOutcome
    from overnight.coordinator.tasks.taskfile import TaskSpec

# The receipt kind of a task the night's end sent back to the queue.
TASK_STOPPED = "task_stopped"


def stop_due(now: float, stop_at: float | None) -> bool:
    """Whether the night has ended at ``now``."""
    return stop_at is not None and now >= stop_at


def stop_cut(now: float, stop_at: float | None, grace: float, limit: float) -> float | None:
    """The deadline (seconds from ``now``) of a step starting at ``now`` when the night's
    end comes before its own ``limit``; None when it does not cut the step."""
    if stop_at is None:
        return None
    cut = max(0.0, stop_at + grace - now)
    return cut if cut < limit else None


def _when(stop_at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(stop_at))


def stopped(
    cp: Checkpoint,
    spec: TaskSpec,
    stop_at: float,
    out: StepOutcome | None = None,
) -> Next:
    """The task goes back to ``queued`` because the night ended at ``stop_at``: before a step
    (``out`` None), or with the step ``cp`` has in flight ended by the stop (``out``), which is
    recorded as killed by the stop and runs again from the same checkpoint next night."""
    when = f"night ended at {_when(stop_at)}"
    return _requeued(cp, spec, out, f"the {when}", when, "next night", {"stop_at": stop_at})


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def not_asked() -> int | None:
    """No stop is ever asked for (a loop outside a work horse)."""
    return None


def ended_by_stop(out: StepOutcome, signum: int) -> bool:
    """Whether the step that ended as ``out`` was ended by the stop signal ``signum``: its
    supervisor got that signal and ended the step's tree. A step that ended on its own
    meanwhile (an exit, its gap, its deadline) is judged as usual."""
    return out.note == f"supervisor-signal-{signum}"


def stop_asked(
    cp: Checkpoint,
    spec: TaskSpec,
    signum: int,
    out: StepOutcome | None = None,
) -> Next:
    """The task goes back to ``queued`` because a stop was asked for (``signum`` reached its
    work horse: ``up`` or its worker was stopped): before a step (``out`` None), or with the
    step ``cp`` has in flight ended by the stop (``out``), recorded as killed by the stop; the
    same step runs again from the checkpoint when a worker takes the task up again."""
    said = f"overnight was stopped ({signal_name(signum)})"
    data = {"signal": signum}
    return _requeued(cp, spec, out, said, said, "once a worker takes the task up", data)


def _requeued(
    cp: Checkpoint,
    spec: TaskSpec,
    out: StepOutcome | None,
    why: str,
    short: str,
    again: str,
    extra: dict[str, Any],
) -> Next:
    flight = cp.in_flight
    nxt = cp.model_copy(deep=True)
    nxt.in_flight = None
    events = []
    if out is not None and flight is not None:
        what = f"turn {flight.turn} {'' if flight.step == 0 else 'rule '}{flight.name}"
        said = f"{what} stopped: {why}"
        nxt.endings = [*nxt.endings, said][-20:]
        data = {
            "step": flight.name,
            "turn": flight.turn,
            "exit_code": out.exit_code,
            "status": out.status,
            "note": out.note,
            "digest": out.digest,
            "ending": said,
            "stopped": True,
        }
        events.append(Event("step_finished", data, out.lease_id))
        detail = f"{short} during the {what} step; it runs again {again}"
    else:
        step = "agent" if cp.step == 0 else spec.verifier[cp.step - 1].name
        detail = f"{short}; resumes at turn {cp.turn} ({step}) {again}"
    body = {"turn": cp.turn, "step": cp.step, "detail": detail, **extra}
    events.append(Event(TASK_STOPPED, body))
    return Next(nxt, QUEUED, detail, tuple(events))


# When this process started (near enough: when its loop module was imported), the moment a
# clock-time OVERNIGHT_STOP_AT is read from: every task this worker takes sees the same end.
PROCESS_START = datetime.now().astimezone()


def configured() -> float | None:
    """The settings' stop time as unix time (None: the night has no end)."""
    from overnight.config.context import settings
    from overnight.config.stopat import stop_unix

    return stop_unix(settings().stop_at, PROCESS_START)
