"""A task as submitted: :class:`TaskSpec` (its assignment, agent, verifier rules, limits
and workspace), validated field by field with a message that names the key."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from overnight.config.validate import size
from overnight.coordinator import agents
from overnight.coordinator.workspace import worktree as workspace
from overnight.coordinator.workspace.worktree import Base
from overnight.worker.sandbox.proxy import parse_rule
from overnight.worker.sandbox.stepenv import declared_problem

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
    # Hosts ("host", "host:port", "*.domain") the agent reaches through overnight's proxy.
    allow_hosts: list[str] = Field(default_factory=list, max_length=MAX_ARGS)
    # Its steps' limits (processes, memory, open files, CPU, disk), else the settings'.
    limits: TaskLimits | None = None
    # Globs (relative to the repository root) put back from the base before every verifier run.
    protect: list[str] = Field(default_factory=list, max_length=MAX_ARGS)
    # A git remote the task works from instead of a workdir (coordinator.workspace.remote):
    # its ``ref`` (default: the remote's HEAD) is the base; after every turn the task's
    # branch is pushed to ``push_to`` (default: ``repo``).
    repo: str | None = None
    ref: str | None = None
    push_to: str | None = None
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

    @field_validator("repo", "push_to")
    @classmethod
    def _remote(cls, value: str | None) -> str | None:
        problem = None if value is None else workspace.url_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("ref")
    @classmethod
    def _ref(cls, value: str | None) -> str | None:
        problem = None if value is None else workspace.ref_problem(value)
        if problem is not None:
            raise ValueError(problem)
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

    @field_validator("allow_hosts")
    @classmethod
    def _allow_hosts(cls, value: list[str]) -> list[str]:
        for text in value:
            parse_rule(text)  # its ValueError names the entry
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
