"""The claude preset: Claude Code run as a task's agent, through this host's gateway, against
the scripted upstream. It sends streamed POST /v1/messages only (nothing anywhere else, no side
request for a title), every request is one model unit, its Bash tool makes the fix, and a turn
it ends early is re-prompted. It runs as root here (the suite's default) by IS_SANDBOX=1, which
the preset sets: Claude Code refuses to skip permissions as root without it. The reader's
account of a step is a table."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from overnight.coordinator.agents import Context, Said
from overnight.coordinator.agents import claude as preset
from overnight.worker.sandbox.stepuser import StepUser
from tests.agent_tasks import (
    FIX,
    OFF_LIST,
    PATH,
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

needs_claude = capability(
    None if shutil.which("claude") else "claude (Claude Code) is not installed"
)
# A task with claude as its agent; the gateway's Anthropic route goes to the upstream.
CLAUDE: dict[str, Any] = {
    "agent": "claude",
    "model": "claude-scripted",
    "url_var": "OVERNIGHT_ANTHROPIC_URL",
}


def _result(**kw: Any) -> bytes:
    return json.dumps({"type": "result", **kw}).encode() + b"\n"


INIT = json.dumps({"type": "system", "subtype": "init", "tools": ["Bash"]}).encode()
OK = _result(subtype="success", is_error=False, result="Fixed\nfile.txt.", num_turns=2)
API = _result(subtype="success", is_error=True, api_error_status=500, result="API Error: 500 boom.")
TURNS = _result(subtype="error_max_turns", is_error=True, num_turns=9, terminal_reason="max_turns")
EXEC = _result(subtype="error_during_execution", is_error=True, errors=["boom"])


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        ([], None),
        ([b"[claude-code:unrecognized_model] {}", INIT], None),  # killed before its result
        ([INIT, OK], Said(True, "Fixed file.txt.")),
        ([INIT, _result(subtype="success", is_error=False, result="")], Said(True, "done")),
        ([INIT, API], Said(False, "API Error: 500 boom.")),  # it gave up on the API
        ([INIT, TURNS], Said(False, "error_max_turns: max_turns")),
        ([INIT, EXEC], Said(False, "error_during_execution: ['boom']")),
        ([b"{not json", INIT, API, OK], Said(True, "Fixed file.txt.")),  # the last result
    ],
)
def test_the_reader_takes_the_result_line(lines: list[bytes], said: Said | None) -> None:
    reader = preset.ClaudeReader()
    for line in lines:
        reader(line)
    assert reader.said() == said


def test_launch_is_headless_with_the_tasks_model_everywhere() -> None:
    launch = preset.launch(Context("-fix it", "/p/prompt.txt", "claude-x", "/w", 1))
    argv = launch.argv
    assert argv[:2] == ["claude", "-p"] and argv[-2:] == ["--", "-fix it"]
    assert argv[argv.index("--output-format") + 1] == "stream-json" and "--verbose" in argv
    assert "--dangerously-skip-permissions" in argv
    assert argv[argv.index("--model") + 1] == "claude-x"
    env = launch.env
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == env["IS_SANDBOX"] == "1"
    assert env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == env["CLAUDE_CODE_SUBAGENT_MODEL"] == "claude-x"
    # The gateway and its token come from the step's environment, never from the preset.
    assert not {"ANTHROPIC_BASE_URL", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_API_KEY"} & set(env)
    assert launch.home_files == {}


def test_the_install_script_pins_the_version_the_preset_names() -> None:
    script = (ROOT / ".ci" / "agents" / "claude.sh").read_text()
    assert f"version={preset.VERSION}\n" in script
    assert preset.VERSION in preset.PRESET.install


# --- end to end -------------------------------------------------------------------------


@needs_claude
@pytest.mark.slow
def test_claude_posts_streamed_messages_to_its_provider_only(
    scripted: Scripted, trap: Trap, tmp_path: Path
) -> None:
    """Straight at the upstream: every request is a streamed POST /v1/messages?beta=true
    with the step's token as a bearer, the fix is its Bash tool's, and nothing goes anywhere
    else (no telemetry, update check or title request) though every proxy points at a trap."""
    turns = [{"text": "Fixing.", "shell": FIX}, {"text": "Fixed file.txt."}]
    upstream = scripted(turns, count="tools")
    work = repo(tmp_path / "w")
    launch = preset.launch(
        Context("Fix file.txt", str(tmp_path / "p.txt"), "claude-scripted", str(work), 1)
    )
    env = {
        "HOME": str(home(tmp_path, launch)),
        **trap.env(),
        **launch.env,
        "ANTHROPIC_BASE_URL": upstream,
        "ANTHROPIC_AUTH_TOKEN": "tok-1",
    }
    reader = preset.ClaudeReader()
    done = run_direct(launch, work, env, reader)
    assert reader.said() == Said(True, "Fixed file.txt."), done.stdout[-3000:] + done.stderr
    assert done.returncode == 0
    assert (work / "file.txt").read_text() == "fixed\n"
    everything = [s for s in seen(upstream) if s["path"] != "/_script"]
    assert [(s["method"], s["path"], s["query"]) for s in everything] == [
        ("POST", "/v1/messages", "beta=true")
    ] * 2
    for s in everything:
        headers = {k.lower(): v for k, v in s["headers"].items()}
        assert headers["authorization"] == "Bearer tok-1" and "x-api-key" not in headers
        assert s["body"]["stream"] is True and s["body"]["model"] == "claude-scripted"
    assert trap.seen == []
    tools = {t.get("name"): t for t in everything[0]["body"]["tools"]}
    assert "command" in tools["Bash"]["input_schema"]["properties"]


@needs_claude
@pytest.mark.slow
@pytest.mark.timeout(150)  # a CLI's start-up on a loaded machine
def test_claude_honours_the_proxy_variables(trap: Trap, tmp_path: Path) -> None:
    """The control of the trap above: with its provider at an address NO_PROXY does not list,
    Claude Code's request goes through the trap."""
    work = repo(tmp_path / "w")
    launch = preset.launch(
        Context("Fix file.txt", str(tmp_path / "p.txt"), "claude-scripted", str(work), 1)
    )
    env = {
        "HOME": str(home(tmp_path, launch)),
        **trap.env(),
        **launch.env,
        "ANTHROPIC_BASE_URL": OFF_LIST,
        "ANTHROPIC_AUTH_TOKEN": "tok-1",
    }
    seen_by_trap = run_until_trapped(launch, work, env, trap)
    assert any(OFF_LIST.split("//")[1] in line for line in seen_by_trap), seen_by_trap


@needs_claude
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the refusal is of root only")
def test_as_root_it_needs_is_sandbox(tmp_path: Path) -> None:
    """Why the preset sets IS_SANDBOX=1: as root Claude Code refuses to skip permissions
    without it, before it sends any request."""
    launch = preset.launch(Context("hi", "/p.txt", "m", str(tmp_path), 1))
    env = {
        "PATH": PATH,
        "HOME": str(tmp_path),
        **launch.env,
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:9",
        "ANTHROPIC_AUTH_TOKEN": "t",
    }
    del env["IS_SANDBOX"]
    done = subprocess.run(
        launch.argv,
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "cannot be used with root/sudo privileges" in done.stderr


@needs_claude
@pytest.mark.slow
def test_a_fix_by_claude_is_verified_and_every_request_charged(
    bench: Bench, where: tuple[Path, StepUser | None]
) -> None:
    # git works in the worktree as the step user too (else "dubious ownership", exit 128).
    fix = f"git diff --quiet && {FIX}"
    upstream = bench.scripted(
        [{"text": "Fixing.", "shell": fix}, {"text": "Fixed file.txt."}], count="tools"
    )
    done = bench.run(upstream, "claude-fix", folder=where[0], user=where[1], **CLAUDE)
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    sent = completions(upstream)
    assert len(sent) == 2 == bench.charged("claude-fix")
    # calls_used: each request, the one tool call the model asked for, one rule run.
    assert done["calls_used"] == len(sent) + 1 + 1
    assert bench.trap.seen == []


@needs_claude
@pytest.mark.slow
def test_a_premature_stop_is_reprompted_with_the_unmet_rule(bench: Bench) -> None:
    upstream = bench.scripted(
        [
            {"text": "Shall I continue?"},
            {"text": "Fixing.", "shell": FIX},
            {"text": "Fixed file.txt."},
        ],
        count="tools",
    )
    done = bench.run(upstream, "claude-early", **CLAUDE)
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert done["turns"] == 2, done
    sent = completions(upstream)
    assert len(sent) == 3 == bench.charged("claude-early")
    assert done["calls_used"] == len(sent) + 1 + 2  # one tool call, two rule runs
    first, second = (prompt_text(s) for s in sent[:2])
    assert "says-fixed" not in first
    assert "says-fixed" in second and "sh check.sh" in second
