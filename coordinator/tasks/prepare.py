"""What a step is asked to run, built before it is charged: its request (argv, environment,
prompt, deadline, gateway grant) and whether its command can start at all."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from overnight.config import defaults
from overnight.config.spawn import python_module
from overnight.coordinator import agents
from overnight.coordinator.tasks import model_step, stop
from overnight.coordinator.tasks.judge import PROTECTED_RULE, agent_failed, rule_cannot_start
from overnight.coordinator.tasks.record import Checkpoint, Memory, Next, TaskRecord
from overnight.coordinator.tasks.steps import StepRequest, start_problem
from overnight.coordinator.tasks.taskfile import TaskSpec
from overnight.coordinator.workspace.taskspace import TaskSpace, verifier_env
from overnight.worker.gateway.grant import Grant
from overnight.worker.sandbox import stepenv, stepuser
from overnight.worker.sandbox.limits import Limits
from overnight.worker.sandbox.limits import configured as limits_setting
from overnight.worker.sandbox.nofollow import open_append
from overnight.worker.sandbox.stepuser import StepUser

MAX_PROMPT_ARG = 100_000  # bytes; Linux refuses a single argv/env string over 128 KiB
MODEL_STEP = python_module("overnight.coordinator.tasks.model_step")


@dataclass
class LoopConfig:
    """Knobs from settings that the loop needs."""

    # Each task's prompt folder is made below it (a per-user folder of the settings').
    prompt_dir: Path
    default_deadline: float = defaults.DEADLINE
    default_gap: float = defaults.HEARTBEAT_GAP
    grace: float = defaults.GRACE
    claim_ttl: float = defaults.TASK_CLAIM_TTL
    max_lost_leases: int = defaults.MAX_LOST_LEASES
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


def step_limits(spec: TaskSpec) -> Limits:
    """The limits a task's steps run under: the settings', with the task's own values."""
    base = limits_setting()
    return base if spec.limits is None else base.overridden(spec.limits.model_dump())


def build_prompt(spec: TaskSpec, memory: Memory | None) -> str:
    """The assignment, and once a verdict failed: exactly the unmet rules and the evidence."""
    parts = [f"Assignment:\n{spec.assignment.strip()}\n"]
    if memory is not None and memory.stopped:
        parts.append(f"Your last turn was stopped: {memory.stopped}.\n")
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


def step_request(
    rec: TaskRecord, cp: Checkpoint, deadline: float, config: LoopConfig, space: TaskSpace | None
) -> StepRequest:
    """What the step ``cp`` points at is asked to run (``space``: the task's workspace, for a
    task with a base commit)."""
    spec = rec.spec
    gap = spec.step_gap(config.default_gap)
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
            config.grace,
            beat_while_alive=True,
            log_path=log_path(config, rec, cp, rule.name),
            limits=step_limits(spec),
        )
    cwd, tree = spec.workdir, None
    if space is not None:
        cwd = space.agent_cwd(config.step_user)
        tree = space.tree
    prompt = build_prompt(spec, cp.memory)
    # A folder of this task's own, which only the step user can enter.
    folder = stepuser.task_folder(config.prompt_dir, rec.id, config.step_user)
    prompt_file = stepuser.write_file(folder / "prompt.txt", prompt)
    short = _clip(prompt)
    env = {**base, "OVERNIGHT_PROMPT": short, "OVERNIGHT_PROMPT_FILE": str(prompt_file)}
    if space is not None:
        env.update(space.agent_env())
    stdin = None
    home_files: dict[str, str] | None = None
    reader: agents.Reader | None = None
    if isinstance(spec.agent, str):
        preset = agents.get(spec.agent)
        assert preset is not None  # the task file names only known presets
        model = spec.model or config.preset_models.get(preset.wire, "")
        ctx = agents.Context(
            prompt=short,
            prompt_file=str(prompt_file),
            model=model,
            workdir=cwd,
            turn=cp.turn,
            gateway_url=config.gateway_url or "",
        )
        launch = preset.launch(ctx)
        argv, home_files, reader = launch.argv, launch.home_files, preset.reader()
        env.update(launch.env)
    elif spec.agent:
        argv = [a.replace("{prompt}", short) for a in spec.agent]
    else:  # the model settings reach the built-in step on stdin only
        argv = MODEL_STEP
        env[model_step.SETTINGS_VAR] = "stdin"
        stdin = model_step.settings_line(config.model_env, config.gateway_url)
    return StepRequest(
        rec.id,
        "agent",
        argv,
        cwd,
        env,
        deadline,
        gap,
        config.grace,
        stdin_data=stdin,
        log_path=log_path(config, rec, cp, "agent"),
        grant=grant(config, rec),
        home_files=home_files,
        on_line=reader,
        worktree=str(tree.path) if tree is not None else None,
        network=spec.network,
        allow_hosts=tuple(spec.allow_hosts),
        limits=step_limits(spec),
        readable=(str(folder), *(space.git_readable() if space is not None else ())),
    )


def grant(config: LoopConfig, rec: TaskRecord) -> Grant | None:
    # The loop charged this step's model unit before it runs: the step's first request
    # through the gateway uses it (prepaid), so a step costs max(1, its requests).
    if config.gateway_url is None:
        return None
    spec = rec.spec
    return Grant(
        config.gateway_url,
        envelope=spec.envelope,
        task_id=rec.id,
        max_calls=spec.max_calls,
        max_tokens=spec.max_tokens,
        prepaid=True,
    )


def log_path(config: LoopConfig, rec: TaskRecord, cp: Checkpoint, name: str) -> Path | None:
    """Where the step's output is kept (None: not kept on disk)."""
    if config.log_dir is None:
        return None
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return config.log_dir / rec.id / f"turn-{cp.turn:03d}-step-{cp.step:02d}-{safe}.log"


def cannot_start(
    rec: TaskRecord, cp: Checkpoint, req: StepRequest, config: LoopConfig, space: TaskSpace | None
) -> Next | None:
    """The end (agent) or pause (verifier rule) of a task whose next step's command
    cannot start, found before the step is charged; None if it can start."""
    spec = rec.spec
    if cp.step == 0:
        if not os.path.isdir(req.cwd):
            why = space.missing_workdir() if space is not None else None
            return agent_failed(cp, spec.command(), why or f"workdir {req.cwd} is missing")
        unstartable = unstartable_agent(spec, req.cwd, config.gateway_url)
        return None if unstartable is None else agent_failed(cp, spec.command(), unstartable)
    rule = spec.verifier[cp.step - 1]
    if "/" in rule.run[0]:
        return None  # found in the turn's own tree; said after the run if it is not
    path = verifier_env({}, [], config.step_user)["PATH"] if spec.base is not None else None
    path = path or req.env.get("PATH") or os.environ.get("PATH") or stepenv.DEFAULT_PATH
    if start_problem(rule.run, req.cwd, path) is None:
        return None
    return rule_cannot_start(cp, rule.name, rule.run[0], "was not found on PATH")


def unstartable_agent(spec: TaskSpec, cwd: str, gateway_url: str | None) -> str | None:
    """Why the task's agent command cannot start here, or None."""
    if not spec.agent:
        return None
    path = spec.env.get("PATH") or os.environ.get("PATH") or stepenv.DEFAULT_PATH
    if isinstance(spec.agent, str):
        preset = agents.get(spec.agent)
        if preset is None:
            return f"no agent preset {spec.agent!r}"
        if gateway_url is None:
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


def say(log_path: Path | None, line: str) -> None:
    """Append overnight's own line to a step's log, so `overnight logs` shows why a step did
    not run (a log that cannot be written costs the line, not the task)."""
    if log_path is None:
        return
    try:
        with os.fdopen(open_append(log_path), "a", encoding="utf-8") as fh:
            fh.write(line.rstrip("\n") + "\n")
    except OSError:
        pass
