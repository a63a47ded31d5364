"""OpenAI Codex CLI (npm ``@openai/codex``) run headless: ``codex exec --json`` prints one
JSON event a line and ends a turn with ``turn.completed`` or ``turn.failed``.

It speaks the Responses API only (``POST {base_url}/responses``, streamed) through a
custom provider written into ``$HOME/.codex/config.toml`` (Codex's default ``CODEX_HOME``):
``base_url`` the host gateway's, ``env_key = "OPENAI_API_KEY"`` (the step's per-lease
token) and ``supports_websockets = false``, so it never asks for an upgrade.
Its shell tool is ``exec_command`` ``{"cmd": "..."}``.

Off, so the step's only traffic is the task's own model requests (each checked with an
HTTPS proxy trap in tests/test_agent_codex.py): plugins (``git ls-remote`` of
github.com/openai/plugins, api.github.com), apps (chatgpt.com), analytics, feedback,
OpenTelemetry, update checks and the hosted web search tool. ``--strict-config`` makes a
renamed key an error instead of a silent return of that traffic.
"""

from __future__ import annotations

import json
from typing import Any

from overnight.coordinator.agents import (
    Context,
    JsonLinesReader,
    Launch,
    Preset,
    Said,
    one_line,
    register,
)

VERSION = "0.171.0"
PROVIDER = "overnight"
# Past this a prompt goes by file: one argv string may not exceed 128 KiB on Linux.
ARGV_PROMPT_CHARS = 100_000

CONFIG = """\
# Written by overnight's codex preset into this step's scratch HOME.
model = {model}
model_provider = "{provider}"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false
web_search = "disabled"

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
trace_exporter = "none"
metrics_exporter = "none"

[features]
plugins = false
remote_plugin = false
plugin_sharing = false
apps = false
tool_suggest = false
# A gateway that is gone fails the turn instead of being retried for ever.
unbounded_connection_retries = false

[model_providers.{provider}]
name = "overnight gateway"
base_url = {base_url}
env_key = "OPENAI_API_KEY"
wire_api = "responses"
supports_websockets = false
# Every retry is a real request the task pays for; the loop re-prompts a failed turn.
request_max_retries = 1
stream_max_retries = 1
"""


def config_toml(model: str, base_url: str) -> str:
    # A JSON string is a valid TOML basic string.
    return CONFIG.format(model=json.dumps(model), provider=PROVIDER, base_url=json.dumps(base_url))


def prompt_arg(ctx: Context) -> str:
    """The prompt itself, or for a very long one a pointer to the file that holds it."""
    if len(ctx.prompt) <= ARGV_PROMPT_CHARS:
        return ctx.prompt
    return f"Your assignment is in the file {ctx.prompt_file}. Read it whole, then do it."


def launch(ctx: Context) -> Launch:
    argv = [
        "codex",
        "exec",
        "--json",
        "--strict-config",
        "--ephemeral",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        "--color",
        "never",
        "-C",
        ctx.workdir,
        "--",
        prompt_arg(ctx),
    ]
    base_url = ctx.gateway_url.rstrip("/") + "/v1"
    return Launch(argv=argv, home_files={".codex/config.toml": config_toml(ctx.model, base_url)})


class CodexReader(JsonLinesReader):
    """The last turn's end: ``turn.completed`` is a step the CLI calls done (its last
    agent message the summary), ``turn.failed`` is not (its error). A top-level ``error``
    with no turn end after it (the CLI stopped mid-turn) is a failure too. Codex's exit
    status is not read: it says nothing about the task."""

    def __init__(self) -> None:
        self.ended: dict[str, Any] | None = None
        self.error: str | None = None
        self.message: str | None = None
        self.commands = 0

    def take(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        if kind == "turn.started":
            self.ended, self.error, self.message = None, None, None
        elif kind in ("turn.completed", "turn.failed"):
            self.ended = obj
        elif kind == "error":
            self.error = str(obj.get("message") or "error")
        elif kind == "item.completed" and isinstance(obj.get("item"), dict):
            item = obj["item"]
            if item.get("type") == "agent_message":
                self.message = str(item.get("text") or "")
            elif item.get("type") == "command_execution":
                self.commands += 1

    def said(self) -> Said | None:
        if self.ended is None:
            return None if self.error is None else Said(False, one_line(self.error))
        if self.ended.get("type") == "turn.failed":
            err = self.ended.get("error")
            why = err.get("message") if isinstance(err, dict) else None
            return Said(False, one_line(why or self.error or "turn failed"))
        ran = f" ({self.commands} command{'s' if self.commands != 1 else ''})"
        return Said(True, one_line((self.message or "turn completed") + ran))


PRESET = register(
    Preset(
        name="codex",
        program="codex",
        wire="openai",
        install=f"npm install -g @openai/codex@{VERSION} (.ci/agents/codex.sh)",
        launch=launch,
        reader=CodexReader,
    )
)
