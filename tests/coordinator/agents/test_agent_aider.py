"""The aider preset: aider run as a task's agent, through this host's gateway, against the
scripted upstream. aider has no shell tool (and runs no shell command under --yes-always): the
scripted model's text carries aider's edit format for a model it does not know, ``whole`` (the
file's name, then the whole new file in a fence), and aider applies it to a file of the
repository. It sends streamed POST /v1/chat/completions only (nothing anywhere else: no model
price list, update check or analytics), every request is one model unit, and a turn it ends
early is re-prompted. aider exits 0 even when it gave up on the API: the reader says so."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from overnight.coordinator.agents import Context, Said
from overnight.coordinator.agents import aider as preset
from overnight.worker.sandbox.stepuser import StepUser
from tests.agent_tasks import (
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

needs_aider = capability(
    None if shutil.which("aider") else "aider (PyPI aider-chat) is not installed"
)
# aider's "whole" edit format: the file's path alone on a line, then the new file, fenced.
FIX = "Fixing.\n\nfile.txt\n```\nfixed\n```\n"

RETRY = b"litellm.InternalServerError: InternalServerError: OpenAIException - boom"


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        ([], None),
        ([b"Aider v0.86.2", b"Model: openai/m with whole edit format"], None),
        (
            [b"Tokens: 729 sent, 14 received.", b"Applied edit to file.txt"],
            Said(True, "applied edits to file.txt"),
        ),
        (
            [b"Applied edit to a.py", b"Applied edit to b.py", b"Applied edit to a.py"],
            Said(True, "applied edits to a.py, b.py"),
        ),
        (
            [b"Shall I continue?", b"Tokens: 700 sent, 5 received."],
            Said(True, "the model answered without editing a file"),
        ),
        ([RETRY, b"Retrying in 0.2 seconds...", RETRY], Said(False, RETRY.decode())),
        (
            [RETRY, b"Retrying in 0.2 seconds...", b"Tokens: 1 sent, 1 received."],
            Said(True, "the model answered without editing a file"),
        ),  # a retry worked
        (
            [b"Applied edit to x.py", b"litellm.RateLimitError: 429 envelope is empty"],
            Said(False, "litellm.RateLimitError: 429 envelope is empty"),
        ),  # its lint fix failed
        (
            [b"litellm.py is mentioned", b"Tokens: 1 sent, 1 received."],
            Said(True, "the model answered without editing a file"),
        ),
    ],
)
def test_the_reader_takes_aiders_own_lines(lines: list[bytes], said: Said | None) -> None:
    reader = preset.AiderReader()
    for line in lines:
        reader(line + b"\n")
    assert reader.said() == said


def test_launch_is_headless_and_commits_nothing() -> None:
    launch = preset.launch(Context("fix it", "/p/prompt.txt", "gpt-x", "/w", 1))
    argv = launch.argv
    assert argv[0] == "aider" and argv[-2:] == ["--message-file", "/p/prompt.txt"]
    assert argv[argv.index("--model") + 1] == argv[argv.index("--weak-model") + 1] == "openai/gpt-x"
    for flag in (
        "--yes-always",
        "--no-auto-commits",
        "--no-dirty-commits",
        "--no-check-update",
        "--no-analytics",
    ):
        assert flag in argv
    assert preset.launch(Context("x", "/p", "openai/m", "/w", 1)).argv.count("openai/m") == 2
    # The gateway and its token come from the step's environment, never from the preset.
    assert launch.env == {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    cache = json.loads(launch.home_files[".aider/caches/model_prices_and_context_window.json"])
    assert cache  # empty, aider would download the list again


def test_the_install_script_pins_the_version_the_preset_names() -> None:
    script = (ROOT / ".ci" / "agents" / "aider.sh").read_text()
    assert f"version={preset.VERSION}\n" in script
    assert preset.VERSION in preset.PRESET.install


# --- end to end -------------------------------------------------------------------------


def _git(folder: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=folder, capture_output=True, text=True, timeout=30, check=True
    ).stdout


@needs_aider
@pytest.mark.slow
def test_aider_posts_streamed_chat_to_its_provider_only(
    scripted: Scripted, trap: Trap, tmp_path: Path
) -> None:
    """Straight at the upstream: one streamed POST /v1/chat/completions with the step's key,
    no tools; aider applies the whole-file edit and commits nothing; nothing goes anywhere
    else though every proxy variable points at a trap."""
    upstream = scripted([{"text": FIX}])
    work = repo(tmp_path / "w")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("file.txt says broken; make it say fixed.\n")
    launch = preset.launch(Context(prompt.read_text(), str(prompt), "scripted", str(work), 1))
    env = {
        "HOME": str(home(tmp_path, launch)),
        **trap.env(),
        **launch.env,
        "OPENAI_BASE_URL": f"{upstream}/v1",
        "OPENAI_API_BASE": f"{upstream}/v1",
        "OPENAI_API_KEY": "tok-1",
    }
    reader = preset.AiderReader()
    done = run_direct(launch, work, env, reader)
    out = (done.stdout + done.stderr).decode(errors="replace")
    assert reader.said() == Said(True, "applied edits to file.txt"), out[-3000:]
    assert done.returncode == 0
    assert (work / "file.txt").read_text() == "fixed\n"
    log = _git(work, "log", "--oneline")
    assert len(log.splitlines()) == 1, log  # nothing committed
    everything = [s for s in seen(upstream) if s["path"] != "/_script"]
    assert [(s["method"], s["path"]) for s in everything] == [("POST", "/v1/chat/completions")]
    headers = {k.lower(): v for k, v in everything[0]["headers"].items()}
    assert headers["authorization"] == "Bearer tok-1"
    body = everything[0]["body"]
    assert body["stream"] is True and body["model"] == "scripted" and not body.get("tools")
    assert trap.seen == []


@needs_aider
@pytest.mark.slow
@pytest.mark.timeout(150)  # a CLI's start-up on a loaded machine
def test_aider_honours_the_proxy_variables(trap: Trap, tmp_path: Path) -> None:
    """The control of the trap above: with its provider at an address NO_PROXY does not list,
    aider's request goes through the trap."""
    work = repo(tmp_path / "w")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("file.txt says broken; make it say fixed.\n")
    launch = preset.launch(Context(prompt.read_text(), str(prompt), "scripted", str(work), 1))
    env = {
        "HOME": str(home(tmp_path, launch)),
        **trap.env(),
        **launch.env,
        "OPENAI_BASE_URL": f"{OFF_LIST}/v1",
        "OPENAI_API_BASE": f"{OFF_LIST}/v1",
        "OPENAI_API_KEY": "tok-1",
    }
    seen_by_trap = run_until_trapped(launch, work, env, trap)
    assert any(OFF_LIST.split("//")[1] in line for line in seen_by_trap), seen_by_trap


@needs_aider
@pytest.mark.slow
def test_a_fix_by_aider_is_verified_and_every_request_charged(
    bench: Bench, where: tuple[Path, StepUser | None]
) -> None:
    upstream = bench.scripted([{"text": FIX}])
    done = bench.run(upstream, "aider-fix", folder=where[0], agent="aider", user=where[1])
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    sent = completions(upstream)
    assert len(sent) == 1 == bench.charged("aider-fix")
    assert done["calls_used"] == len(sent) + 1  # the request, one rule run (no tool calls)
    assert bench.trap.seen == []
    # aider kept its chat history and tags cache out of the commit by ignoring them, as it
    # recommends, and left the repository's own git config alone.
    checkout = where[0] / "aider-fix"
    tree = _git(checkout, "ls-tree", "-r", "--name-only", "overnight/aider-fix").split()
    assert tree == [".gitignore", "check.sh", "file.txt"]
    assert _git(checkout, "show", "overnight/aider-fix:.gitignore") == ".aider*\n"
    assert "user" not in _git(checkout, "config", "--local", "--list")


@needs_aider
@pytest.mark.slow
def test_a_premature_stop_is_reprompted_with_the_unmet_rule(bench: Bench) -> None:
    upstream = bench.scripted([{"text": "Shall I continue?"}, {"text": FIX}])
    done = bench.run(upstream, "aider-early", agent="aider")
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert done["turns"] == 2, done
    sent = completions(upstream)
    assert len(sent) == 2 == bench.charged("aider-early")
    assert done["calls_used"] == len(sent) + 2  # two rule runs
    first, second = (prompt_text(s) for s in sent)
    assert "says-fixed" not in first
    assert "says-fixed" in second and "sh check.sh" in second
