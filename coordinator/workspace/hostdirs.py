"""The folders a worker uses on this host, made and checked when it starts: overnight's state
folder (worktrees, step logs, prompts) and its runtime folder (lease proofs). Each is this
user's own, so no path is shared by users (nor written by another night's); one that cannot
be used ends the start with one line naming it and the fix, before any task is taken."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from overnight.config.folders import FolderUnusable, usable
from overnight.config.runtime import runtime_root
from overnight.coordinator.workspace.worktree import state_dir

if TYPE_CHECKING:
    from overnight.config.settings import Settings
    from overnight.worker.sandbox.stepuser import StepUser


def prompt_root(settings: Settings, namespace: str) -> Path:
    """Where the prompt folders of ``namespace``'s tasks are (one per task, the step user's)."""
    return state_dir(settings) / "prompts" / namespace


def prepare_host(settings: Settings, user: StepUser | None) -> list[Path]:
    """Make (modes set whatever the umask) and check the folders a worker of ``settings``
    needs here; ``user`` (the step user) must be able to enter the state folder. Returns
    them; raises :class:`FolderUnusable` (exit 78) naming the first that cannot be used."""
    from overnight.worker.sandbox.stepuser import reach_problem

    named = bool(settings.state_dir)
    fix = "set OVERNIGHT_STATE_DIR to a folder of your own" + (" instead" if named else "")
    state = usable(state_dir(settings), 0o711, fix, own=not named)
    if user is not None:
        why = reach_problem(state / "worktrees", user)
        if why is not None:
            raise FolderUnusable(
                state, why, f"let {user.name} enter it (chmod o+x on each folder above) or {fix}"
            )
    xdg = "XDG_RUNTIME_DIR" in os.environ and os.geteuid() != 0
    runtime = usable(
        runtime_root(),
        0o700,
        "set XDG_RUNTIME_DIR to a folder of your own" if not xdg else "check XDG_RUNTIME_DIR",
        private=True,
        own=True,
    )
    return [state, runtime]
