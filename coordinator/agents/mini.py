"""mini-swe-agent (PyPI ``mini-swe-agent``, CLI ``mini``) run headless.

mini asks the model through litellm: ``POST {OPENAI_BASE_URL}/chat/completions``, never
streamed, with one tool, ``bash`` ``{"command": "..."}``; a model name ``openai/<name>``
sends ``<name>``. ``--yolo`` runs every command unasked, ``--exit-immediately`` ends the
run when the model submits (``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``) instead of
asking for a new task, ``--cost-limit 0`` leaves the budget to overnight. A reply with no
tool call is a format error that mini sends back to the model; three in a row end the run
(``RepeatedFormatError``, exit status 0).

Off a terminal mini prints nothing while it loads (litellm's import: 3.7-5.2 s at load 1.7
here, 7-11 s on a busy host) or waits on the model, so a 5 s ``heartbeat_gap`` killed it
before its first request. The step's argv is mini itself; a start-up hook (:data:`HOOK`,
written into the scratch HOME) runs inside mini's Python, named by ``OVERNIGHT_MINI_HOOK``
and run by the one-line ``overnight_mini_hook.pth`` that ``.ci/agents/mini-swe-agent.sh``
puts in mini's venv (the way coverage.py measures subprocesses). It prints a line a second
until mini's imports are done; from there a request in flight beats through the gateway
and mini prints every message. At exit it prints the trajectory's outcome (``exit_status``:
``Submitted``, ``LimitsExceeded``, ``RepeatedFormatError`` or an exception's name) as one
JSON line for :class:`MiniReader`; the trajectory itself dies with the scratch HOME. A
``mini`` installed without that line runs the same, silent while it loads and with no
outcome line. A command mini runs is silent up to its own 30 s timeout: give a mini task
a ``heartbeat_gap`` above that.

Environment: ``MSWEA_CONFIGURED`` skips the first-run wizard, ``MSWEA_COST_TRACKING``
keeps a model litellm has no price for from failing the run, ``LITELLM_OFFLINE_MODE`` uses
litellm's bundled cost map and tokenizers instead of fetching them, ``LITELLM_MODE``
keeps litellm from loading a ``.env`` file.
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

VERSION = "2.4.6"
KEY = "overnight_mini_swe_agent"  # the hook's outcome line: {KEY: {...}}
HOOK_PATH = ".overnight/mini_hook.py"  # in the scratch HOME
ENV = {
    "MSWEA_CONFIGURED": "true",
    "MSWEA_COST_TRACKING": "ignore_errors",
    "LITELLM_OFFLINE_MODE": "true",
    "LITELLM_MODE": "PRODUCTION",
    "OVERNIGHT_MINI_HOOK": f"~/{HOOK_PATH}",
}
# The line .ci/agents/mini-swe-agent.sh writes into mini's venv as overnight_mini_hook.pth:
# Python runs a .pth line that starts with "import" at start-up. It takes the variable out
# of the environment, so the commands mini runs never see it.
PTH_LINE = (
    'import os; p = os.path.expanduser(os.environ.pop("OVERNIGHT_MINI_HOOK", "")); '
    'p and exec(compile(open(p).read(), p, "exec"), {"__name__": "overnight_mini_hook"})'
)

HOOK = r'''"""overnight's start-up hook for mini-swe-agent, run inside mini's Python before mini.

It prints a line a second until mini's imports are done (litellm loads for seconds without
a word), and at exit the outcome of mini's trajectory as one JSON line.
"""
import atexit
import json
import os
import sys
import threading
import time

KEY = "overnight_mini_swe_agent"
# Defined once litellm is imported, the last of mini's slow imports.
LOADED = ("minisweagent.models.litellm_model", "LitellmModel")
LIMIT = 120.0  # seconds: never says it is loading longer than this


def say(text):
    print(f"overnight: mini-swe-agent {text}", flush=True)


def loaded():
    return hasattr(sys.modules.get(LOADED[0]), LOADED[1])


def loading():
    start = time.monotonic()
    say("is loading (silent for seconds otherwise; a line a second)")
    next_line = start + 1.0
    while time.monotonic() - start < LIMIT:
        if loaded():
            say(f"loaded in {time.monotonic() - start:.1f} s")
            litellm = sys.modules.get("litellm")
            if litellm is not None:
                litellm.suppress_debug_info = True
            return
        if time.monotonic() >= next_line:
            say(f"still loading, {time.monotonic() - start:.0f} s")
            next_line += 1.0
        time.sleep(0.05)


def outcome(path):
    said = {"exit_status": None}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        info = data["info"]
        last = (data.get("messages") or [{}])[-1].get("extra") or {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return said
    stats = info.get("model_stats") or {}
    said.update(exit_status=info.get("exit_status") or None, api_calls=stats.get("api_calls"),
                cost=stats.get("instance_cost"),
                submission=str(info.get("submission") or "")[:300],
                exception=str(last.get("exception_str") or "")[:300])
    return said


def trajectory():
    run = sys.modules.get("minisweagent.run.mini")
    path = getattr(run, "DEFAULT_OUTPUT_FILE", None)
    return str(path) if path is not None else os.path.expanduser(
        "~/.config/mini-swe-agent/last_mini_run.traj.json")


def at_exit():
    print(json.dumps({KEY: outcome(trajectory())}), flush=True)


if __name__ == "overnight_mini_hook":
    threading.Thread(target=loading, name="overnight-loading", daemon=True).start()
    atexit.register(at_exit)
'''


def model_arg(model: str) -> str:
    """litellm's name for ``model`` behind an OpenAI-compatible base URL: it strips the
    ``openai/`` it routes by, so the gateway is asked for ``model`` exactly."""
    return f"openai/{model}"


def launch(ctx: Context) -> Launch:
    # ctx.prompt fits one argv string (the loop clips it and names the file past that).
    argv = [
        "mini",
        "--yolo",
        "--exit-immediately",
        "--cost-limit",
        "0",
        "--model",
        model_arg(ctx.model),
        "--task",
        ctx.prompt,
    ]
    return Launch(argv=argv, env=dict(ENV), home_files={HOOK_PATH: HOOK})


class MiniReader(JsonLinesReader):
    """The hook's last outcome line: ``Submitted`` is a run mini calls done; any other
    exit status (a limit, repeated format errors, an exception) or none is not."""

    def __init__(self) -> None:
        self.outcome: dict[str, Any] | None = None

    def take(self, obj: dict[str, Any]) -> None:
        found = obj.get(KEY)
        if isinstance(found, dict):
            self.outcome = found

    def said(self) -> Said | None:
        if self.outcome is None:
            return None
        return said_of(self.outcome)


def said_of(outcome: dict[str, Any]) -> Said:
    """What one outcome line says (a pure rule; see the module's docstring)."""
    status = outcome.get("exit_status")
    calls = outcome.get("api_calls")
    counted = f" after {calls} model call{'s' if calls != 1 else ''}" if calls is not None else ""
    if not status:
        return Said(False, "mini-swe-agent wrote no trajectory")
    if status == "Submitted":
        return Said(True, one_line(f"Submitted{counted}"))
    detail = outcome.get("exception") or ""
    return Said(False, one_line(f"{status}{counted}" + (f": {detail}" if detail else "")))


PRESET = register(
    Preset(
        name="mini-swe-agent",
        program="mini",
        wire="openai",
        install=f"pip install mini-swe-agent=={VERSION} in a venv of its own "
        "(.ci/agents/mini-swe-agent.sh)",
        launch=launch,
        reader=MiniReader,
        version_args=("--help",),
    )
)
