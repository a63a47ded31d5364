"""Task files: TOML (or the same keys as JSON) validated into a :class:`TaskSpec`.

Validation is total: every problem of every file is collected as one line naming the
file and the key, so ``overnight submit`` can refuse a whole batch at once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from overnight.config.errors import OvernightError
from overnight.config.validate import size
from overnight.coordinator import agents
from overnight.coordinator.workspace import worktree as workspace
from overnight.coordinator.workspace.worktree import Base
from overnight.worker.sandbox import stepuser
from overnight.worker.sandbox.stepenv import DEFAULT_PATH, declared_problem
from overnight.worker.sandbox.stepuser import StepUser

TASK_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
ENVELOPE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_TEXT = 50_000
MAX_ARG = 10_000
MAX_ARGS = 256
MAX_ENV = 100
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def _check_argv(argv: list[str]) -> list[str]:
    if len(argv) > MAX_ARGS:
        raise ValueError(f"at most {MAX_ARGS} arguments")
    if not argv[0].strip():
        raise ValueError("the program name must not be empty")
    for arg in argv:
        if "\x00" in arg:
            raise ValueError("arguments must not contain NUL characters")
        if len(arg) > MAX_ARG:
            raise ValueError(f"each argument must be at most {MAX_ARG} characters")
    return argv


class Rule(BaseModel):
    """One verifier rule: it passes iff ``run`` exits 0."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str = Field(min_length=1, max_length=100)
    run: list[str] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not value.strip() or any(ch in value for ch in "\x00\n\r"):
            raise ValueError("must be non-blank text on one line")
        return value

    @field_validator("run")
    @classmethod
    def _run(cls, value: list[str]) -> list[str]:
        return _check_argv(value)


class TaskLimits(BaseModel):
    """``pids`` processes in a step's tree, ``memory`` bytes resident (``"2G"``),
    ``open_files`` and ``cpu`` seconds per process, ``disk`` bytes written (``"1G"``)."""

    model_config = ConfigDict(extra="forbid")

    pids: int | None = Field(None, ge=0, le=1_000_000)
    memory: int | None = Field(None, ge=0)
    open_files: int | None = Field(None, ge=0, le=1 << 20)
    cpu: int | None = Field(None, ge=0, le=30 * 86_400)
    disk: int | None = Field(None, ge=0)

    @field_validator("memory", "disk", mode="before")
    @classmethod
    def _size(cls, value: object) -> object:
        return None if value is None else size(value)


class TaskSpec(BaseModel):
    """A task exactly as the contract names its keys. ``workdir`` is absolute once loaded."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    id: str | None = None
    assignment: str = Field(min_length=1, max_length=MAX_TEXT)
    workdir: str = "."
    # A command (argv), or the name of a preset for a real agent CLI (coordinator.agents).
    agent: list[str] | str | None = Field(None, min_length=1)
    # The model name a preset's CLI asks for (default: the settings' model for its wire).
    model: str | None = Field(None, min_length=1, max_length=200)
    max_calls: int = Field(20, ge=1, le=1_000_000)
    # Tokens (input + output) the task's model requests may spend through the gateway.
    max_tokens: int | None = Field(None, ge=1, le=10**15)
    lease_seconds: float | None = Field(None, gt=0, le=7 * 86_400)
    heartbeat_gap: float | None = Field(None, gt=0, le=86_400)
    deadline: float = Field(21_600, gt=0, le=30 * 86_400)
    envelope: str = "default"
    on_unknown: Literal["pause", "retry"] = "pause"
    verifier: list[Rule] = Field(min_length=1, max_length=100)
    # Variables the agent and every rule get on top of the allowlist (worker.sandbox.stepenv).
    env: dict[str, str] = Field(default_factory=dict, max_length=MAX_ENV)
    # Where the task works (coordinator.workspace.worktree); unset: "worktree" in a git repository.
    workspace: Literal["worktree", "in-place"] | None = None
    # In a sandbox (OVERNIGHT_SANDBOX=bwrap), the agent's network: "none" reaches only its
    # gateway; "host" is the explicit opt-out (the host's network), said in its step's log.
    network: Literal["none", "host"] = "none"
    # Its steps' limits (processes, memory, open files, CPU, disk), else the settings'.
    limits: TaskLimits | None = None
    # Globs (relative to the repository root) put back from the base before every verifier run.
    protect: list[str] = Field(default_factory=list, max_length=MAX_ARGS)
    # Set at submit from the workdir (never from the file): the base the task works from.
    base: Base | None = None

    @field_validator("id")
    @classmethod
    def _id(cls, value: str | None) -> str | None:
        if value is not None and not TASK_ID_RE.match(value):
            raise ValueError(
                "must be 1-64 letters, digits, '_' or '-', starting with a letter or digit"
            )
        return value

    @field_validator("assignment")
    @classmethod
    def _assignment(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        if "\x00" in value:
            raise ValueError("must not contain NUL characters")
        return value

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("must not contain NUL characters")
        return value

    @field_validator("envelope")
    @classmethod
    def _envelope(cls, value: str) -> str:
        if not ENVELOPE_RE.match(value):
            raise ValueError("must be 1-64 letters, digits, '.', '_' or '-'")
        return value

    @field_validator("agent")
    @classmethod
    def _agent(cls, value: list[str] | str | None) -> list[str] | str | None:
        if isinstance(value, str):
            if value not in agents.names():
                known = ", ".join(repr(n) for n in agents.names())
                raise ValueError(f"{value!r} is not a preset (one of {known}), nor a command list")
            return value
        return None if value is None else _check_argv(value)

    @field_validator("model")
    @classmethod
    def _model(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or any(ord(c) < 32 for c in value)):
            raise ValueError("must be non-blank text on one line")
        return value

    def command(self) -> str:
        """What runs as the agent, in words: a preset's name, a command, or the model step."""
        if isinstance(self.agent, str):
            return self.agent
        return self.agent[0] if self.agent else "the built-in model step"

    @field_validator("verifier")
    @classmethod
    def _unique_rules(cls, value: list[Rule]) -> list[Rule]:
        names = [rule.name for rule in value]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"rule names must be unique (repeated: {', '.join(dupes)})")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if ENV_NAME_RE.match(name):
                problem = declared_problem(name)
            else:
                problem = "is not a variable name (letters, digits, '_')"
            if problem is not None:
                raise ValueError(f"{name!r} {problem}")
            if "\x00" in text or len(text) > MAX_ARG:
                raise ValueError(
                    f"{name!r}: the value must be at most {MAX_ARG} characters, no NUL"
                )
        return value

    @field_validator("protect")
    @classmethod
    def _protect(cls, value: list[str]) -> list[str]:
        for glob in value:
            problem = workspace.glob_problem(glob)
            if problem is not None:
                raise ValueError(problem)
        return value

    def step_deadline(self, default: float) -> float:
        return self.lease_seconds if self.lease_seconds is not None else default

    def step_gap(self, default: float) -> float:
        return self.heartbeat_gap if self.heartbeat_gap is not None else default


class TaskFileError(OvernightError):
    """One or more task files are invalid; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(file)"


def _problem_lines(label: str, exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        key = _loc(tuple(err["loc"]))
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        elif err["type"] == "missing":
            message = "required key is missing"
        else:
            message = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"{label}: {key}: {message}")
    return lines


def parse_text(text: str, *, json_format: bool) -> dict[str, Any]:
    """The raw mapping of a task file's text; raises ``ValueError`` with a short reason."""
    if json_format:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"not valid TOML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("the top level must be a table of keys")
    return data


def load(
    path: Path,
    state: Path | None = None,
    warn: Callable[[str], None] | None = None,
    known: Callable[[str], bool] | None = None,
) -> TaskSpec:
    """Load and validate one task file, and resolve its workspace (its base commit, or the
    snapshot of its protected files, kept under ``state``: default, overnight's state
    folder); raises :class:`TaskFileError`. ``warn`` gets the line about a repository's
    uncommitted changes. An id ``known`` says the namespace holds is not refused for its
    existing branch (``up`` and the coordinator skip known tasks, or resume them)."""
    label = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise TaskFileError([f"{label}: (file): cannot read: {reason}"]) from None
    try:
        data = parse_text(text, json_format=path.suffix.lower() == ".json")
    except ValueError as exc:
        raise TaskFileError([f"{label}: (file): {exc}"]) from None
    problems: list[str] = []
    workdir_text = data.get("workdir", ".")
    workdir = None
    if isinstance(workdir_text, str) and "\x00" not in workdir_text:
        try:
            workdir = (path.parent / workdir_text).resolve()
            if not workdir.is_dir():
                problems.append(f"{label}: workdir: no such directory: {workdir}")
        except OSError as exc:  # e.g. a name too long for the file system
            problems.append(f"{label}: workdir: unusable: {exc.strerror or exc}")
    if "base" in data:
        problems.append(f"{label}: base: unknown key")
    try:
        spec = TaskSpec.model_validate(data)
    except ValidationError as exc:
        problems[:0] = _problem_lines(label, exc)
    if problems:
        raise TaskFileError(problems)
    assert workdir is not None
    state = state or workspace.state_dir()
    argvs = [rule.run for rule in spec.verifier]
    got = workspace.resolve(workdir, spec.workspace, spec.protect, argvs, state)
    if got.problems:
        raise TaskFileError([f"{label}: {key}: {text}" for key, text in got.problems])
    assert got.base is not None
    if spec.id and got.base.mode == workspace.WORKTREE and not (known and known(spec.id)):
        branch = workspace.branch_name(spec.id)
        if workspace.branch_exists(got.base.root, branch):
            why = (
                f"branch {branch} already exists in {got.base.root} (an earlier run of this "
                f"task): `overnight rerun {spec.id}` runs it again on that branch (add "
                f"--from-base to start over), or delete the branch to submit the file afresh"
            )
            raise TaskFileError([f"{label}: id: {why}"])
    update = {"workdir": str(workdir), "workspace": got.base.mode, "base": got.base}
    loaded = spec.model_copy(update=update)
    missing = command_problems(loaded, os.environ.get("PATH", ""), _step_user())
    if missing:
        raise TaskFileError([f"{label}: {key}: {text}" for key, text in missing])
    if got.warning and warn is not None:
        warn(f"{label}: warning: {got.warning}")
    preset = agents.get(loaded.agent) if isinstance(loaded.agent, str) else None
    if preset is not None and warn is not None and shutil.which(preset.program) is None:
        warn(
            f"{label}: warning: agent: the {preset.name} preset needs {preset.program!r} on "
            f"PATH, which it is not here (install: {preset.install}); a worker without it ends "
            "the task agent_failed"
        )
    return loaded


def _lookup_path(path: str, cwd: str) -> str:
    """``path`` with its relative entries made absolute from ``cwd``, as a step started
    there resolves them."""
    return os.pathsep.join(
        e if os.path.isabs(e) else os.path.join(cwd, e) for e in path.split(os.pathsep) if e
    )


def _step_user() -> StepUser | None:
    """Who the steps run as, by this process's settings (None: as this user, or a setting
    that cannot be honoured, which the worker reports itself)."""
    try:
        return stepuser.configured()
    except Exception:
        return None


def _which_as(cmd: str, path: str, user: StepUser | None) -> tuple[str | None, str | None]:
    """Where ``cmd`` is found on ``path`` as ``user`` runs it (as execvp does, an entry the
    user cannot use is passed over), and why the first one passed over could not be used."""
    passed = None
    for entry in path.split(os.pathsep):
        found = os.path.join(entry or ".", cmd)
        if not (os.path.isfile(found) and os.access(found, os.X_OK)):
            continue
        problem = stepuser.run_problem(found, user) if user is not None else None
        if problem is None:
            return found, None
        passed = passed or f"{found} is found but {problem}"
    return None, passed


def command_problems(
    spec: TaskSpec, worker_path: str, user: StepUser | None = None
) -> list[tuple[str, str]]:
    """The agent and rule commands of a loaded ``spec`` that cannot be found as its steps
    will look them up (the agent on the task's PATH or ``worker_path``, from its workdir, and
    run as ``user`` when one is set; a rule on ``worker_path`` without relative entries), as
    (key, problem) pairs. A command in the workdir must be in the commit a worktree checks
    out."""
    out: list[tuple[str, str]] = []
    base = spec.base
    if isinstance(spec.agent, list):
        cmd = spec.agent[0]
        path = _lookup_path(spec.env.get("PATH") or worker_path or DEFAULT_PATH, spec.workdir)
        found, problem = _which_as(cmd, path, user) if "/" not in cmd else (None, None)
        if "/" not in cmd and found is None:
            where = f"where {problem}" if problem else f"on PATH ({path})"
            out.append(("agent", f"command {cmd!r} not found {where}"))
        elif "/" in cmd and not os.path.isabs(cmd):
            if base is not None and base.mode == workspace.WORKTREE and base.sha is not None:
                rel = os.path.normpath(os.path.join(base.subdir, cmd)).replace(os.sep, "/")
                absent = workspace.not_in_commit(base.root, base.sha, rel)
                if absent is not None:
                    out.append(("agent", absent))
            elif not os.path.exists(os.path.join(spec.workdir, cmd)):
                out.append(("agent", f"command {cmd!r} does not exist in {spec.workdir}"))
    rule_path = workspace.clean_path(worker_path, []) or "/usr/bin:/bin"
    for i, rule in enumerate(spec.verifier):
        cmd = rule.run[0]
        if "/" not in cmd and shutil.which(cmd, path=rule_path) is None:
            out.append((f"verifier[{i}].run", f"rule {rule.name}: command {cmd!r} not found"))
    return out


def load_all(
    paths: list[Path],
    warn: Callable[[str], None] | None = None,
    known: Callable[[str], bool] | None = None,
) -> list[TaskSpec]:
    """Validate every file before returning any; duplicate ids within the batch are refused."""
    problems: list[str] = []
    specs: list[tuple[Path, TaskSpec]] = []
    for path in paths:
        try:
            specs.append((path, load(path, warn=warn, known=known)))
        except TaskFileError as exc:
            problems.extend(exc.problems)
    seen: dict[str, Path] = {}
    for path, spec in specs:
        if spec.id is None:
            continue
        if spec.id in seen:
            problems.append(f"{path}: id: {spec.id!r} is also the id of {seen[spec.id]}")
        seen.setdefault(spec.id, path)
    if problems:
        raise TaskFileError(problems)
    return [spec for _path, spec in specs]
