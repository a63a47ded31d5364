"""A turn of the task loop, decided: where an attempt ends, and the pure rules around each
step (what ends a task before its next step, what a step's outcome makes of it).

The loop reads (the server clock, a stop asked of its process, the step's outcome), asks
here, and writes the :class:`Next` it is told, once. No Redis, no clock, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from overnight.coordinator.tasks import stop
from overnight.coordinator.tasks.judge import expired, judge, lost_step
from overnight.coordinator.tasks.states import PAUSED, State

if TYPE_CHECKING:
    from overnight.coordinator.tasks.record import Checkpoint, Next
    from overnight.coordinator.tasks.steps import StepOutcome
    from overnight.coordinator.tasks.taskfile import TaskSpec


class Ending(Enum):
    """How an attempt of a task ended for the process that ran it."""

    SKIPPED = "skipped"  # not run: the night had ended, or the claim was refused
    LOST = "lost"  # its claim was lost: recovery decides what the task becomes
    LEFT = "left"  # the task was written in a state that is not running


@dataclass(frozen=True)
class LoopEnd:
    """Where :meth:`TaskLoop.run` left an attempt: the state written (``LEFT``), or why
    nothing was (``SKIPPED``, ``LOST``)."""

    how: Ending
    state: State | None = None
    why: str = ""

    @classmethod
    def skipped(cls, why: str) -> LoopEnd:
        return cls(Ending.SKIPPED, why=why)

    @classmethod
    def lost(cls) -> LoopEnd:
        return cls(Ending.LOST)

    @classmethod
    def left(cls, state: State) -> LoopEnd:
        return cls(Ending.LEFT, state)

    @property
    def label(self) -> str:
        """In words, as the RQ job returns it: ``skipped:<why>``, ``lost`` or the state."""
        if self.how is Ending.SKIPPED:
            return f"skipped:{self.why}"
        if self.how is Ending.LOST or self.state is None:
            return "lost"
        return self.state.value


def resumed(cp: Checkpoint, spec: TaskSpec, max_lost: int) -> tuple[Checkpoint, Next | None]:
    """A claimed task's checkpoint with a step still in flight (its last run was lost): the
    loss counted and the step cleared to run again, or the pause it ends in (``Next``)."""
    if cp.in_flight is None:
        return cp, None
    lost = lost_step(cp, spec.on_unknown, max_lost)
    if lost.state == PAUSED:
        return cp, lost
    return lost.checkpoint.model_copy(update={"in_flight": None}), None


def before_step(
    cp: Checkpoint,
    spec: TaskSpec,
    *,
    now: float,
    deadline: float,
    stop_at: float | None,
    asked: int | None,
) -> Next | None:
    """What ends the task before its next step starts: its own deadline, the night's end
    (``stop_at``), a stop asked of its process (``asked``, a signal); None: the step may."""
    ended = expired(cp, spec, now, deadline)
    if ended is not None:
        return ended
    if stop_at and stop.stop_due(now, stop_at):
        return stop.stopped(cp, spec, stop_at)
    if asked is not None:
        return stop.stop_asked(cp, spec, asked)
    return None


def after_step(
    cp: Checkpoint,
    spec: TaskSpec,
    out: StepOutcome,
    *,
    now: float,
    deadline: float,
    log: str,
    cut_by_night: bool,
    stop_at: float | None,
    asked: int | None,
) -> Next:
    """What the step in flight in ``cp`` that ended as ``out`` makes of the task: stopped by
    the night's end (its deadline was cut to it, ``cut_by_night``, and it expired), stopped
    by the stop asked of its process, or as :func:`judge` says."""
    if cut_by_night and out.status == "expired" and stop_at:
        return stop.stopped(cp, spec, stop_at, out)
    if asked is not None and stop.ended_by_stop(out, asked):
        return stop.stop_asked(cp, spec, asked, out)
    return judge(cp, spec, out, now=now, deadline=deadline, log=log)


def spent_nothing(nxt: Next, out: StepOutcome) -> bool:
    """Whether the step's call goes back: its command never started (an agent that could
    not start ends the task as agent_failed)."""
    return nxt.state == State.AGENT_FAILED or not out.started
