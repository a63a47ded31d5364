"""The night's end as the turn loop sees it (``up --until``, ``OVERNIGHT_STOP_AT``): pure
rules, no clock, no Redis.

From the stop time no step starts; a step running then gets the grace to finish its turn
(its lease deadline is cut to ``stop + grace``), and one the cut ends is recorded as ended by
the stop. Either way the task goes back to ``queued`` from its checkpoint, claim and lease
released, and the next night runs the same step again (under the same request id, so it is
not charged twice).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from overnight.coordinator.states import QUEUED
from overnight.coordinator.taskrecord import Checkpoint, Event, Next

if TYPE_CHECKING:
    from overnight.coordinator.steps import StepOutcome
    from overnight.coordinator.taskfile import TaskSpec

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
    flight = cp.in_flight
    nxt = cp.model_copy(deep=True)
    nxt.in_flight = None
    events = []
    if out is not None and flight is not None:
        what = f"turn {flight.turn} {'' if flight.step == 0 else 'rule '}{flight.name}"
        said = f"{what} stopped: the night ended at {_when(stop_at)}"
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
        detail = f"night ended at {_when(stop_at)} during the {what} step; it runs again next night"
    else:
        step = "agent" if cp.step == 0 else spec.verifier[cp.step - 1].name
        detail = f"night ended at {_when(stop_at)}; resumes at turn {cp.turn} ({step}) next night"
    events.append(
        Event(
            TASK_STOPPED, {"turn": cp.turn, "step": cp.step, "detail": detail, "stop_at": stop_at}
        )
    )
    return Next(nxt, QUEUED, detail, tuple(events))


def configured() -> float | None:
    """The settings' stop time as unix time (None: the night has no end)."""
    from datetime import datetime

    from overnight.config.context import settings
    from overnight.config.stopat import stop_unix

    return stop_unix(settings().stop_at, datetime.now().astimezone())
