"""The codex preset: OpenAI Codex CLI run as a task's agent, through this host's gateway, against
the scripted upstream. Every request it sends is one model unit; it speaks plain HTTP POSTs to
its provider only (no WebSocket, nothing to chatgpt.com or GitHub); a turn it ends early is
re-prompted; a 30 s model wait with a 5 s gap does not kill it. The reader's account of a
turn is a table."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from overnight.coordinator.agents import Context, Said
from overnight.coordinator.agents import codex as preset
from tests.agent_tasks import (
    FIX,
    OFF_LIST,
    Bench,
    Scripted,
    Trap,
    completions,
    home,
    prompt_text,
    repo,
    run_direct,
    run_until_trapped,
)
from tests.helpers import ROOT, capability, seen

needs_codex = capability(None if shutil.which("codex") else "codex is not installed")


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


MSG = {
    "type": "item.completed",
    "item": {"id": "item_1", "type": "agent_message", "text": "Fixed\nit."},
}
CMD = {
    "type": "item.completed",
    "item": {"id": "item_2", "type": "command_execution", "command": "x", "exit_code": 0},
}
WARN = {
    "type": "item.completed",
    "item": {"id": "item_0", "type": "error", "message": "Model metadata not found."},
}
DONE = {"type": "turn.completed", "usage": {"input_tokens": 1, "output_tokens": 1}}
FAILED = {"type": "turn.failed", "error": {"message": "429 envelope default is empty"}}
ERROR = {"type": "error", "message": "Connection failed"}
START = {"type": "turn.started"}


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        ([], None),
        ([b"WARNING: proceeding", b"Reading additional input from stdin..."], None),
        ([START, WARN, MSG, CMD, DONE], Said(True, "Fixed it. (1 command)")),
        ([START, DONE], Said(True, "turn completed (0 commands)")),
        ([START, ERROR, FAILED], Said(False, "429 envelope default is empty")),
        ([START, ERROR, {"type": "turn.failed"}], Said(False, "Connection failed")),
        ([START, MSG, ERROR], Said(False, "Connection failed")),  # stopped mid-turn
        ([START, MSG], None),  # killed mid-turn: the supervisor says why
        ([START, ERROR, DONE], Said(True, "turn completed (0 commands)")),  # a retry worked
        ([b"{not json", START, MSG, DONE], Said(True, "Fixed it. (0 commands)")),
    ],
)
def test_the_reader_takes_the_turns_end(lines: list[Any], said: Said | None) -> None:
    reader = preset.CodexReader()
    for line in lines:
        reader(line if isinstance(line, bytes) else _line(line))
    assert reader.said() == said


def test_launch_is_headless_and_points_at_the_gateway() -> None:
    ctx = Context("fix it", "/p/prompt.txt", 'gpt "x"', "/w", 1, "http://127.0.0.1:4680/")
    launch = preset.launch(ctx)
    assert launch.argv[:2] == ["codex", "exec"] and launch.argv[-2:] == ["--", "fix it"]
    for flag in ("--json", "--strict-config", "--dangerously-bypass-approvals-and-sandbox"):
        assert flag in launch.argv
    assert launch.env == {}
    config = launch.home_files[".codex/config.toml"]
    assert 'model = "gpt \\"x\\""' in config
    assert "supports_websockets = false" in config and 'env_key = "OPENAI_API_KEY"' in config
    assert 'base_url = "http://127.0.0.1:4680/v1"' in config
    long = preset.launch(Context("x" * 200_000, "/p/prompt.txt", "m", "/w", 1))
    assert long.argv[-1].startswith("Your assignment is in the file /p/prompt.txt.")


def test_the_install_script_pins_the_version_the_preset_names() -> None:
    script = (ROOT / ".ci" / "agents" / "codex.sh").read_text()
    assert f"version={preset.VERSION}\n" in script
    assert preset.VERSION in preset.PRESET.install


# --- end to end -------------------------------------------------------------------------


@needs_codex
@pytest.mark.slow
def test_codex_posts_to_its_provider_only(scripted: Scripted, trap: Trap, tmp_path: Path) -> None:
    """Straight at the upstream (no gateway to turn an upgrade away): every request Codex
    sends is a streamed POST /v1/responses with the step's key, and nothing goes anywhere
    else, though every proxy variable points at a trap."""
    upstream = scripted([{"text": "Fixing.", "shell": FIX}, {"text": "Fixed."}])
    work = repo(tmp_path / "w")
    launch = preset.launch(
        Context("Fix file.txt", str(tmp_path / "p.txt"), "scripted", str(work), 1, upstream)
    )
    env = {"HOME": str(home(tmp_path, launch)), **trap.env(), "OPENAI_API_KEY": "tok-1"}
    reader = preset.CodexReader()
    done = run_direct(launch, work, env, reader)
    assert reader.said() == Said(True, "Fixed. (1 command)"), done.stdout + done.stderr
    assert (work / "file.txt").read_text() == "fixed\n"
    everything = seen(upstream)
    assert [(s["method"], s["path"]) for s in everything] == [("POST", "/v1/responses")] * 2
    for s in everything:
        headers = {k.lower(): v for k, v in s["headers"].items()}
        assert "upgrade" not in headers and headers["authorization"] == "Bearer tok-1"
        assert s["body"]["stream"] is True and s["body"]["model"] == "scripted"
    assert trap.seen == []
    # Its shell tool, as the scripted upstream shaped the call.
    tools = {t.get("name"): t for t in everything[0]["body"]["tools"]}
    assert "cmd" in tools["exec_command"]["parameters"]["properties"]


@needs_codex
@pytest.mark.slow
@pytest.mark.timeout(150)  # a CLI's start-up on a loaded machine
def test_codex_honours_the_proxy_variables(trap: Trap, tmp_path: Path) -> None:
    """The control of the trap above: with its provider at an address NO_PROXY does not list,
    Codex's request goes through the trap."""
    work = repo(tmp_path / "w")
    launch = preset.launch(
        Context("Fix file.txt", str(tmp_path / "p.txt"), "scripted", str(work), 1, OFF_LIST)
    )
    env = {"HOME": str(home(tmp_path, launch)), **trap.env(), "OPENAI_API_KEY": "tok-1"}
    seen_by_trap = run_until_trapped(launch, work, env, trap)
    assert any(OFF_LIST.split("//")[1] in line for line in seen_by_trap), seen_by_trap


@needs_codex
@pytest.mark.slow
def test_a_fix_by_codex_is_verified_and_every_request_charged(bench: Bench) -> None:
    upstream = bench.scripted([{"text": "Fixing.", "shell": FIX}, {"text": "Fixed file.txt."}])
    done = bench.run(upstream, "codex-fix", agent="codex")
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    sent = completions(upstream)
    assert len(sent) == 2 == bench.charged("codex-fix")
    # calls_used: each request, the one tool call the model asked for, one rule run.
    assert done["calls_used"] == len(sent) + 1 + 1
    assert bench.trap.seen == []


@needs_codex
@pytest.mark.slow
def test_a_premature_stop_is_reprompted_with_the_unmet_rule(bench: Bench) -> None:
    upstream = bench.scripted(
        [
            {"text": "Shall I continue?"},
            {"text": "Fixing.", "shell": FIX},
            {"text": "Fixed file.txt."},
        ]
    )
    done = bench.run(upstream, "codex-early", agent="codex")
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert done["turns"] == 2, done
    sent = completions(upstream)
    assert len(sent) == 3 == bench.charged("codex-early")
    assert done["calls_used"] == len(sent) + 1 + 2  # one tool call, two rule runs
    assert "says-fixed" not in prompt_text(sent[0])
    assert "says-fixed" in prompt_text(sent[1]) and "sh check.sh" in prompt_text(sent[1])


@needs_codex
@pytest.mark.slow
def test_a_30s_model_wait_does_not_kill_the_step(bench: Bench) -> None:
    upstream = bench.scripted(
        [{"text": "Fixing.", "shell": FIX, "delay": 30}, {"text": "Fixed file.txt."}]
    )
    done = bench.run(upstream, "codex-slow", agent="codex", heartbeat_gap=5)
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert done["turns"] == 1, done
    assert len(completions(upstream)) == 2 == bench.charged("codex-slow")
