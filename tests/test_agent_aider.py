"""The aider preset: aider run as a task's agent, through this host's gateway, against the
scripted upstream. aider has no shell tool (and runs no shell command under --yes-always): the
scripted model's text carries aider's edit format for a model it does not know, ``whole`` (the
file's name, then the whole new file in a fence), and aider applies it to a file of the
repository. It sends streamed POST /v1/chat/completions only (nothing anywhere else: no model
price list, update check or analytics), every request is one model unit, and a turn it ends
early is re-prompted. aider exits 0 even when it gave up on the API: the reader says so."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.agents import Context, Said
from overnight.coordinator.agents import aider as preset
from overnight.worker.envelope import CallEnvelope
from overnight.worker.receipts import read
from overnight.worker.stepuser import StepUser
from tests.helpers import OVERNIGHT, ROOT

UPSTREAM = Path(__file__).with_name("scripted_upstream.py")
needs_aider = pytest.mark.skipif(shutil.which("aider") is None,
                                 reason="aider (PyPI aider-chat) is not installed")  # fmt: skip
COMPLETIONS = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
# aider's "whole" edit format: the file's path alone on a line, then the new file, fenced.
FIX = "Fixing.\n\nfile.txt\n```\nfixed\n```\n"
RULE = ["sh", "check.sh"]  # a file a rule names is protected: the rule names its script

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
    for flag in ("--yes-always", "--no-auto-commits", "--no-dirty-commits", "--no-check-update",
                 "--no-analytics"):  # fmt: skip
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


class Trap:
    """An HTTP proxy that forwards nothing: records the first line of every connection."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.seen: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.seen.append(conn.recv(300).split(b"\r\n")[0].decode("latin-1"))
                except OSError:
                    self.seen.append("?")

    def env(self) -> dict[str, str]:
        proxy = dict.fromkeys(("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy",
                               "ALL_PROXY", "all_proxy"), self.url)  # fmt: skip
        return {**proxy, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


@pytest.fixture
def trap() -> Iterator[Trap]:
    t = Trap()
    yield t
    t.sock.close()


Start = Callable[[list[dict[str, Any]]], str]


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[Start]:
    """Starts the scripted upstream playing the given turns, one a request; returns its
    URL."""
    procs: list[subprocess.Popen[str]] = []

    def start(turns: list[dict[str, Any]]) -> str:
        script = tmp_path / f"script-{len(procs)}.json"
        script.write_text(json.dumps({"turns": turns}))
        proc = subprocess.Popen([sys.executable, str(UPSTREAM), "--script", str(script)],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        procs.append(proc)
        assert proc.stdout is not None
        return f"http://127.0.0.1:{proc.stdout.readline().split()[1]}"

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def seen(upstream: str) -> list[dict[str, Any]]:
    out = subprocess.run(["curl", "-sf", f"{upstream}/_seen"], capture_output=True, text=True,
                         timeout=10, check=True)  # fmt: skip
    got: list[dict[str, Any]] = json.loads(out.stdout)
    return got


def completions(upstream: str) -> list[dict[str, Any]]:
    return [s for s in seen(upstream) if s["path"] in COMPLETIONS]


def _repo(path: Path) -> Path:
    path.mkdir()
    (path / "file.txt").write_text("broken\n")
    (path / "check.sh").write_text("grep -q fixed file.txt\n")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    for args in (["init", "-q", "."], ["add", "."], ["commit", "-qm", "a bug"]):
        subprocess.run([*git, *args], cwd=path, check=True, timeout=30)
    return path


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30,
                          check=True).stdout  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _cli(tenv: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([OVERNIGHT, *args], env=tenv, capture_output=True, text=True,
                          timeout=150, check=False)  # fmt: skip


def _inline(table: dict[str, str]) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + "}"


def run_task(env: dict[str, str], tmp_path: Path, upstream: str, trap: Trap, name: str,
             user: StepUser | None = None) -> dict[str, Any]:  # fmt: skip
    """Submit a task whose agent is aider, run one burst worker (its steps as ``user``, or
    as the suite's default, root), return its status."""
    _repo(tmp_path / name)
    if user is not None:
        env = {**env, "OVERNIGHT_STEP_USER": user.name}
    tenv = {**env, "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"], "OVERNIGHT_GRACE": "0.5",
            "OVERNIGHT_MODEL_URL": upstream, "OVERNIGHT_GATEWAY_PORT": str(_free_port()),
            "OVERNIGHT_STATE_DIR": str(tmp_path / "state"),
            "OVERNIGHT_LOG_DIR": str(tmp_path / "logs")}  # fmt: skip
    lines = [f"id = {json.dumps(name)}", f"workdir = {json.dumps(name)}",
             'assignment = "file.txt says broken; make it say fixed."', 'agent = "aider"',
             'model = "scripted"', "max_calls = 10", f"env = {_inline(trap.env())}",
             "[[verifier]]", 'name = "says-fixed"', f"run = {json.dumps(RULE)}"]  # fmt: skip
    path = tmp_path / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    submitted = _cli(tenv, "submit", str(path))
    assert submitted.returncode == 0, submitted.stderr
    worked = _cli(tenv, "worker", "--burst")
    assert worked.returncode == 0, worked.stderr[-3000:]
    shown = _cli(tenv, "status", name)
    assert shown.returncode == 0, shown.stderr
    data: dict[str, Any] = json.loads(shown.stdout)
    return data


def charged(r: redis.Redis, namespace: str, task: str) -> int:
    """Model requests charged to ``task``: its receipts, and the envelope's model units."""
    calls = sum(1 for rc in read(r, Keys(namespace), task_id=task) if rc.kind == "model_call")
    assert CallEnvelope(r, "default", namespace).snapshot().consumed_model == calls
    return calls


@needs_aider
@pytest.mark.slow
def test_aider_posts_streamed_chat_to_its_provider_only(
    scripted: Start, trap: Trap, tmp_path: Path
) -> None:
    """Straight at the upstream: one streamed POST /v1/chat/completions with the step's key,
    no tools; aider applies the whole-file edit and commits nothing; nothing goes anywhere
    else though every proxy variable points at a trap."""
    upstream = scripted([{"text": FIX}])
    work = _repo(tmp_path / "w")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("file.txt says broken; make it say fixed.\n")
    launch = preset.launch(Context(prompt.read_text(), str(prompt), "scripted", str(work), 1))
    home = tmp_path / "home"
    for rel, text in launch.home_files.items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text(text)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), **trap.env(),
           **launch.env, "OPENAI_BASE_URL": f"{upstream}/v1",
           "OPENAI_API_BASE": f"{upstream}/v1", "OPENAI_API_KEY": "tok-1"}  # fmt: skip
    done = subprocess.run(launch.argv, cwd=work, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=120, check=False)  # fmt: skip
    reader = preset.AiderReader()
    for line in done.stdout.splitlines():
        reader(line)
    out = (done.stdout + done.stderr).decode(errors="replace")
    assert reader.said() == Said(True, "applied edits to file.txt"), out[-3000:]
    assert done.returncode == 0
    assert (work / "file.txt").read_text() == "fixed\n"
    log = subprocess.run(["git", "log", "--oneline"], cwd=work, capture_output=True, text=True,
                         timeout=30, check=True)  # fmt: skip
    assert len(log.stdout.splitlines()) == 1, log.stdout  # nothing committed
    everything = [s for s in seen(upstream) if s["path"] != "/_script"]
    assert [(s["method"], s["path"]) for s in everything] == [("POST", "/v1/chat/completions")]
    headers = {k.lower(): v for k, v in everything[0]["headers"].items()}
    assert headers["authorization"] == "Bearer tok-1"
    body = everything[0]["body"]
    assert body["stream"] is True and body["model"] == "scripted" and not body.get("tools")
    assert trap.seen == []


@pytest.fixture(params=[False, True], ids=["root", "step-user"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, StepUser | None]]:
    """Where a task's files go and who its steps run as: root (the suite's default) in
    tmp_path, or the step user, as in production, in a folder it can enter."""
    if not request.param:
        yield tmp_path, None
        return
    user = request.getfixturevalue("step_user")
    base = Path(tempfile.mkdtemp(prefix="overnight-aider-", dir="/tmp"))
    os.chmod(base, 0o711)
    yield base, user
    shutil.rmtree(base, ignore_errors=True)


@needs_aider
@pytest.mark.slow
def test_a_fix_by_aider_is_verified_and_every_request_charged(
    env: dict[str, str], scripted: Start, trap: Trap, where: tuple[Path, StepUser | None],
    r: redis.Redis, namespace: str,
) -> None:  # fmt: skip
    CallEnvelope(r, "default", namespace).reset(100)
    upstream = scripted([{"text": FIX}])
    done = run_task(env, where[0], upstream, trap, "aider-fix", where[1])
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    sent = completions(upstream)
    assert len(sent) == 1 == charged(r, namespace, "aider-fix")
    assert done["calls_used"] == len(sent) + 1  # the request, one rule run (no tool calls)
    assert trap.seen == []
    # aider kept its chat history and tags cache out of the commit by ignoring them, as it
    # recommends, and left the repository's own git config alone.
    repo = where[0] / "aider-fix"
    tree = _git(repo, "ls-tree", "-r", "--name-only", "overnight/aider-fix").split()
    assert tree == [".gitignore", "check.sh", "file.txt"]
    assert _git(repo, "show", "overnight/aider-fix:.gitignore") == ".aider*\n"
    assert "user" not in _git(repo, "config", "--local", "--list")


@needs_aider
@pytest.mark.slow
def test_a_premature_stop_is_reprompted_with_the_unmet_rule(
    env: dict[str, str], scripted: Start, trap: Trap, tmp_path: Path, r: redis.Redis,
    namespace: str,
) -> None:  # fmt: skip
    CallEnvelope(r, "default", namespace).reset(100)
    upstream = scripted([{"text": "Shall I continue?"}, {"text": FIX}])
    done = run_task(env, tmp_path, upstream, trap, "aider-early")
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert done["turns"] == 2, done
    sent = completions(upstream)
    assert len(sent) == 2 == charged(r, namespace, "aider-early")
    assert done["calls_used"] == len(sent) + 2  # two rule runs
    first, second = (json.dumps(s["body"]["messages"]) for s in sent)
    assert "says-fixed" not in first
    assert "says-fixed" in second and "sh check.sh" in second
