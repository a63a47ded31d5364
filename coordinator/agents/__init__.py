"""Agent presets: ``agent = "codex"`` in a task file runs a real agent CLI headless,
pointed at the host's gateway, with its outcome read from the CLI's own structured output.

A preset is data plus two small functions: :meth:`Preset.launch` (pure: the argv, the
variables and the scratch-HOME files of one step) and a :class:`Reader` fed every line the
step prints, whose :meth:`Reader.said` is the CLI's own account of how the step went. The
step still runs under a lease like any other; its credentials are the gateway's per-lease
token (``OPENAI_API_KEY`` / ``ANTHROPIC_AUTH_TOKEN``), never a real key.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Wire = Literal["openai", "anthropic"]
# Longest one-line summary a reader keeps of what the CLI said.
SUMMARY_CHARS = 300


@dataclass(frozen=True)
class Context:
    """What a preset needs to launch one step."""

    prompt: str  # this turn's whole prompt (assignment, unmet rules, evidence)
    prompt_file: str  # the same text in a file the step can read
    model: str  # the model name the CLI asks the gateway for
    workdir: str  # where the step runs (the task's worktree)
    turn: int
    gateway_url: str = ""  # the host gateway's root URL (OpenAI-style base: + "/v1")


@dataclass(frozen=True)
class Launch:
    """One step of a preset: its command, what it adds to the step's environment and the
    files written into its scratch HOME (relative paths) before it starts."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    home_files: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Said:
    """The CLI's own account of a step: ``ok`` False when it reports a failure although
    it may have exited 0 (Codex exits 0 after a failed turn)."""

    ok: bool
    summary: str


class Reader:
    """Fed each line the step prints; :meth:`said` is what the CLI reported (None: its
    output said nothing structured). This base reads nothing."""

    def __call__(self, line: bytes) -> None:
        return None

    def said(self) -> Said | None:
        return None


class JsonLinesReader(Reader):
    """For CLIs printing JSON objects one per line: :meth:`take` sees each object; other
    lines are ignored. Lines are parsed only while they may be JSON (cheap for prose)."""

    def __call__(self, line: bytes) -> None:
        text = line.strip()
        if not text.startswith(b"{"):
            return
        try:
            obj = json.loads(text)
        except ValueError:
            return
        if isinstance(obj, dict):
            self.take(obj)

    def take(self, obj: dict[str, Any]) -> None:
        raise NotImplementedError


def one_line(text: object, limit: int = SUMMARY_CHARS) -> str:
    """``text`` on one line, at most ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


@dataclass(frozen=True)
class Preset:
    """A real agent CLI run headless against the gateway."""

    name: str  # what a task file's ``agent`` says
    program: str  # the executable, looked up on the step's PATH
    wire: Wire  # which of the gateway's formats it speaks (picks the default model)
    install: str  # one line: how to install it
    launch: Callable[[Context], Launch]
    reader: Callable[[], Reader] = Reader
    version_args: tuple[str, ...] = ("--version",)


PRESETS: dict[str, Preset] = {}
# Each preset's module, imported on first use (not with the loop) and registering itself.
MODULES = {"aider": "aider", "claude": "claude", "codex": "codex", "mini-swe-agent": "mini"}


def register(preset: Preset) -> Preset:
    PRESETS[preset.name] = preset
    return preset


def names() -> list[str]:
    return sorted(MODULES)


def get(name: str) -> Preset | None:
    """The preset ``name`` (None: there is none)."""
    module = MODULES.get(name)
    if module is None:
        return None
    if name not in PRESETS:
        importlib.import_module(f"overnight.coordinator.agents.{module}")
    return PRESETS[name]


@dataclass(frozen=True)
class Installed:
    """Whether a preset's CLI is on ``PATH``, where, and the version it prints."""

    name: str
    program: str
    path: str | None
    version: str | None
    install: str
    wire: Wire

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "program": self.program,
            "installed": self.path is not None,
            "path": self.path,
            "version": self.version,
            "wire": self.wire,
            "install": self.install,
        }


def installed(
    preset: Preset, env: Mapping[str, str] | None = None, timeout: float = 20.0
) -> Installed:
    """Look ``preset``'s CLI up on ``PATH`` and ask it its version (bounded in time)."""
    path_var = (env if env is not None else os.environ).get("PATH", os.defpath)
    path = shutil.which(preset.program, path=path_var)
    version = None
    if path is not None:
        # A throwaway HOME: some CLIs write their config folders on any start.
        with tempfile.TemporaryDirectory(prefix="overnight-agents-") as home:
            try:
                env = {**os.environ, "NO_COLOR": "1", "HOME": home}
                done = subprocess.run(
                    [path, *preset.version_args],
                    capture_output=True,
                    stdin=subprocess.DEVNULL,
                    timeout=timeout,
                    check=False,
                    env=env,
                )
                text = (done.stdout or done.stderr).decode("utf-8", "replace").strip()
                version = one_line(text.splitlines()[0] if text else "", 80) or None
            except (OSError, subprocess.TimeoutExpired):
                version = None
    return Installed(preset.name, preset.program, path, version, preset.install, preset.wire)
