"""The codex preset: OpenAI Codex CLI run as a task's agent, through this host's gateway, against
the scripted upstream. Every request it sends is one model unit; it speaks plain HTTP POSTs to
its provider only (no WebSocket, nothing to chatgpt.com or GitHub); a turn it ends early is
re-prompted; a 30 s model wait with a 5 s gap does not kill it. The reader's account of a
turn is a table."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.agents import Context, Said
from overnight.coordinator.agents import codex as preset
from overnight.worker.envelope import CallEnvelope
from overnight.worker.receipts import read
from tests.helpers import OVERNIGHT, ROOT

UPSTREAM = Path(__file__).with_name("scripted_upstream.py")
CODEX = shutil.which("codex")
needs_codex = pytest.mark.skipif(CODEX is None, reason="codex is not installed")
COMPLETIONS = ("/v1/responses", "/v1/chat/completions", "/v1/messages")
FIX = "sed -i s/broken/fixed/ file.txt"
# The rule names its script, not file.txt: a file a rule names is protected from the agent.
RULE = ["sh", "check.sh"]


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


MSG = {"type": "item.completed", "item": {"id": "item_1", "type": "agent_message",
                                          "text": "Fixed\nit."}}  # fmt: skip
CMD = {"type": "item.completed", "item": {"id": "item_2", "type": "command_execution",
                                          "command": "x", "exit_code": 0}}  # fmt: skip
WARN = {"type": "item.completed", "item": {"id": "item_0", "type": "error",
                                           "message": "Model metadata not found."}}  # fmt: skip
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
        proxy = {k: self.url for k in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy",
                                       "ALL_PROXY", "all_proxy")}  # fmt: skip
        return {**proxy, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


@pytest.fixture
def trap() -> Iterator[Trap]:
    t = Trap()
    yield t
    t.sock.close()


Start = Callable[[list[dict[str, Any]]], str]


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[Start]:
    """Starts the scripted upstream playing the given turns; returns its URL."""
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
    with urllib.request.urlopen(f"{upstream}/_seen", timeout=10) as answer:
        got: list[dict[str, Any]] = json.load(answer)
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _cli(
    tenv: dict[str, str], *args: str, timeout: float = 150
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([OVERNIGHT, *args], env=tenv, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def run_task(r: redis.Redis, env: dict[str, str], tmp_path: Path, upstream: str, trap: Trap,
             name: str, **kw: Any) -> dict[str, Any]:  # fmt: skip
    """Submit a task whose agent is codex, run one burst worker, return its status."""
    CallEnvelope(r, "default", env["OVERNIGHT_NAMESPACE"]).reset(100)
    _repo(tmp_path / name)
    tenv = {**env, "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"], "OVERNIGHT_GRACE": "0.5",
            "OVERNIGHT_MODEL_URL": upstream, "OVERNIGHT_GATEWAY_PORT": str(_free_port()),
            "OVERNIGHT_STATE_DIR": str(tmp_path / "state")}  # fmt: skip
    lines = [f"id = {json.dumps(name)}", f"workdir = {json.dumps(name)}",
             'assignment = "file.txt says broken; make it say fixed."', 'agent = "codex"',
             'model = "scripted"', "max_calls = 10", f"env = {_inline(trap.env())}"]  # fmt: skip
    lines += [f"{key} = {json.dumps(value)}" for key, value in kw.items()]
    lines += ["[[verifier]]", 'name = "says-fixed"', f"run = {json.dumps(RULE)}"]
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


def _inline(table: dict[str, str]) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + "}"


def charged(r: redis.Redis, namespace: str, task: str) -> int:
    """Model requests charged to ``task``: its receipts, and the envelope's model units
    (each test has an envelope of its own)."""
    calls = sum(1 for rc in read(r, Keys(namespace), task_id=task) if rc.kind == "model_call")
    assert CallEnvelope(r, "default", namespace).snapshot().consumed_model == calls
    return calls


def _text(request: dict[str, Any]) -> str:
    return json.dumps(request["body"].get("input"))


@needs_codex
@pytest.mark.slow
def test_codex_posts_to_its_provider_only(scripted: Start, trap: Trap, tmp_path: Path) -> None:
    """Straight at the upstream (no gateway to turn an upgrade away): every request Codex
    sends is a streamed POST /v1/responses with the step's key, and nothing goes anywhere
    else, though every proxy variable points at a trap."""
    upstream = scripted([{"text": "Fixing.", "shell": FIX}, {"text": "Fixed."}])
    work = _repo(tmp_path / "w")
    launch = preset.launch(Context("Fix file.txt", str(tmp_path / "p.txt"), "scripted",
                                   str(work), 1, upstream))  # fmt: skip
    home = tmp_path / "home"
    for rel, text in launch.home_files.items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text(text)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), **trap.env(),
           "OPENAI_API_KEY": "tok-1"}  # fmt: skip
    done = subprocess.run(launch.argv, cwd=work, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=120, check=False)  # fmt: skip
    reader = preset.CodexReader()
    for line in done.stdout.splitlines():
        reader(line)
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
def test_a_fix_by_codex_is_verified_and_every_request_charged(
    env: dict[str, str], scripted: Start, trap: Trap, tmp_path: Path, r: redis.Redis,
    namespace: str,
) -> None:  # fmt: skip
    upstream = scripted([{"text": "Fixing.", "shell": FIX}, {"text": "Fixed file.txt."}])
    done = run_task(r, env, tmp_path, upstream, trap, "codex-fix")
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    sent = completions(upstream)
    assert len(sent) == 2 == charged(r, namespace, "codex-fix")
    # calls_used: each request, the one tool call the model asked for, one rule run.
    assert done["calls_used"] == len(sent) + 1 + 1
    assert trap.seen == []


@needs_codex
@pytest.mark.slow
def test_a_premature_stop_is_reprompted_with_the_unmet_rule(
    env: dict[str, str], scripted: Start, trap: Trap, tmp_path: Path, r: redis.Redis,
    namespace: str,
) -> None:  # fmt: skip
    upstream = scripted([{"text": "Shall I continue?"}, {"text": "Fixing.", "shell": FIX},
                         {"text": "Fixed file.txt."}])  # fmt: skip
    done = run_task(r, env, tmp_path, upstream, trap, "codex-early")
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert done["turns"] == 2, done
    sent = completions(upstream)
    assert len(sent) == 3 == charged(r, namespace, "codex-early")
    assert done["calls_used"] == len(sent) + 1 + 2  # one tool call, two rule runs
    assert "says-fixed" not in _text(sent[0])
    assert "says-fixed" in _text(sent[1]) and "sh check.sh" in _text(sent[1])


@needs_codex
@pytest.mark.slow
def test_a_30s_model_wait_does_not_kill_the_step(
    env: dict[str, str], scripted: Start, trap: Trap, tmp_path: Path, r: redis.Redis,
    namespace: str,
) -> None:  # fmt: skip
    upstream = scripted([{"text": "Fixing.", "shell": FIX, "delay": 30},
                         {"text": "Fixed file.txt."}])  # fmt: skip
    done = run_task(r, env, tmp_path, upstream, trap, "codex-slow", heartbeat_gap=5)
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert done["turns"] == 1, done
    assert len(completions(upstream)) == 2 == charged(r, namespace, "codex-slow")
