"""The agent presets, end to end through the sandbox (OVERNIGHT_SANDBOX=bwrap): the real CLI,
the scripted upstream behind the gateway (reached through the bridge), a fix verified. The
fix's shell command also prints the host name, which inside the sandbox is bwrap's: proof
that the agent ran there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from overnight.worker.sandbox import launch
from overnight.worker.sandbox.stepuser import StepUser
from tests.agent_tasks import FIX, Bench, completions
from tests.helpers import capability, lacking

HOSTNAME = "overnight-sandbox"  # what bwrap's --hostname names inside
# git reads work on the worktree inside (its repository bound read-only), else no fix.
SHELL = f"git status --short && git diff --quiet && {FIX} && hostname"
needs_bwrap = capability(None if launch.find_bwrap() else "bubblewrap is not installed")

CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "codex": ([{"text": "Fixing.", "shell": SHELL}, {"text": "Fixed file.txt."}], {}),
    "claude": (
        [{"text": "Fixing.", "shell": SHELL}, {"text": "Fixed file.txt."}],
        {"model": "claude-scripted", "url_var": "OVERNIGHT_ANTHROPIC_URL"},
    ),
    "mini-swe-agent": (
        [
            {"text": "Fixing.", "shell": SHELL},
            {"text": "Done.", "shell": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"},
        ],
        {"max_calls": 20},
    ),
}
PROGRAMS = {"codex": "codex", "claude": "claude", "mini-swe-agent": "mini"}


def logs_of(folder: Path) -> list[str]:
    return [p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file()]


@needs_bwrap
@pytest.mark.slow
@pytest.mark.parametrize("where", [True], indirect=True)
@pytest.mark.parametrize("agent", sorted(CASES))
def test_a_preset_fixes_and_verifies_in_its_sandbox(
    bench: Bench, agent: str, where: tuple[Path, StepUser | None]
) -> None:
    if shutil.which(PROGRAMS[agent]) is None:
        lacking(f"{agent} is not installed")
    replies, keys = CASES[agent]
    bench.env = {**bench.env, "OVERNIGHT_SANDBOX": "bwrap"}
    upstream = bench.scripted(replies, count="tools") if agent == "claude" else None
    upstream = upstream or bench.scripted(replies)
    name = f"{agent}-sandboxed"
    done = bench.run(upstream, name, folder=where[0], user=where[1], agent=agent, **keys)
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert len(completions(upstream)) == len(replies) == bench.charged(name)
    assert bench.trap.seen == []
    logs = logs_of(where[0] / "state" / "task-logs")
    assert any(HOSTNAME in text for text in logs), logs
    assert done["sandbox"] == "bwrap"


# aider edits by its own edit format and runs no shell here: its worker's recorded mode
# (each task's "sandbox" in status) says where it ran.
AIDER_FIX = "Fixing.\n\nfile.txt\n```\nfixed\n```\n"


@needs_bwrap
@pytest.mark.slow
@pytest.mark.parametrize("where", [True], indirect=True)
def test_aider_fixes_and_verifies_in_its_sandbox(
    bench: Bench, where: tuple[Path, StepUser | None]
) -> None:
    """aider in the sandbox: its git identity comes from the HOME overnight fills (a
    tmpfs inside), so it writes nothing to the repository's .git, which is read-only there."""
    if shutil.which("aider") is None:
        lacking("aider is not installed")
    bench.env = {**bench.env, "OVERNIGHT_SANDBOX": "bwrap"}
    upstream = bench.scripted([{"text": AIDER_FIX}])
    done = bench.run(upstream, "aider-sandboxed", folder=where[0], user=where[1], agent="aider")
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert done["sandbox"] == "bwrap"
    assert len(completions(upstream)) == 1 == bench.charged("aider-sandboxed")
    assert bench.trap.seen == []
