"""The turn loop of one task: agent step, then every verifier rule, until a machine says done.

Each step is begun in one write (its call charged to the task's own ``max_calls`` and the
step checkpointed as in flight), charged to the shared envelope (both under a request id
fixed by (task, run, turn, step), so a repeated step is never charged twice: :mod:`charge`),
run, and ended in one write. A turn reads (the server clock, a stop asked of this process, the
step's outcome), decides in the pure rules of :mod:`turn` and :mod:`judge`, and writes
what they say once. Times are Redis server time. The loop holds the task through its
claim; a :class:`ClaimKeeper` thread renews it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import redis

from overnight.config.folders import FolderUnusable
from overnight.coordinator import agents
from overnight.coordinator.tasks import stop
from overnight.coordinator.tasks.charge import CallRefused, Consume, charge, give_back
from overnight.coordinator.tasks.judge import begin, refused, request_id, step_name
from overnight.coordinator.tasks.prepare import (
    LoopConfig,
    cannot_start,
    say,
    step_request,
)
from overnight.coordinator.tasks.record import CheckedTree, Checkpoint, Next, Runner, TaskRecord
from overnight.coordinator.tasks.states import PAUSED, RUNNING
from overnight.coordinator.tasks.steps import StepOutcome, StepRequest, StepRunner
from overnight.coordinator.tasks.store import TaskRefused, TaskStore
from overnight.coordinator.tasks.turn import (
    LoopEnd,
    after_step,
    before_step,
    resumed,
    spent_nothing,
)
from overnight.coordinator.workspace.remote import PushRefused
from overnight.coordinator.workspace.taskspace import (
    TaskSpace,
    WorkspaceError,
    rule_argv,
    verifier_env,
)
from overnight.coordinator.workspace.worktree import GitError
from overnight.worker.envelope.refusals import EnvelopeUnavailable
from overnight.worker.lease.store import new_lease_id
from overnight.worker.sandbox import uidpool
from overnight.worker.sandbox.stepuser import StepUser, hand_over

__all__ = ["CallRefused", "Consume", "LoopConfig", "LoopEnd", "TaskLoop"]

log = logging.getLogger("overnight.loop")


class ClaimKeeper(threading.Thread):
    """Renews a task claim every third of its TTL; sets ``lost`` when it cannot."""

    def __init__(self, store: TaskStore, task_id: str, token: str, ttl: float) -> None:
        super().__init__(name=f"claim-{task_id}", daemon=True)
        self.store, self.task_id, self.token, self.ttl = store, task_id, token, ttl
        self.lost = threading.Event()
        self._halt = threading.Event()

    def run(self) -> None:
        last_ok = time.monotonic()
        while not self._halt.wait(self.ttl / 3):
            try:
                self.store.renew(self.task_id, self.token, self.ttl)
                last_ok = time.monotonic()
            except TaskRefused:
                self.lost.set()
                return
            except redis.RedisError as exc:  # Redis away: the claim lapses on the server too
                if time.monotonic() - last_ok > self.ttl:
                    log.warning("task %s: claim lost: %s", self.task_id, exc)
                    self.lost.set()
                    return

    def stop(self) -> None:
        self._halt.set()


class ServerClock:
    """Redis server time without a round trip of its own: the server time the last write
    replied with, plus the monotonic time since. Task deadlines run on it, as lease
    deadlines run on the server's clock; no worker's wall clock decides one."""

    def __init__(self, server_now: float) -> None:
        self.set(server_now)

    def set(self, server_now: float) -> None:
        self._at, self._mono = server_now, time.monotonic()

    def __call__(self) -> float:
        return self._at + (time.monotonic() - self._mono)


class TaskLoop:
    """Runs one attempt of one task to a terminal state, a pause, or the loss of its claim."""

    def __init__(
        self,
        store: TaskStore,
        runner: StepRunner,
        consume: Consume,
        config: LoopConfig,
    ) -> None:
        self.store, self.runner, self.consume, self.config = store, runner, consume, config
        self.clock = ServerClock(0.0)
        self.token = uuid.uuid4().hex
        self.keeper: ClaimKeeper | None = None
        self.space: TaskSpace | None = None
        self.task_user: StepUser | None = None  # the uid this attempt holds from the pool
        self._ran = False  # the step in flight was handed to the runner (it may have spent)

    def run(self, task_id: str, attempt: int, runner: Runner) -> LoopEnd:
        """Claim the task and loop; returns where the attempt ended (or why it was not run)."""
        if self.config.stop_at and stop.stop_due(self.store.now(), self.config.stop_at):
            log.info("task %s attempt %s: not run: the night has ended", task_id, attempt)
            return LoopEnd.skipped("night-ended")
        try:
            rec = self.store.claim(task_id, attempt, self.token, self.config.claim_ttl, runner)
        except TaskRefused as exc:
            log.info("task %s attempt %s: not run: %s", task_id, attempt, exc.why)
            return LoopEnd.skipped(exc.why)
        self.keeper = ClaimKeeper(self.store, task_id, self.token, self.config.claim_ttl)
        self.keeper.start()
        try:
            return self._as_task_user(rec)
        finally:
            self.keeper.stop()

    def _as_task_user(self, rec: TaskRecord) -> LoopEnd:
        """Loop as the task's own uid (held from here to the end of this attempt, when the
        step user stands for a pool of uids), its worktree given back before the uid is."""
        base, holding = self.config, False
        try:
            with uidpool.held(base.step_user, rec.id, self._places()) as user:
                holding = True
                self.config = replace(base, step_user=user)
                self.task_user = None if user is base.step_user else user
                try:
                    return self._loop(rec)
                finally:
                    if self.space is not None:
                        self.space.close()
                    if self.task_user is not None:  # the uid's next task must not own it
                        with contextlib.suppress(OSError):
                            hand_over(self.config.prompt_dir / rec.id, os.geteuid(), os.getegid())
        except (uidpool.PoolExhausted, FolderUnusable) as exc:
            if holding:  # not the pool's: the loop's own
                raise
            return self._write(rec, Next(rec.checkpoint, PAUSED, f"no step uid: {exc}"))
        finally:
            self.config, self.task_user = base, None

    # --- the loop ----------------------------------------------------------------------
    def _loop(self, rec: TaskRecord) -> LoopEnd:
        """Each turn's step: read, decide, and one write of the decision; on while the
        task stays running."""
        spec = rec.spec
        # The claim just wrote updated_unix (and started_unix on a first run) in server time.
        self.clock = ServerClock(rec.updated_unix or self.store.now())
        cp, paused = resumed(rec.checkpoint, spec, self.config.max_lost_leases)
        if paused is not None:
            return self._write(rec, paused)
        deadline = (rec.started_unix or self.clock()) + spec.deadline
        while True:
            nxt = self._step(rec, cp, deadline)
            if isinstance(nxt, LoopEnd):
                return nxt
            end = self._write(rec, nxt)
            if end.state != RUNNING:
                return end
            cp = nxt.checkpoint

    def _step(self, rec: TaskRecord, cp: Checkpoint, deadline: float) -> Next | LoopEnd:
        """The next step of the task at ``cp``, begun, run and judged: what to write (the
        caller writes it), or the loss of the claim."""
        spec, config = rec.spec, self.config
        if self.keeper is not None and self.keeper.lost.is_set():
            return LoopEnd.lost()
        now = self.clock()
        ended = before_step(
            cp, spec, now=now, deadline=deadline, stop_at=config.stop_at, asked=config.stop_asked()
        )
        if ended is not None:
            return ended
        if cp.step == 0 and spec.base is not None:
            try:  # the task's worktree, made before its first step is charged
                self._space(rec).agent_cwd(config.step_user)
            except (GitError, OSError, WorkspaceError) as exc:
                return Next(cp, PAUSED, f"workspace: {exc}")
        step_deadline = min(deadline - now, spec.step_deadline(config.default_deadline))
        by_stop = stop.stop_cut(now, config.stop_at, config.grace, step_deadline)
        step_deadline = step_deadline if by_stop is None else by_stop
        space = self._space(rec) if spec.base is not None and cp.step == 0 else None
        try:  # before the step is charged: a step that cannot be prepared costs nothing
            req = step_request(rec, cp, step_deadline, config, space)
        except (GitError, OSError, WorkspaceError) as exc:
            what = step_name(spec, cp.step)
            return Next(cp, PAUSED, f"cannot prepare the {what} step: {exc}")
        if self.task_user is not None:  # agent steps and verifier rules alike
            req = replace(req, user=self.task_user)
        blocked = cannot_start(rec, cp, req, config, space)
        if blocked is not None:  # before its call is charged; `overnight logs` says why
            say(req.log_path, f"overnight: {blocked.detail}")
            return blocked
        request = request_id(rec.id, rec.run, cp)
        started = begin(cp, spec, request, now)
        try:
            self.clock.set(charge(self.store, self.token, self.consume, rec, started, request))
        except TaskRefused:
            return LoopEnd.lost()
        except CallRefused as exc:
            return refused(cp, spec, exc.who, exc.detail)
        except EnvelopeUnavailable as exc:  # the step never started: recovery runs it again
            log.warning("task %s: %s; the step does not start", rec.id, exc)
            if self.keeper is not None:
                self.keeper.stop()
            return LoopEnd.lost()
        cp = started
        self._ran = False
        try:
            outcome, cp = self._run_step(rec, cp, req, request)
        except PushRefused as exc:  # another host moved the task: its outcome is unknown
            log.warning("task %s: %s; leaving the step in flight to recovery", rec.id, exc)
            if self.keeper is not None:
                self.keeper.stop()  # the claim lapses: recovery decides, as for a lost worker
            return LoopEnd.lost()
        except (GitError, OSError, WorkspaceError) as exc:
            if not self._ran:  # it never started: nothing was spent
                give_back(self.store, self.token, rec, cp.step, request)
            return Next(cp, PAUSED, f"workspace: {exc}")
        if isinstance(req.on_line, agents.Reader):
            outcome = replace(outcome, said=req.on_line.said())
        nxt = after_step(
            cp,
            spec,
            outcome,
            now=self.clock(),
            deadline=deadline,
            log=str(req.log_path) if req.log_path is not None else "",
            cut_by_night=by_stop is not None,
            stop_at=config.stop_at,
            asked=config.stop_asked(),
        )
        if spent_nothing(nxt, outcome):
            give_back(self.store, self.token, rec, cp.step, request)
        return nxt

    # --- helpers -----------------------------------------------------------------------
    def _state(self) -> Path:
        from overnight.coordinator.workspace.worktree import state_dir

        return self.config.state_dir or state_dir()

    def _space(self, rec: TaskRecord) -> TaskSpace:
        if self.space is None:
            self.space = TaskSpace(rec, self._state(), self.store.keys.namespace)
        return self.space

    def _places(self) -> tuple[uidpool.Place, ...]:
        """Where a file an earlier holder of a uid left would reach this task's steps."""
        state = self._state()
        return ((state / "worktrees", 2), (state / "checkouts", 2), (self.config.prompt_dir, 1))

    def _run_step(
        self, rec: TaskRecord, cp: Checkpoint, req: StepRequest, request: str
    ) -> tuple[StepOutcome, Checkpoint]:
        """Run a step in the task's workspace: an agent step in its worktree (locked while
        it runs, committed after), a rule in a fresh checkout of the turn's commit with the
        protected paths put back, as the step user (owning that checkout), with a fixed
        environment. The verdict is the exit status overnight sees; what the rule does to
        its checkout is thrown away with it."""
        if rec.spec.base is None:
            self._ran = True
            return self.runner(req), cp
        space = self._space(rec)
        if cp.step == 0:
            req = replace(req, lease_id=new_lease_id())
            space.lock(req.lease_id or request)
            try:
                self._ran = True
                out = self.runner(req)
            finally:
                space.unlock()
            if out.survivors:  # its tree may still write: nothing it left can be verified
                raise WorkspaceError(
                    f"{out.survivors} process(es) of the agent step outlived its lease; "
                    "the turn is not verified"
                )
            after = space.after_agent(cp.turn, f"{out.status} ({out.note}, exit {out.exit_code})")
            tree = space.tree
            cp = cp.model_copy(
                update={
                    "branch": tree.branch if tree is not None else None,
                    "head": after.head,
                    "diffstat": after.diffstat,
                    "protected_changed": list(after.changed),
                    "checked": None,
                }
            )
            return out, cp
        user = self.config.step_user  # the rule runs as the agent step does, never as overnight
        with space.verifier_tree(cp.head, user) as checked:
            forbidden = [*space.forbidden(), checked.root]
            req = replace(
                req,
                cwd=checked.cwd,
                argv=rule_argv(req.argv, rec.spec.base, checked),
                env=verifier_env(req.env, forbidden, user),
                worktree=checked.root,  # in a sandbox: the whole checkout, read-write
            )
            self._ran = True
            out = self.runner(req)
        seen = CheckedTree(
            commit=checked.commit, snapshot=checked.snapshot, protected=checked.protected
        )
        return out, cp.model_copy(update={"checked": seen})

    def _write(self, rec: TaskRecord, nxt: Next) -> LoopEnd:
        """Write ``nxt``; returns where the task is now (``LEFT`` in its state, RUNNING
        included), or the loss of the claim."""
        try:
            self.clock.set(self.store.save(rec, self.token, nxt))
        except TaskRefused as exc:
            log.warning("task %s: write as %s refused (%s); stopping", rec.id, nxt.state, exc.why)
            return LoopEnd.lost()
        if not nxt.goes_on:
            log.info("task %s: %s (%s)", rec.id, nxt.state, nxt.detail)
        return LoopEnd.left(nxt.state)
