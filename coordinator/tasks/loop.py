"""The turn loop of one task: agent step, then every verifier rule, until a machine says done.

Each step is begun in one write (its call charged to the task's own ``max_calls`` and the
step checkpointed as in flight), charged to the shared envelope (both under a request id
fixed by (task, run, turn, step), so a repeated step is never charged twice), run, and
ended in one write of what the pure :mod:`judge` makes of its outcome. Times are Redis
server time. The loop holds the task through its claim; a :class:`ClaimKeeper` thread
renews it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import redis

from overnight.config.spawn import python_module
from overnight.coordinator import agents
from overnight.coordinator.tasks import model_step, stop
from overnight.coordinator.tasks.judge import (
    PROTECTED_RULE,
    agent_failed,
    begin,
    expired,
    judge,
    lost_step,
    refused,
    request_id,
    rule_cannot_start,
    step_name,
)
from overnight.coordinator.tasks.record import (
    CheckedTree,
    Checkpoint,
    Memory,
    Next,
    Runner,
    TaskRecord,
)
from overnight.coordinator.tasks.states import PAUSED, RUNNING, State
from overnight.coordinator.tasks.steps import StepOutcome, StepRequest, StepRunner, start_problem
from overnight.coordinator.tasks.store import TaskRefused, TaskStore
from overnight.coordinator.tasks.taskfile import TaskSpec
from overnight.coordinator.workspace.taskspace import (
    TaskSpace,
    WorkspaceError,
    rule_argv,
    verifier_env,
)
from overnight.coordinator.workspace.worktree import GitError
from overnight.worker.gateway.grant import Grant
from overnight.worker.lease.store import new_lease_id
from overnight.worker.sandbox import stepenv, stepuser
from overnight.worker.sandbox.launch import worktree_git
from overnight.worker.sandbox.stepuser import StepUser

log = logging.getLogger("overnight.loop")

MAX_PROMPT_ARG = 100_000  # bytes; Linux refuses a single argv/env string over 128 KiB
MODEL_STEP = python_module("overnight.coordinator.tasks.model_step")


class CallRefused(Exception):
    """A call was refused: ``who`` is ``task`` (its max_calls) or ``envelope``."""

    def __init__(self, who: str, detail: str) -> None:
        super().__init__(detail)
        self.who = who
        self.detail = detail


# (envelope name, kind, request id) -> None, or raise CallRefused.
Consume = Callable[[str, str, str], None]


@dataclass
class LoopConfig:
    """Knobs from settings that the loop needs."""

    default_deadline: float = 180.0
    default_gap: float = 30.0
    grace: float = 5.0
    claim_ttl: float = 15.0
    max_lost_leases: int = 3
    prompt_dir: Path = Path("/tmp/overnight")
    # Each task's step output is kept under log_dir/<task id>/ (None: not kept on disk).
    log_dir: Path | None = None
    # overnight's state folder: task worktrees, verifier checkouts (None: the setting's).
    state_dir: Path | None = None
    # Who steps run as (owns the task's prompt folder): by default as the settings say.
    step_user: StepUser | None = field(default_factory=stepuser.configured)
    # OVERNIGHT_MODEL_* for the built-in model step only (command agents never see the key).
    model_env: dict[str, str] = field(default_factory=dict, repr=False)
    # The model an agent preset asks for when its task names none, by wire format.
    preset_models: dict[str, str] = field(
        default_factory=lambda: {"openai": "gpt-4o-mini", "anthropic": "claude-sonnet-4-5"}
    )
    # The gateway agent steps are pointed at (None: no gateway, no token for the step).
    gateway_url: str | None = None
    # When the night ends (unix time; OVERNIGHT_STOP_AT): no step starts from then on.
    stop_at: float | None = field(default_factory=stop.configured)
    # The signal of a stop asked of this process (a work horse's SIGTERM), or None.
    stop_asked: Callable[[], int | None] = stop.not_asked


def build_prompt(spec: TaskSpec, memory: Memory | None) -> str:
    """The assignment, and once a verdict failed: exactly the unmet rules and the evidence."""
    parts = [f"Assignment:\n{spec.assignment.strip()}\n"]
    if memory is not None:
        runs = {rule.name: " ".join(rule.run) for rule in spec.verifier}
        runs.setdefault(PROTECTED_RULE, "leave the protected paths as they were at the base")
        unmet = "\n".join(f"- {name}: `{runs.get(name, '?')}`" for name in memory.unmet)
        parts.append(f"These checks still fail; you are done only when they pass:\n{unmet}\n")
        how = f" ({memory.note})" if memory.note else ""
        evidence = memory.evidence.strip() or "(no output)"
        parts.append(
            f"Output of the first failing check, {memory.rule}{how}, last lines:\n{evidence}\n"
        )
    return "\n".join(parts)


def _clip(text: str, limit: int = MAX_PROMPT_ARG) -> str:
    raw = text.encode()
    if len(raw) <= limit:
        return text
    note = "\n[prompt truncated; the full prompt is in $OVERNIGHT_PROMPT_FILE]\n"
    return raw[: limit - len(note)].decode("utf-8", "ignore") + note


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
        self._ran = False  # the step in flight was handed to the runner (it may have spent)

    def run(self, task_id: str, attempt: int, runner: Runner) -> str:
        """Claim the task and loop; returns the state it was left in (or why it was not run)."""
        if self.config.stop_at and stop.stop_due(self.store.now(), self.config.stop_at):
            log.info("task %s attempt %s: not run: the night has ended", task_id, attempt)
            return "skipped:night-ended"
        try:
            rec = self.store.claim(task_id, attempt, self.token, self.config.claim_ttl, runner)
        except TaskRefused as exc:
            log.info("task %s attempt %s: not run: %s", task_id, attempt, exc.why)
            return f"skipped:{exc.why}"
        self.keeper = ClaimKeeper(self.store, task_id, self.token, self.config.claim_ttl)
        self.keeper.start()
        try:
            return self._loop(rec)
        finally:
            self.keeper.stop()
            if self.space is not None:
                self.space.close()

    # --- the loop ----------------------------------------------------------------------
    def _loop(self, rec: TaskRecord) -> str:
        """Each step: one write to begin it (its charge and its in-flight mark), the run,
        and one write of what the judge makes of its outcome."""
        spec, cp = rec.spec, rec.checkpoint
        # The claim just wrote updated_unix (and started_unix on a first run) in server time.
        self.clock = ServerClock(rec.updated_unix or self.store.now())
        if cp.in_flight is not None:
            lost = lost_step(cp, spec.on_unknown, self.config.max_lost_leases)
            if lost.state == PAUSED:
                return self._write(rec, lost)
            cp = lost.checkpoint.model_copy(update={"in_flight": None})
        deadline = (rec.started_unix or self.clock()) + spec.deadline
        while True:
            if self.keeper is not None and self.keeper.lost.is_set():
                return "lost"
            now = self.clock()
            ended = expired(cp, spec, now, deadline)
            if ended is not None:
                return self._write(rec, ended)
            if self.config.stop_at and stop.stop_due(now, self.config.stop_at):
                return self._write(rec, stop.stopped(cp, spec, self.config.stop_at))
            asked = self.config.stop_asked()
            if asked is not None:
                return self._write(rec, stop.stop_asked(cp, spec, asked))
            if cp.step == 0 and spec.base is not None:
                try:  # the task's worktree, made before its first step is charged
                    self._space(rec).agent_cwd(self.config.step_user)
                except (GitError, OSError, WorkspaceError) as exc:
                    return self._write(rec, Next(cp, PAUSED, f"workspace: {exc}"))
            step_deadline = min(deadline - now, self._step_deadline(spec))
            by_stop = stop.stop_cut(now, self.config.stop_at, self.config.grace, step_deadline)
            step_deadline = step_deadline if by_stop is None else by_stop
            try:  # before the step is charged: a step that cannot be prepared costs nothing
                req = self._request(rec, cp, step_deadline)
            except (GitError, OSError, WorkspaceError) as exc:
                what = step_name(spec, cp.step)
                return self._write(rec, Next(cp, PAUSED, f"cannot prepare the {what} step: {exc}"))
            blocked = self._cannot_start(rec, cp, req)
            if blocked is not None:  # before its call is charged
                return self._write(rec, blocked)
            request = request_id(rec.id, rec.run, cp)
            started = begin(cp, spec, request, now)
            try:
                self.clock.set(self._begin(rec, started, request))
            except TaskRefused:
                return "lost"
            except CallRefused as exc:
                return self._write(rec, refused(cp, spec, exc.who, exc.detail))
            cp = started
            self._ran = False
            try:
                outcome, cp = self._run_step(rec, cp, req, request)
            except (GitError, OSError, WorkspaceError) as exc:
                if not self._ran:  # it never started: nothing was spent
                    self._give_back(rec, cp.step, request)
                return self._write(rec, Next(cp, PAUSED, f"workspace: {exc}"))
            if isinstance(req.on_line, agents.Reader):
                outcome = replace(outcome, said=req.on_line.said())
            log_file = str(req.log_path) if req.log_path is not None else ""
            if by_stop is not None and outcome.status == "expired" and self.config.stop_at:
                return self._write(rec, stop.stopped(cp, spec, self.config.stop_at, outcome))
            asked = self.config.stop_asked()
            if asked is not None and stop.ended_by_stop(outcome, asked):
                return self._write(rec, stop.stop_asked(cp, spec, asked, outcome))
            nxt = judge(cp, spec, outcome, now=self.clock(), deadline=deadline, log=log_file)
            if nxt.state == State.AGENT_FAILED or not outcome.started:
                self._give_back(rec, cp.step, request)
            state = self._write(rec, nxt)
            if state != RUNNING:
                return state
            cp = nxt.checkpoint

    # --- helpers -----------------------------------------------------------------------
    def _begin(self, rec: TaskRecord, started: Checkpoint, request: str) -> float:
        """Charge the step in flight in ``started`` to the task (and save it as in flight),
        then to the shared envelope; returns the server time of the write. Raises
        CallRefused, or TaskRefused if the claim is lost."""
        spec = rec.spec
        kind = "model" if started.step == 0 else "tool"
        try:
            begun = self.store.begin(rec, self.token, started, spec.max_calls)
        except TaskRefused as exc:
            if exc.reason != "ceiling":
                raise
            detail = f"task max_calls ({spec.max_calls}) reached; refused {kind} call"
            raise CallRefused("task", detail) from None
        try:
            self.consume(spec.envelope, kind, request)
        except CallRefused:
            self.store.uncharge(rec.id, self.token, request)
            raise
        return begun.now

    def _space(self, rec: TaskRecord) -> TaskSpace:
        if self.space is None:
            from overnight.coordinator.workspace.worktree import state_dir

            state = self.config.state_dir or state_dir()
            self.space = TaskSpace(rec, state, self.store.keys.namespace)
        return self.space

    def _run_step(
        self, rec: TaskRecord, cp: Checkpoint, req: StepRequest, request: str
    ) -> tuple[StepOutcome, Checkpoint]:
        """Run a step in the task's workspace: an agent step in its worktree (locked while
        it runs, committed after), a rule in a fresh checkout of the turn's commit with the
        protected paths put back, as overnight's own user, with a fixed environment."""
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
        with space.verifier_tree(cp.head) as checked:
            forbidden = [*space.forbidden(), checked.root]
            req = replace(
                req,
                cwd=checked.cwd,
                argv=rule_argv(req.argv, rec.spec.base, checked),
                env=verifier_env(req.env, forbidden),
                as_step_user=False,
                worktree=checked.root,  # in a sandbox: the whole checkout, read-write
            )
            self._ran = True
            out = self.runner(req)
        seen = CheckedTree(
            commit=checked.commit, snapshot=checked.snapshot, protected=checked.protected
        )
        return out, cp.model_copy(update={"checked": seen})

    def _cannot_start(self, rec: TaskRecord, cp: Checkpoint, req: StepRequest) -> Next | None:
        """The end (agent) or pause (verifier rule) of a task whose next step's command
        cannot start, found before the step is charged; None if it can start."""
        spec = rec.spec
        if cp.step == 0:
            if not os.path.isdir(req.cwd):
                why = self._space(rec).missing_workdir() if spec.base is not None else None
                return agent_failed(cp, spec.command(), why or f"workdir {req.cwd} is missing")
            unstartable = self._unstartable(spec, req.cwd)
            return None if unstartable is None else agent_failed(cp, spec.command(), unstartable)
        rule = spec.verifier[cp.step - 1]
        if "/" in rule.run[0]:
            return None  # found in the turn's own tree; said after the run if it is not
        path = verifier_env({}, [])["PATH"] if spec.base is not None else None
        path = path or req.env.get("PATH") or os.environ.get("PATH") or stepenv.DEFAULT_PATH
        if start_problem(rule.run, req.cwd, path) is None:
            return None
        return rule_cannot_start(cp, rule.name, rule.run[0], "was not found on PATH")

    def _unstartable(self, spec: TaskSpec, cwd: str) -> str | None:
        if not spec.agent:
            return None
        path = spec.env.get("PATH") or os.environ.get("PATH") or stepenv.DEFAULT_PATH
        if isinstance(spec.agent, str):
            preset = agents.get(spec.agent)
            if preset is None:
                return f"no agent preset {spec.agent!r}"
            if self.config.gateway_url is None:
                return (
                    f"the {preset.name} preset talks to a model only through the gateway, "
                    "and none is configured (set OVERNIGHT_MODEL_URL or "
                    "OVERNIGHT_ANTHROPIC_URL)"
                )
            if start_problem([preset.program], cwd, path) is not None:
                return (
                    f"the {preset.name} preset needs {preset.program!r} on PATH, which it "
                    f"is not (install: {preset.install})"
                )
            return None
        return start_problem(spec.agent, cwd, path)

    def _give_back(self, rec: TaskRecord, step: int, request: str) -> None:
        """A step that never started (or an agent that could not start) spent nothing: its
        call goes back to the task and to the shared envelope, so both agree with what ran."""
        from overnight.worker.envelope.envelope import CallEnvelope, EnvelopeRefused

        try:
            self.store.uncharge(rec.id, self.token, request)
        except (TaskRefused, redis.RedisError) as exc:
            log.warning("task %s: could not give back the call of %s: %s", rec.id, request, exc)
        kind = "model" if step == 0 else "tool"
        envelope = CallEnvelope(
            self.store.client, rec.spec.envelope, self.store.keys.namespace, task_id=rec.id
        )
        try:
            envelope.refund(kind, request)
        except (EnvelopeRefused, redis.RedisError) as exc:
            log.warning("task %s: envelope kept the call of %s: %s", rec.id, request, exc)

    def _log_path(self, rec: TaskRecord, cp: Checkpoint, name: str) -> Path | None:
        if self.config.log_dir is None:
            return None
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        return self.config.log_dir / rec.id / f"turn-{cp.turn:03d}-step-{cp.step:02d}-{safe}.log"

    def _step_deadline(self, spec: TaskSpec) -> float:
        return spec.step_deadline(self.config.default_deadline)

    def _request(self, rec: TaskRecord, cp: Checkpoint, deadline: float) -> StepRequest:
        spec = rec.spec
        gap = spec.step_gap(self.config.default_gap)
        base = {**spec.env, "OVERNIGHT_TASK_ID": rec.id, "OVERNIGHT_TURN": str(cp.turn)}
        if cp.step > 0:
            rule = spec.verifier[cp.step - 1]
            return StepRequest(
                rec.id,
                rule.name,
                list(rule.run),
                spec.workdir,
                base,
                deadline,
                gap,
                self.config.grace,
                beat_while_alive=True,
                log_path=self._log_path(rec, cp, rule.name),
            )
        cwd, tree = spec.workdir, None
        if spec.base is not None:
            cwd = self._space(rec).agent_cwd(self.config.step_user)
            tree = self._space(rec).tree
        prompt = build_prompt(spec, cp.memory)
        # A folder of this task's own, which only the step user can enter.
        folder = stepuser.task_folder(self.config.prompt_dir, rec.id, self.config.step_user)
        prompt_file = stepuser.write_file(folder / "prompt.txt", prompt)
        short = _clip(prompt)
        env = {**base, "OVERNIGHT_PROMPT": short, "OVERNIGHT_PROMPT_FILE": str(prompt_file)}
        if spec.base is not None:
            env.update(self._space(rec).agent_env())
        stdin = None
        home_files: dict[str, str] | None = None
        reader: agents.Reader | None = None
        if isinstance(spec.agent, str):
            preset = agents.get(spec.agent)
            assert preset is not None  # the task file names only known presets
            model = spec.model or self.config.preset_models.get(preset.wire, "")
            ctx = agents.Context(
                prompt=short,
                prompt_file=str(prompt_file),
                model=model,
                workdir=cwd,
                turn=cp.turn,
                gateway_url=self.config.gateway_url or "",
            )
            launch = preset.launch(ctx)
            argv, home_files, reader = launch.argv, launch.home_files, preset.reader()
            env.update(launch.env)
        elif spec.agent:
            argv = [a.replace("{prompt}", short) for a in spec.agent]
        else:  # the model settings reach the built-in step on stdin only
            argv = MODEL_STEP
            env[model_step.SETTINGS_VAR] = "stdin"
            stdin = model_step.settings_line(self.config.model_env, self.config.gateway_url)
        return StepRequest(
            rec.id,
            "agent",
            argv,
            cwd,
            env,
            deadline,
            gap,
            self.config.grace,
            stdin_data=stdin,
            log_path=self._log_path(rec, cp, "agent"),
            grant=self._grant(rec),
            home_files=home_files,
            on_line=reader,
            worktree=str(tree.path) if tree is not None else None,
            readable=(str(folder), *(worktree_git(tree.git_dir) if tree else ())),
        )

    def _grant(self, rec: TaskRecord) -> Grant | None:
        # The loop charged this step's model unit before it runs: the step's first request
        # through the gateway uses it (prepaid), so a step costs max(1, its requests).
        if self.config.gateway_url is None:
            return None
        spec = rec.spec
        return Grant(
            self.config.gateway_url,
            envelope=spec.envelope,
            task_id=rec.id,
            max_calls=spec.max_calls,
            max_tokens=spec.max_tokens,
            prepaid=True,
        )

    def _write(self, rec: TaskRecord, nxt: Next) -> str:
        """Write ``nxt``; returns the state the task is now in, or ``lost``."""
        try:
            self.clock.set(self.store.save(rec, self.token, nxt))
        except TaskRefused as exc:
            log.warning("task %s: write as %s refused (%s); stopping", rec.id, nxt.state, exc.why)
            return "lost"
        if not nxt.goes_on:
            log.info("task %s: %s (%s)", rec.id, nxt.state, nxt.detail)
        return nxt.state
