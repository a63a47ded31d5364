"""`overnight report --plain` and the plain progress lines: escaped text, lease endings."""

from __future__ import annotations

import io
from pathlib import Path

from overnight.coordinator.report.progress import PlainProgress, TaskRow
from overnight.coordinator.report.view import render_plain
from overnight.coordinator.tasks.record import Checkpoint, TaskRecord
from overnight.coordinator.tasks.states import State
from overnight.coordinator.tasks.taskfile import TaskSpec


def record(tmp_path: Path, task_id: str, detail: str, endings: list[str]) -> TaskRecord:
    spec = TaskSpec.model_validate(
        {
            "id": task_id,
            "assignment": "x",
            "workdir": str(tmp_path),
            "agent": ["true"],
            "max_calls": 4,
            "verifier": [{"name": "ok", "run": ["true"]}],
        }
    )
    return TaskRecord(
        id=task_id,
        run="r",
        attempt=1,
        state=State.HALTED_STUCK,
        detail=detail,
        spec=spec,
        checkpoint=Checkpoint(endings=endings),
        submitted_unix=100.0,
        ended_unix=110.0,
    )


def test_plain_report_escapes_and_lists_endings(tmp_path: Path) -> None:
    evil = "done\x1b[2J\x1b]0;owned\x07 \u202etxt.exe"
    ending = "turn 1 agent killed: heartbeat gap 2.0 s"
    out = io.StringIO()
    render_plain(
        [record(tmp_path, "t1", evil, [ending, "turn 2 rule ok timed out after 20 s"])],
        out,
        ["envelope default: remaining 3\x1b[0m"],
    )
    text = out.getvalue()
    assert "\x1b" not in text and "\u202e" not in text and "\x07" not in text
    assert "done\\x1b[2J\\x1b]0;owned\\x07 \\u202etxt.exe" in text
    lines = text.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("t1 "))
    assert lines[row + 1].strip() == ending
    assert lines[row + 2].strip() == "turn 2 rule ok timed out after 20 s"
    assert lines[-1] == "envelope default: remaining 3\\x1b[0m"


def test_plain_progress_prints_each_new_ending_once() -> None:
    progress = PlainProgress()

    def row(*endings: str, state: str = "running", calls: int = 1) -> TaskRow:
        return TaskRow("hangs-once", state, 1, calls, 4, endings=endings)

    first = progress.changes([row()])
    assert first == ["hangs-once: running turn 1 calls 1/4"]
    killed = "turn 1 agent killed: heartbeat gap 2.0 s"
    assert progress.changes([row(killed)]) == [f"hangs-once: {killed}"]
    assert progress.changes([row(killed)]) == []
    later = "turn 2 agent killed: heartbeat gap 2.0 s"
    assert progress.changes([row(killed, later, calls=3)]) == [
        f"hangs-once: {later}",
        "hangs-once: running turn 1 calls 3/4",
    ]
    # The record keeps only the last few: a shifted window still yields only what is new.
    third = "turn 3 rule tests timed out after 20 s"
    assert progress.changes([row(later, third, calls=3)]) == [f"hangs-once: {third}"]


def test_progress_line_escapes_the_task_id() -> None:
    assert TaskRow("a\x1b[1mb", "queued", 0, 0, 1).line().startswith("a\\x1b[1mb: queued")
