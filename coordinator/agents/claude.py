"""Claude Code (npm ``@anthropic-ai/claude-code``) run headless: ``claude -p`` streams JSON
lines and ends with a ``result`` object, the CLI's own account of the step.

It speaks Anthropic Messages (``POST /v1/messages?beta=true``, streamed) to
``ANTHROPIC_BASE_URL`` with ``ANTHROPIC_AUTH_TOKEN`` as a bearer token, both from the step's
environment; its shell tool is ``Bash`` ``{"command": ...}``. ``-p`` skips the onboarding
and the workspace-trust dialog, so the scratch HOME needs no file.
"""

from __future__ import annotations

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

VERSION = "2.1.332"  # what .ci/agents/claude.sh installs

ENV = {
    # Telemetry, error reports, feature flags, update checks and side requests (titles,
    # suggestions) off: the step's only traffic is the task's own model requests.
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
    # The step is a deliberate sandbox (its own user, cgroup and scratch HOME); without
    # this Claude Code refuses to skip permissions when the step runs as root.
    "IS_SANDBOX": "1",
}

# Claude Code picks other models by alias for subagents and small jobs; every request asks
# for the task's model instead, so what the task names is what the gateway sees.
MODEL_VARS = (
    "ANTHROPIC_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "ANTHROPIC_SMALL_FAST_MODEL",
    "CLAUDE_CODE_SUBAGENT_MODEL",
)


def launch(ctx: Context) -> Launch:
    # The loop keeps the prompt within one argv string (a longer one names its file); "--"
    # lets a prompt start with a dash.
    argv = [
        "claude",
        "-p",
        "--output-format",
        "stream-json",
        "--verbose",
        "--dangerously-skip-permissions",
        "--no-session-persistence",
        "--model",
        ctx.model,
        "--",
        ctx.prompt,
    ]
    env = {**ENV, **dict.fromkeys(MODEL_VARS, ctx.model)}
    return Launch(argv=argv, env=env)


class ClaudeReader(JsonLinesReader):
    """Keeps the last ``{"type": "result"}`` line: ``subtype`` ``success`` and ``is_error``
    false is a step the CLI calls done; anything else (``error_max_turns``,
    ``error_during_execution``, an API error it gave up on) is not."""

    def __init__(self) -> None:
        self.result: dict[str, Any] | None = None

    def take(self, obj: dict[str, Any]) -> None:
        if obj.get("type") == "result":
            self.result = obj

    def said(self) -> Said | None:
        if self.result is None:
            return None
        res = self.result
        subtype = str(res.get("subtype") or "")
        ok = subtype == "success" and res.get("is_error") is not True
        text = res.get("result")
        if ok:
            return Said(True, one_line(text or "done"))
        # An API error it gave up on says subtype "success", is_error true and the error text.
        why = text or res.get("errors") or res.get("terminal_reason") or "no result"
        return Said(False, one_line(why if subtype == "success" else f"{subtype}: {why}"))


PRESET = register(
    Preset(
        name="claude",
        program="claude",
        wire="anthropic",
        install=f"npm install -g @anthropic-ai/claude-code@{VERSION} (.ci/agents/claude.sh)",
        launch=launch,
        reader=ClaudeReader,
    )
)
