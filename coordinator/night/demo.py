"""``overnight demo``: the example tasks through ``overnight up`` on a private Redis, in a
scratch repository of their own (never the checkout it is started from)."""

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
from overnight.config.folders import make_folders
from overnight.coordinator.night.up import UpOptions, run_up
from overnight.coordinator.tasks.states import State
from overnight.coordinator.workspace import worktree
from overnight.worker.sandbox.stepuser import (
    STEP_UIDS,
    STEP_USER,
    StepUser,
    decide,
    reach_problem,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# What each example task is built to show; the demo checks that it did.
EXPECTED = {
    "greeting": State.FINISHED_VERIFIED,
    "fix-add": State.FINISHED_VERIFIED,
    "hangs-once": State.FINISHED_VERIFIED,
    "never-done": State.HALTED_AT_CALL_CEILING,
}
# Who the example steps run as when overnight runs as root, no step user is set and the uid
# range is off.
DEMO_USER = "nobody"
# Enough for the first three tasks (2 + 4 + 4 calls at most); the fourth drains the rest.
DEMO_BUDGET = 16
# In a demo's folder: a link to its scratch folder when that had to live elsewhere.
SCRATCH_LINK = "scratch"


def run_demo(workers: int, state_root: Path, examples: Path = EXAMPLES) -> int:
    """Commit the examples to a fresh scratch repository, run them, print the report; 0 if
    each ended as it is meant to."""
    if not examples.is_dir():
        raise CommandError(
            f"no example tasks at {examples}: this installation is incomplete", EXIT_USAGE
        )
    env, user = _step_user()
    _sandbox_ready(user)  # exit 78 naming the fix before any folder is made
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir = make_folders(state_root.resolve() / "demo" / stamp, 0o711)
    scratch = scratch_folder(run_dir, user)
    repo = scratch_repository(examples, scratch / "repo")
    workspace = make_folders(scratch / "workspace", 0o711)
    print(
        f"overnight demo: the example tasks in a scratch repository {repo}; "
        f"budget {DEMO_BUDGET} calls",
        file=sys.stderr,
    )
    opts = UpOptions(
        workers=workers,
        tasks=[repo],
        budget=DEMO_BUDGET,
        exit_when_done=True,
        state_dir=run_dir / "state",
        embedded=True,
        env={"OVERNIGHT_NAMESPACE": "demo", "OVERNIGHT_STATE_DIR": str(workspace), **env},
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
    """Who the demo's steps run as: whom the settings name (as root by default, a uid of
    ``OVERNIGHT_STEP_UIDS`` for each task); as root with neither a step user nor the uid
    range (nor the root opt-in), ``nobody``, said in one line, so a fresh machine runs it."""
    from overnight.config.settings import load_settings

    settings = load_settings()
    euid = os.geteuid()
    if euid != 0 or settings.step_user or settings.allow_root_steps or settings.step_uids != "off":
        return {}, decide(
            settings.step_user, settings.allow_root_steps, euid, uids=settings.step_uids
        )
    user = decide(DEMO_USER, False, euid)
    print(
        f"overnight demo: running as root, {STEP_USER} is unset and {STEP_UIDS} is off: the "
        f"example steps run as {DEMO_USER!r}",
        file=sys.stderr,
    )
    return {STEP_USER: DEMO_USER}, user


def _sandbox_ready(user: StepUser | None) -> None:
    from overnight.config.settings import load_settings
    from overnight.worker.sandbox import launch

    launch.require(load_settings().sandbox, user)


def scratch_folder(run_dir: Path, user: StepUser | None) -> Path:
    """Where the demo's repository and worktrees go: ``run_dir`` itself, or, where the step
    user cannot enter it (a state folder in a private home), a fresh folder of this night
    in the temp folder, linked from ``run_dir/scratch`` (``make clean`` follows the link)."""
    if user is None or reach_problem(run_dir / "x", user) is None:
        return run_dir
    scratch = Path(tempfile.mkdtemp(prefix="overnight-demo-"))
    scratch.chmod(0o711)
    (run_dir / SCRATCH_LINK).symlink_to(scratch)
    return scratch


def scratch_repository(examples: Path, repo: Path) -> Path:
    """A git repository at ``repo`` holding one commit of the example tasks (an empty folder
    gets a ``.keep`` file, since git keeps no empty folder and a task's workdir must exist
    in its worktree)."""
    shutil.copytree(examples, repo, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for folder, dirs, files in os.walk(repo):
        if not dirs and not files:
            Path(folder, ".keep").touch()
    worktree.git("init", "--quiet", "--initial-branch=main", cwd=str(repo))
    worktree.git("add", "--all", cwd=str(repo))
    worktree.git(
        "-c",
        "commit.gpgsign=false",
        "commit",
        "--quiet",
        "-m",
        "overnight demo tasks",
        cwd=str(repo),
    )
    return repo
