"""Live progress of ``overnight up``: a table redrawn in place on a terminal, else log lines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from overnight.coordinator.report.text import printable
from overnight.coordinator.tasks.states import State

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
    # Its lease endings that were not clean exits, oldest first ("turn 1 agent killed: ...").
    endings: tuple[str, ...] = ()

    def line(self) -> str:
        """The row as one plain log line."""
        lease = "" if self.lease_age is None else f" lease {self.lease_age:.0f}s"
        beat = "" if self.beat_age is None else f" beat {self.beat_age:.1f}s ago"
        verdict = f" | {self.verdict}" if self.verdict else ""
        return printable(
            f"{self.task_id}: {self.state} turn {self.turn} "
            f"calls {self.calls_used}/{self.max_calls}{lease}{beat}{verdict}"
        )

    def ending_line(self, ending: str) -> str:
        """One lease ending of this task as a plain log line."""
        return printable(f"{self.task_id}: {ending}")


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
    from rich.text import Text

    budget = "unknown" if remaining is None else str(remaining)
    out = Table(
        title=f"overnight — {elapsed:.0f}s — envelope '{envelope}': {budget} calls left",
        title_justify="left",
        expand=False,
    )
    columns = (
        "task",
        "state",
        "turn",
        "calls",
        "lease age",
        "last beat",
        "last verdict",
        "last lease ending",
    )
    for name in columns:
        out.add_column(name, no_wrap=not name.startswith("last "))
    for row in rows:
        style = STATE_STYLE.get(row.state, "")
        out.add_row(
            Text(printable(row.task_id)),
            Text(row.state, style=style),
            str(row.turn),
            f"{row.calls_used}/{row.max_calls}",
            "" if row.lease_age is None else f"{row.lease_age:.0f}s",
            "" if row.beat_age is None else f"{row.beat_age:.1f}s ago",
            Text(printable(row.verdict)),
            Text(printable(row.endings[-1]) if row.endings else "", style="red"),
        )
    return out


class PlainProgress:
    """Without a terminal: print a row only when its state, turn or calls changed, and each
    lease ending that was not a clean exit once, as it appears."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[str, int, int]] = {}
        self._endings: dict[str, tuple[str, ...]] = {}

    def changes(self, rows: list[TaskRow]) -> list[str]:
        lines: list[str] = []
        for row in rows:
            lines.extend(row.ending_line(e) for e in self._new_endings(row))
            key = (row.state, row.turn, row.calls_used)
            if self._last.get(row.task_id) != key:
                self._last[row.task_id] = key
                lines.append(row.line())
        return lines

    def _new_endings(self, row: TaskRow) -> tuple[str, ...]:
        seen = self._endings.get(row.task_id, ())
        self._endings[row.task_id] = row.endings
        # The record keeps the last few: what is new is what follows the longest overlap.
        for start in range(len(seen) + 1):
            overlap = seen[start:]
            if row.endings[: len(overlap)] == overlap:
                return row.endings[len(overlap) :]
        return row.endings
