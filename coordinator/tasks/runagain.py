"""``overnight rerun``: an ended task runs again, on its branch with its work kept, or from its
base commit (``--from-base``).

Not to be confused with :mod:`coordinator.dispatch.rerun`, which decides when a task whose
worker died may run its step again. Here the rules are pure (:func:`next_checkpoint`,
:func:`next_spec`); :func:`run_again` writes them in one task script and enqueues the job.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from overnight.config.errors import OvernightError
from overnight.coordinator.tasks.record import Checkpoint, TaskRecord
from overnight.coordinator.tasks.states import TERMINAL
from overnight.coordinator.tasks.taskfile import TaskSpec
from overnight.coordinator.workspace.worktree import WORKTREE

if TYPE_CHECKING:
    import redis

    from overnight.coordinator.tasks.store import TaskStore


class RerunRefused(OvernightError):
    """The task cannot run again as asked; the message says why and what to do, in one line."""


def next_checkpoint(cp: Checkpoint, *, from_base: bool) -> Checkpoint:
    """Where a rerun starts: the turn after the last one that began (so a turn's log files
    are never written twice), nothing in flight, the stuck count at zero. On the branch, the
    branch's head and the unmet rules stay (the first prompt names them); from the base,
    everything about the earlier work goes."""
    update: dict[str, object] = {
        "turn": cp.turns + 1,
        "step": 0,
        "in_flight": None,
        "agent": None,
        "results": [],
        "checked": None,
        "fingerprint": None,
        "repeats": 0,
        "lost_leases": 0,
    }
    if from_base:
        update |= {
            "memory": None,
            "last_verdict": None,
            "branch": None,
            "head": None,
            "diffstat": "",
            "protected_changed": [],
        }
    return cp.model_copy(deep=True, update=update)


def next_spec(spec: TaskSpec, calls_used: int, budget: int | None) -> TaskSpec:
    """The spec of the rerun: ``budget`` more calls than the task has used (default: its
    max_calls again); ``calls_used`` goes on counting, so receipts and envelope agree."""
    more = spec.max_calls if budget is None else budget
    return spec.model_copy(update={"max_calls": calls_used + more})


def refusal(rec: TaskRecord, from_base: bool) -> str | None:
    """Why ``rec`` cannot run again (None: it can)."""
    if rec.state not in TERMINAL:
        what = "reconcile it first" if rec.state == "paused_for_reconciliation" else "wait"
        return f"task {rec.id!r} is {rec.state}, not ended; {what}"
    base = rec.spec.base
    if from_base and rec.spec.repo is not None:
        return (
            f"task {rec.id!r} is from a repo: its branch is on the remote, which --from-base "
            "does not rename (rerun it on its branch, or submit it again with a new id)"
        )
    if from_base and (base is None or base.mode != WORKTREE):
        return (
            f"task {rec.id!r} works in place: it has no base commit to start from "
            "(rerun it without --from-base)"
        )
    return None


@dataclass(frozen=True)
class Rerun:
    """What a rerun did: the task's new run, attempt and max_calls, and the branch that
    keeps the earlier work when it started from the base."""

    task_id: str
    run: str
    attempt: int
    max_calls: int
    kept_branch: str | None = None


def run_again(
    store: TaskStore,
    rq_conn: redis.Redis,
    task_id: str,
    *,
    budget: int | None = None,
    from_base: bool = False,
    state: Path | None = None,
) -> Rerun:
    """Queue the ended task ``task_id`` again under a new run nonce (so no step of it is
    taken for one charged before) and enqueue its job. On its branch, its worktree moves to
    the new run's folder; from the base, the branch is first renamed
    ``overnight/<id>-<old run>`` (its worktree removed) so the earlier work stays, and a new
    branch grows from the base. Raises :class:`RerunRefused`."""
    from overnight.coordinator.dispatch.enqueue import enqueue
    from overnight.coordinator.tasks.store import TaskRefused

    rec = store.get(task_id)
    if rec is None:
        raise RerunRefused(f"no task {task_id!r} in namespace {store.keys.namespace!r}")
    why = refusal(rec, from_base) or _no_calls(store, rec.spec.envelope)
    if why is not None:
        raise RerunRefused(why)
    run, kept = uuid.uuid4().hex[:8], None
    if from_base:
        kept = _set_aside(rec, store.keys.namespace, state)
    elif rec.spec.repo is None:  # a repo task's tree is made again from its remote branch
        _move_worktree(rec, store.keys.namespace, state, run)
    spec = next_spec(rec.spec, rec.calls_used, budget)
    cp = next_checkpoint(rec.checkpoint, from_base=from_base)
    try:
        store.rerun(rec, spec, cp, run)
    except TaskRefused as exc:
        raise RerunRefused(f"task {task_id!r} changed meanwhile ({exc.why}); try again") from None
    again = store.get(task_id)
    assert again is not None
    enqueue(rq_conn, [again], store.keys.namespace)
    return Rerun(task_id, run, again.attempt, spec.max_calls, kept)


def _no_calls(store: TaskStore, name: str) -> str | None:
    """Why the task's envelope would refuse its first call at once (None: it would not)."""
    from overnight.worker.envelope.envelope import CallEnvelope

    snap = CallEnvelope(store.client, name, store.keys.namespace).snapshot()
    if snap.exists and snap.remaining > 0:
        return None
    how = "does not exist" if not snap.exists else "has no calls left"
    return (
        f"envelope {name!r} {how}, so the task would halt at its first call; give it calls "
        f"first (`overnight envelope reset N --name {name}`)"
    )


def _move_worktree(rec: TaskRecord, namespace: str, state: Path | None, run: str) -> None:
    """Move the task's worktree (if it is still there) to the folder of run ``run``."""
    from overnight.coordinator.workspace import worktree as ws

    base = rec.spec.base
    if base is None or base.mode != ws.WORKTREE:
        return
    root = state or ws.state_dir()
    path = ws.worktree_path(root, namespace, rec.id, rec.run)
    if not path.exists():
        return
    try:
        target = ws.worktree_path(root, namespace, rec.id, run)
        ws.move_worktree(base.root, str(path), str(target))
    except (ws.GitError, OSError) as exc:
        raise RerunRefused(f"task {rec.id!r}: cannot move its worktree: {exc}") from None


def _set_aside(rec: TaskRecord, namespace: str, state: Path | None) -> str:
    """Remove the task's worktree and rename its branch, keeping the earlier work; returns
    the branch's new name."""
    from overnight.coordinator.workspace import worktree as ws

    base = rec.spec.base
    assert base is not None
    branch = ws.branch_name(rec.id)
    kept = f"{branch}-{rec.run}"
    path = ws.worktree_path(state or ws.state_dir(), namespace, rec.id, rec.run)
    try:
        if path.exists():
            ws.drop_worktree(base.root, str(path))
        ws.git("worktree", "prune", cwd=base.root)
        if ws.branch_exists(base.root, branch):
            ws.git("branch", "-m", branch, kept, cwd=base.root)
    except ws.GitError as exc:
        raise RerunRefused(f"task {rec.id!r}: cannot set its branch aside: {exc}") from None
    return kept
