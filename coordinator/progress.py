"""Live progress of ``overnight up``: a table redrawn in place on a terminal, else log lines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from overnight.coordinator.states import State

if TYPE_CHECKING:
    from rich.table import Table


@dataclass(frozen=True)
class TaskRow:
    """What one row of the progress table shows."""

    task_id: str
    state: str
    turn: int
    calls_used: int
    max_calls: int
    lease_age: float | None = None
    beat_age: float | None = None
    verdict: str = ""

    def line(self) -> str:
        """The row as one plain log line."""
        lease = "" if self.lease_age is None else f" lease {self.lease_age:.0f}s"
        beat = "" if self.beat_age is None else f" beat {self.beat_age:.1f}s ago"
        verdict = f" | {self.verdict}" if self.verdict else ""
        return (
            f"{self.task_id}: {self.state} turn {self.turn} "
            f"calls {self.calls_used}/{self.max_calls}{lease}{beat}{verdict}"
        )


STATE_STYLE: dict[str, str] = {
    State.FINISHED_VERIFIED: "green",
    State.HALTED_AT_CALL_CEILING: "yellow",
    State.HALTED_STUCK: "yellow",
    State.PAUSED: "magenta",
    State.EXPIRED: "red",
    State.ABORTED: "red",
    State.AGENT_FAILED: "red",
    State.RUNNING: "cyan",
    State.QUEUED: "dim",
}


def table(rows: list[TaskRow], envelope: str, remaining: int | None, elapsed: float) -> Table:
    """The progress table for a terminal."""
    from rich.table import Table

    budget = "unknown" if remaining is None else str(remaining)
    out = Table(
        title=f"overnight — {elapsed:.0f}s — envelope '{envelope}': {budget} calls left",
        title_justify="left",
        expand=False,
    )
    for name in ("task", "state", "turn", "calls", "lease age", "last beat", "last verdict"):
        out.add_column(name, no_wrap=name != "last verdict")
    for row in rows:
        style = STATE_STYLE.get(row.state, "")
        out.add_row(
            row.task_id,
            f"[{style}]{row.state}[/]" if style else row.state,
            str(row.turn),
            f"{row.calls_used}/{row.max_calls}",
            "" if row.lease_age is None else f"{row.lease_age:.0f}s",
            "" if row.beat_age is None else f"{row.beat_age:.1f}s ago",
            row.verdict,
        )
    return out


class PlainProgress:
    """Without a terminal: print a row only when its state, turn or calls changed."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[str, int, int]] = {}

    def changes(self, rows: list[TaskRow]) -> list[str]:
        lines = []
        for row in rows:
            key = (row.state, row.turn, row.calls_used)
            if self._last.get(row.task_id) != key:
                self._last[row.task_id] = key
                lines.append(row.line())
        return lines
