"""The mini-swe-agent preset: ``mini`` run as a task's agent, through this host's gateway,
against the scripted upstream. Every request it sends is one model unit; it posts plain chat
completions to its base URL and nothing anywhere else; a run it ends early is re-prompted; a
30 s model wait with a 5 s gap does not kill it, nor does its silent start-up. The reader's
account of a run and the start-up hook's pure parts are tables."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from overnight.coordinator.agents import Context, Said
from overnight.coordinator.agents import mini as preset
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

needs_mini = capability(None if shutil.which("mini") else "mini is not installed")
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def _outcome(**kw: Any) -> bytes:
    return json.dumps({preset.KEY: kw}).encode() + b"\n"


SUBMITTED = _outcome(exit_status="Submitted", api_calls=2, cost=0.0, submission="", exception="")


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        ([], None),
        ([b"This is mini-swe-agent version 2.4.6.", b'{"returncode": 0, "output": ""}'], None),
        ([SUBMITTED], Said(True, "Submitted after 2 model calls")),
        (
            [_outcome(exit_status="Submitted", api_calls=1)],
            Said(True, "Submitted after 1 model call"),
        ),
        (
            [_outcome(exit_status="LimitsExceeded", api_calls=5, exception="")],
            Said(False, "LimitsExceeded after 5 model calls"),
        ),
        (
            [_outcome(exit_status="RepeatedFormatError", api_calls=3)],
            Said(False, "RepeatedFormatError after 3 model calls"),
        ),
        (
            [_outcome(exit_status="RuntimeError", api_calls=1, exception="Global\ncost limit")],
            Said(False, "RuntimeError after 1 model call: Global cost limit"),
        ),
        ([_outcome(exit_status=None)], Said(False, "mini-swe-agent wrote no trajectory")),
        # The hook's line comes last; one a command printed earlier does not count.
        (
            [
                _outcome(exit_status="Submitted", api_calls=9),
                b"{not json",
                _outcome(exit_status="TimeExceeded", api_calls=4),
            ],
            Said(False, "TimeExceeded after 4 model calls"),
        ),
    ],
)
def test_the_reader_takes_the_hooks_outcome(lines: list[bytes], said: Said | None) -> None:
    reader = preset.MiniReader()
    for line in lines:
        reader(line)
    assert reader.said() == said


@pytest.mark.parametrize(
    ("model", "arg"),
    [
        ("gpt-4o-mini", "openai/gpt-4o-mini"),
        ("Qwen/Qwen2.5-Coder", "openai/Qwen/Qwen2.5-Coder"),
        ("openai/x", "openai/openai/x"),
    ],
)
def test_litellm_is_asked_for_the_model_name_exactly(model: str, arg: str) -> None:
    assert preset.model_arg(model) == arg


def test_launch_runs_mini_itself_headless_with_its_hook() -> None:
    launch = preset.launch(Context("fix it", "/p/prompt.txt", "m", "/w", 1, "http://gw"))
    assert launch.argv == [
        "mini",
        "--yolo",
        "--exit-immediately",
        "--cost-limit",
        "0",
        "--model",
        "openai/m",
        "--task",
        "fix it",
    ]
    assert launch.env["MSWEA_CONFIGURED"] == "true"
    assert launch.env["MSWEA_COST_TRACKING"] == "ignore_errors"
    assert launch.env["LITELLM_OFFLINE_MODE"] == "true"
    assert launch.env["OVERNIGHT_MINI_HOOK"] == "~/" + preset.HOOK_PATH
    assert launch.home_files == {preset.HOOK_PATH: preset.HOOK}


def _hook() -> dict[str, Any]:
    space: dict[str, Any] = {"__name__": "not_the_hook"}  # defines; starts nothing
    exec(compile(preset.HOOK, "mini_hook.py", "exec"), space)
    return space


def test_the_hooks_outcome_reads_the_trajectory(tmp_path: Path) -> None:
    outcome = _hook()["outcome"]
    path = tmp_path / "t.json"
    assert outcome(str(path)) == {"exit_status": None}
    path.write_text(
        json.dumps(
            {
                "info": {
                    "exit_status": "RuntimeError",
                    "submission": "",
                    "model_stats": {"api_calls": 3, "instance_cost": 0.0},
                },
                "messages": [{"role": "exit", "extra": {"exception_str": "boom"}}],
            }
        )
    )
    assert outcome(str(path)) == {
        "exit_status": "RuntimeError",
        "api_calls": 3,
        "cost": 0.0,
        "submission": "",
        "exception": "boom",
    }
    path.write_text("[1]")
    assert outcome(str(path)) == {"exit_status": None}


def test_the_pth_line_runs_the_hook_the_step_names_and_hides_it_from_children(
    tmp_path: Path,
) -> None:
    (tmp_path / ".overnight").mkdir()
    (tmp_path / preset.HOOK_PATH).write_text("print('hook as', __name__)\n")
    after = "\nimport os; print('left:', os.environ.get('OVERNIGHT_MINI_HOOK'))"
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    hook = {"OVERNIGHT_MINI_HOOK": preset.ENV["OVERNIGHT_MINI_HOOK"]}
    named = subprocess.run(
        [sys.executable, "-c", preset.PTH_LINE + after],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env={**env, **hook},
    )
    assert named.stdout == "hook as overnight_mini_hook\nleft: None\n"
    unnamed = subprocess.run(
        [sys.executable, "-c", preset.PTH_LINE + after],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env=env,
    )
    assert unnamed.stdout == "left: None\n"


def test_the_install_script_pins_the_version_and_writes_the_pth_line() -> None:
    script = (ROOT / ".ci" / "agents" / "mini-swe-agent.sh").read_text()
    assert f"version={preset.VERSION}\n" in script
    assert f"pth_line='{preset.PTH_LINE}'\n" in script
    assert preset.VERSION in preset.PRESET.install


# --- end to end -------------------------------------------------------------------------

MINI = "mini-swe-agent"


@needs_mini
@pytest.mark.slow
def test_mini_posts_chat_completions_to_its_base_url_only(
    scripted: Scripted, trap: Trap, tmp_path: Path
) -> None:
    """Straight at the upstream: every request mini sends is an unstreamed POST
    /v1/chat/completions with the step's key and the bash tool, and nothing goes anywhere
    else (no cost map or tokenizer fetched), though every proxy variable points at a trap.
    Its start-up hook (run by the .pth line the install script wrote) says it is alive and
    prints the outcome, Submitted; the commands mini runs do not see the hook's variable."""
    fix = f"{FIX}; printenv OVERNIGHT_MINI_HOOK > hook.txt; true"
    upstream = scripted([{"text": "Fixing.", "shell": fix}, {"text": "Done.", "shell": SUBMIT}])
    work = repo(tmp_path / "w")
    launch = preset.launch(
        Context("Fix file.txt", str(tmp_path / "p.txt"), "scripted", str(work), 1)
    )
    env = {
        "HOME": str(home(tmp_path, launch)),
        **trap.env(),
        "OPENAI_BASE_URL": f"{upstream}/v1",
        "OPENAI_API_BASE": f"{upstream}/v1",
        "OPENAI_API_KEY": "tok-1",
        **launch.env,
    }
    reader = preset.MiniReader()
    done = run_direct(launch, work, env, reader)
    out = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
    assert reader.said() == Said(True, "Submitted after 2 model calls"), out
    assert done.returncode == 0, out
    assert (work / "file.txt").read_text() == "fixed\n"
    assert (work / "hook.txt").read_text() == ""
    assert done.stdout.startswith(b"overnight: mini-swe-agent is loading"), out
    assert b"overnight: mini-swe-agent loaded in " in done.stdout
    everything = seen(upstream)
    assert [(s["method"], s["path"]) for s in everything] == [("POST", "/v1/chat/completions")] * 2
    for s in everything:
        headers = {k.lower(): v for k, v in s["headers"].items()}
        assert "upgrade" not in headers and headers["authorization"] == "Bearer tok-1"
        assert not s["body"].get("stream") and s["body"]["model"] == "scripted"
        (tool,) = s["body"]["tools"]
        assert tool["function"]["name"] == "bash"
        assert tool["function"]["parameters"]["properties"]["command"]["type"] == "string"
    assert "Fix file.txt" in prompt_text(everything[0])
    assert trap.seen == []


@needs_mini
@pytest.mark.slow
@pytest.mark.timeout(150)  # a CLI's start-up on a loaded machine
def test_mini_honours_the_proxy_variables(trap: Trap, tmp_path: Path) -> None:
    """The control of the trap above: with its provider at an address NO_PROXY does not list,
    mini's request goes through the trap."""
    work = repo(tmp_path / "w")
    launch = preset.launch(
        Context("Fix file.txt", str(tmp_path / "p.txt"), "scripted", str(work), 1)
    )
    env = {
        "HOME": str(home(tmp_path, launch)),
        **trap.env(),
        "OPENAI_BASE_URL": f"{OFF_LIST}/v1",
        "OPENAI_API_BASE": f"{OFF_LIST}/v1",
        "OPENAI_API_KEY": "tok-1",
        **launch.env,
    }
    seen_by_trap = run_until_trapped(launch, work, env, trap)
    assert any(OFF_LIST.split("//")[1] in line for line in seen_by_trap), seen_by_trap


@needs_mini
@pytest.mark.slow
def test_a_fix_by_mini_is_verified_and_every_request_charged(bench: Bench) -> None:
    # The fix also keeps what the agent's environment says the proxy is (in its commit).
    fix = f"{FIX}; printenv HTTPS_PROXY > proxy.txt"
    upstream = bench.scripted(
        [{"text": "Fixing.", "shell": fix}, {"text": "Done.", "shell": SUBMIT}]
    )
    done = bench.run(upstream, "mini-fix", agent=MINI, max_calls=20)
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert done["turns"] == 1, done
    sent = completions(upstream)
    assert len(sent) == 2 == bench.charged("mini-fix")
    # calls_used: each request, each tool call the model asked for (2), one rule run.
    assert done["calls_used"] == len(sent) + 2 + 1
    assert bench.agent_said("mini-fix") == [("Submitted after 2 model calls", True)]
    # The task's agent ran with every proxy at the trap (which mini honours: the control
    # above), and the trap saw nothing.
    shown = subprocess.run(
        ["git", "show", "overnight/mini-fix:proxy.txt"],
        cwd=bench.folder / "mini-fix",
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert shown.stdout == bench.trap.url + "\n"
    assert bench.trap.seen == []


@needs_mini
@pytest.mark.slow
def test_a_premature_stop_is_reprompted_with_the_unmet_rule(bench: Bench) -> None:
    """A reply without a command is a format error mini sends back; after three in a row it
    stops (RepeatedFormatError, exit 0). The rule fails, and the next turn's prompt names it."""
    ask = {"text": "Shall I continue?"}
    upstream = bench.scripted(
        [ask, ask, ask, {"text": "Fixing.", "shell": FIX}, {"text": "Done.", "shell": SUBMIT}]
    )
    done = bench.run(upstream, "mini-early", agent=MINI, max_calls=20)
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert done["turns"] == 2, done
    sent = completions(upstream)
    assert len(sent) == 5 == bench.charged("mini-early")
    assert done["calls_used"] == len(sent) + 2 + 2  # two tool calls, two rule runs
    assert bench.agent_said("mini-early") == [
        ("RepeatedFormatError after 3 model calls", False),
        ("Submitted after 2 model calls", True),
    ]
    assert "says-fixed" not in prompt_text(sent[0])
    assert "says-fixed" in prompt_text(sent[3]) and "sh check.sh" in prompt_text(sent[3])


@needs_mini
@pytest.mark.slow
def test_a_30s_model_wait_does_not_kill_the_step(bench: Bench) -> None:
    """A 5 s gap: mini's start-up (litellm's import) is covered by the hook's lines, the
    30 s answer by the gateway's beats while the request is in flight."""
    upstream = bench.scripted(
        [{"text": "Fixing.", "shell": FIX, "delay": 30}, {"text": "Done.", "shell": SUBMIT}]
    )
    done = bench.run(upstream, "mini-slow", agent=MINI, max_calls=20, heartbeat_gap=5)
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert done["turns"] == 1, done
    assert len(completions(upstream)) == 2 == bench.charged("mini-slow")
