"""Where each task's step output is kept, and ``overnight logs TASK`` that prints it.

A worker writes every step's whole output (up to ``steps.LOG_CAP_BYTES``) to one file,
``OVERNIGHT_STATE_DIR/task-logs/<namespace>/<task id>/turn-NNN-step-NN-<name>.log``, on its own
host; the task's record keeps the last steps' tails and their log paths. A task's folder
goes once retention has forgotten its record and nothing was written to it for as long
(:func:`prune_task_logs`, run by each worker every hour).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from overnight.coordinator.report.text import printable
from overnight.worker.sandbox import nofollow

if TYPE_CHECKING:
    import redis

    from overnight.config.keys import Keys
    from overnight.config.settings import Settings
    from overnight.coordinator.tasks.record import TaskRecord

_NAME = re.compile(r"turn-(\d+)-step-(\d+)-(.*)\.log")
FOLLOW_POLL = 0.5


def task_log_root(settings: Settings, namespace: str) -> Path:
    """The folder under which this host keeps the step logs of ``namespace``'s tasks: in
    overnight's state folder (:func:`overnight.coordinator.workspace.worktree.state_dir`), the same
    one that holds the worktrees."""
    from overnight.coordinator.workspace.worktree import state_dir

    return state_dir(settings) / "task-logs" / namespace


def expired_logs(
    last_writes: dict[str, float], live: set[str], now: float, retention: float
) -> list[str]:
    """Which tasks' log folders go, of ``last_writes`` (task id -> last write, unix time):
    those whose task record is gone (not in ``live``) and not written for ``retention`` s. A
    task that waits (paused, queued) keeps its logs as long as its record lives."""
    return sorted(t for t, at in last_writes.items() if t not in live and now - at >= retention)


def _last_write(folder: Path) -> float:
    times = [folder.stat().st_mtime]
    for path in folder.iterdir():
        try:
            times.append(path.stat().st_mtime)
        except OSError:
            continue
    return max(times)


def prune_task_logs(
    client: redis.Redis, keys: Keys, root: Path, retention: float, now: float | None = None
) -> list[str]:
    """Remove the log folders under ``root`` (this host's, one namespace's) that
    :func:`expired_logs` says are over; returns their task ids."""
    if not root.is_dir():
        return []
    last_writes = {}
    for folder in root.iterdir():
        try:
            if folder.is_dir() and not folder.is_symlink():
                last_writes[folder.name] = _last_write(folder)
        except OSError:
            continue
    if not last_writes:
        return []
    names = sorted(last_writes)
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.exists(keys.task(name))
    live = {name for name, there in zip(names, pipe.execute(), strict=True) if there}
    gone = expired_logs(last_writes, live, time.time() if now is None else now, retention)
    for name in gone:
        with contextlib.suppress(OSError):
            nofollow.remove_path(root / name)
    return gone


def task_folder(rec: TaskRecord, root: Path) -> Path:
    """Where ``rec``'s step logs are: beside the last log its record names (the folder of
    the worker that ran it), else under ``root``."""
    for step in reversed(rec.checkpoint.steps):
        if step.log:
            return Path(step.log).parent
    return root / rec.id


def step_files(folder: Path, turn: int | None = None) -> list[tuple[int, int, str, Path]]:
    """The step logs in ``folder`` as (turn, step, name, path), in the order they ran."""
    found = []
    if folder.is_dir():
        for path in folder.iterdir():
            m = _NAME.fullmatch(path.name)
            if m and (turn is None or int(m.group(1)) == turn):
                found.append((int(m.group(1)), int(m.group(2)), m.group(3), path))
    return sorted(found)


def _header(turn: int, name: str, path: Path) -> str:
    return f"==> turn {turn} {name} ({path}) <=="


def print_logs(
    folder: Path,
    out: TextIO,
    *,
    turn: int | None = None,
    follow: bool = False,
    settled: Callable[[], bool] = lambda: True,
) -> int:
    """Print the step logs in ``folder`` (only turn ``turn``'s if given), each under a
    header line, with control characters escaped. With ``follow``, keep printing what is
    added (new steps, new lines) until ``settled()`` and nothing more came. Returns how
    many step logs were printed."""
    offsets: dict[Path, int] = {}
    current: Path | None = None
    while True:
        grew = False
        for t, _step, name, path in step_files(folder, turn):
            try:
                with os.fdopen(os.open(path, nofollow.READ_FLAGS), "rb") as fh:
                    fh.seek(offsets.get(path, 0))
                    data = fh.read()
            except OSError:
                continue
            if path not in offsets or data:
                if current != path:
                    out.write(_header(t, name, path) + "\n")
                    current = path
                out.write(printable(data.decode("utf-8", "replace"), newlines=True))
                out.flush()
                offsets[path] = offsets.get(path, 0) + len(data)
                grew = True
        if not follow or (not grew and settled()):
            return len(offsets)
        if not grew:
            time.sleep(FOLLOW_POLL)
