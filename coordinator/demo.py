"""``overnight demo``: the example tasks through ``overnight up`` on a private Redis."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from overnight.config.exits import EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, CommandError
from overnight.coordinator.states import State
from overnight.coordinator.up import UpOptions, run_up

EXAMPLES = Path(__file__).resolve().parent / "examples"
# What each example task is built to show; the demo checks that it did.
EXPECTED = {
    "greeting": State.FINISHED_VERIFIED,
    "fix-add": State.FINISHED_VERIFIED,
    "hangs-once": State.FINISHED_VERIFIED,
    "never-done": State.HALTED_AT_CALL_CEILING,
}
# Enough for the first three tasks (2 + 4 + 4 calls at most); the fourth drains the rest.
DEMO_BUDGET = 16


def run_demo(workers: int, state_root: Path, examples: Path = EXAMPLES) -> int:
    """Copy the examples to a fresh folder, run them, print the report; 0 if each ended
    as it is meant to."""
    if not examples.is_dir():
        raise CommandError(
            f"no example tasks at {examples}: this installation is incomplete", EXIT_USAGE
        )
    run_dir = state_root / "demo" / time.strftime("%Y%m%d-%H%M%S")
    shutil.copytree(examples, run_dir / "tasks")
    print(f"overnight demo: tasks copied to {run_dir / 'tasks'}; budget {DEMO_BUDGET} calls",
          file=sys.stderr)  # fmt: skip
    opts = UpOptions(
        workers=workers,
        tasks=[run_dir / "tasks"],
        budget=DEMO_BUDGET,
        exit_when_done=True,
        state_dir=run_dir / "state",
        embedded=True,
        env={"OVERNIGHT_NAMESPACE": "demo"},
    )
    result = run_up(opts)
    if result.code != EXIT_OK:
        return result.code
    wrong = []
    for task_id, want in EXPECTED.items():
        got = result.states.get(task_id, "missing")
        print(f"demo: {task_id}: {got} ({'as expected' if got == want else 'expected ' + want})")
        if got != want:
            wrong.append(task_id)
    return EXIT_OK if not wrong else EXIT_INTERNAL
