"""``overnight demo``: the example tasks through ``overnight up`` on a private Redis."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from overnight.config.exits import (
    EXIT_INTERNAL,
    EXIT_NEEDS_PERSON,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
)
from overnight.coordinator.night.up import UpOptions, run_up
from overnight.coordinator.tasks.states import State
from overnight.worker.sandbox.stepuser import STEP_USER, StepUser, decide, reach_problem

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# What each example task is built to show; the demo checks that it did.
EXPECTED = {
    "greeting": State.FINISHED_VERIFIED,
    "fix-add": State.FINISHED_VERIFIED,
    "hangs-once": State.FINISHED_VERIFIED,
    "never-done": State.HALTED_AT_CALL_CEILING,
}
# Who the example steps run as when overnight runs as root and no step user is set.
DEMO_USER = "nobody"
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
    env, user = _step_user()
    tasks = _copy_tasks(examples, run_dir / "tasks", user)
    print(f"overnight demo: tasks copied to {tasks}; budget {DEMO_BUDGET} calls", file=sys.stderr)
    opts = UpOptions(
        workers=workers,
        tasks=[tasks],
        budget=DEMO_BUDGET,
        exit_when_done=True,
        state_dir=run_dir / "state",
        embedded=True,
        env={"OVERNIGHT_NAMESPACE": "demo", **env},
    )
    result = run_up(opts)
    if result.report is not None:
        print(f"demo: report {result.report}")
    # never-done is meant to end halted, which `up --exit-when-done` says with its status.
    if result.code not in (EXIT_OK, EXIT_NEEDS_PERSON):
        return result.code
    wrong = []
    for task_id, want in EXPECTED.items():
        got = result.states.get(task_id, "missing")
        print(f"demo: {task_id}: {got} ({'as expected' if got == want else 'expected ' + want})")
        if got != want:
            wrong.append(task_id)
    return EXIT_OK if not wrong else EXIT_INTERNAL


def _step_user() -> tuple[dict[str, str], StepUser | None]:
    """Who the demo's steps run as: the settings' step user; as root without one (and
    without the root opt-in), ``nobody``, said in one line, so a fresh machine runs it."""
    from overnight.config.settings import load_settings

    settings = load_settings()
    euid = os.geteuid()
    if euid != 0 or settings.step_user or settings.allow_root_steps:
        return {}, decide(settings.step_user, settings.allow_root_steps, euid)
    user = decide(DEMO_USER, False, euid)
    print(
        f"overnight demo: running as root and {STEP_USER} is unset: the example steps run "
        f"as {DEMO_USER!r}",
        file=sys.stderr,
    )
    return {STEP_USER: DEMO_USER}, user


def _copy_tasks(examples: Path, dest: Path, user: StepUser | None) -> Path:
    """Copy the examples to ``dest``, the step user's own; where it cannot reach ``dest``
    (a private state folder), to a fresh folder in the temp folder instead."""
    existing = dest
    while not existing.exists():
        existing = existing.parent
    if user is not None and reach_problem(existing / "x", user) is not None:
        dest = Path(tempfile.mkdtemp(prefix="overnight-demo-")) / "tasks"
        dest.parent.chmod(0o755)
    shutil.copytree(examples, dest)
    if user is not None:
        for folder, dirs, files in os.walk(dest):
            for name in [folder, *(os.path.join(folder, n) for n in dirs + files)]:
                os.chown(name, user.uid, user.gid)
    return dest
