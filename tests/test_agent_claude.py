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
from overnight.coordinator.agents import claude as preset
from overnight.worker.envelope import CallEnvelope
from overnight.worker.receipts import read
from overnight.worker.stepuser import StepUser
from tests.helpers import OVERNIGHT, ROOT

UPSTREAM = Path(__file__).with_name("scripted_upstream.py")
needs_claude = pytest.mark.skipif(shutil.which("claude") is None,
                                  reason="claude (Claude Code) is not installed")  # fmt: skip
COMPLETIONS = ("/v1/messages", "/v1/chat/completions", "/v1/responses")
FIX = "sed -i s/broken/fixed/ file.txt"
RULE = ["sh", "check.sh"]  # a file a rule names is protected: the rule names its script


def _result(**kw: Any) -> bytes:
    return json.dumps({"type": "result", **kw}).encode() + b"\n"


INIT = json.dumps({"type": "system", "subtype": "init", "tools": ["Bash"]}).encode()
OK = _result(subtype="success", is_error=False, result="Fixed\nfile.txt.", num_turns=2)
API = _result(subtype="success", is_error=True, api_error_status=500,
              result="API Error: 500 boom.")  # fmt: skip
TURNS = _result(subtype="error_max_turns", is_error=True, num_turns=9,
                terminal_reason="max_turns")  # fmt: skip
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
    """Starts the scripted upstream playing the given turns (a request offering no tools,
    such as a title, would use none); returns its URL."""
    procs: list[subprocess.Popen[str]] = []

    def start(turns: list[dict[str, Any]]) -> str:
        script = tmp_path / f"script-{len(procs)}.json"
        script.write_text(json.dumps({"turns": turns, "count": "tools"}))
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
    """Submit a task whose agent is claude, run one burst worker (its steps as ``user``, or
    as the suite's default, root), return its status."""
    _repo(tmp_path / name)
    if user is not None:
        env = {**env, "OVERNIGHT_STEP_USER": user.name}
    tenv = {**env, "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"], "OVERNIGHT_GRACE": "0.5",
            "OVERNIGHT_ANTHROPIC_URL": upstream, "OVERNIGHT_GATEWAY_PORT": str(_free_port()),
            "OVERNIGHT_STATE_DIR": str(tmp_path / "state"),
            "OVERNIGHT_LOG_DIR": str(tmp_path / "logs")}  # fmt: skip
    lines = [f"id = {json.dumps(name)}", f"workdir = {json.dumps(name)}",
             'assignment = "file.txt says broken; make it say fixed."', 'agent = "claude"',
             'model = "claude-scripted"', "max_calls = 10", f"env = {_inline(trap.env())}",
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


@needs_claude
@pytest.mark.slow
def test_claude_posts_streamed_messages_to_its_provider_only(
    scripted: Start, trap: Trap, tmp_path: Path
) -> None:
    """Straight at the upstream: every request is a streamed POST /v1/messages?beta=true
    with the step's token as a bearer, the fix is its Bash tool's, and nothing goes anywhere
    else (no telemetry, update check or title request) though every proxy points at a trap."""
    upstream = scripted([{"text": "Fixing.", "shell": FIX}, {"text": "Fixed file.txt."}])
    work = _repo(tmp_path / "w")
    launch = preset.launch(Context("Fix file.txt", str(tmp_path / "p.txt"), "claude-scripted",
                                   str(work), 1))  # fmt: skip
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), **trap.env(),
           **launch.env, "ANTHROPIC_BASE_URL": upstream,
           "ANTHROPIC_AUTH_TOKEN": "tok-1"}  # fmt: skip
    done = subprocess.run(launch.argv, cwd=work, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=120, check=False)  # fmt: skip
    reader = preset.ClaudeReader()
    for line in done.stdout.splitlines():
        reader(line)
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
@pytest.mark.skipif(os.geteuid() != 0, reason="the refusal is of root only")
def test_as_root_it_needs_is_sandbox(tmp_path: Path) -> None:
    """Why the preset sets IS_SANDBOX=1: as root Claude Code refuses to skip permissions
    without it, before it sends any request."""
    launch = preset.launch(Context("hi", "/p.txt", "m", str(tmp_path), 1))
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), **launch.env,
           "ANTHROPIC_BASE_URL": "http://127.0.0.1:9", "ANTHROPIC_AUTH_TOKEN": "t"}  # fmt: skip
    del env["IS_SANDBOX"]
    done = subprocess.run(launch.argv, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 1
    assert "cannot be used with root/sudo privileges" in done.stderr


@pytest.fixture(params=[False, True], ids=["root", "step-user"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, StepUser | None]]:
    """Where a task's files go and who its steps run as: root (the suite's default, allowed
    by IS_SANDBOX) in tmp_path, or the step user, as in production, in a folder it can enter."""
    if not request.param:
        yield tmp_path, None
        return
    user = request.getfixturevalue("step_user")
    base = Path(tempfile.mkdtemp(prefix="overnight-claude-", dir="/tmp"))
    os.chmod(base, 0o711)
    yield base, user
    shutil.rmtree(base, ignore_errors=True)


@needs_claude
@pytest.mark.slow
def test_a_fix_by_claude_is_verified_and_every_request_charged(
    env: dict[str, str], scripted: Start, trap: Trap, where: tuple[Path, StepUser | None],
    r: redis.Redis, namespace: str,
) -> None:  # fmt: skip
    CallEnvelope(r, "default", namespace).reset(100)
    # git works in the worktree as the step user too (else "dubious ownership", exit 128).
    fix = f"git diff --quiet && {FIX}"
    upstream = scripted([{"text": "Fixing.", "shell": fix}, {"text": "Fixed file.txt."}])
    done = run_task(env, where[0], upstream, trap, "claude-fix", where[1])
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    sent = completions(upstream)
    assert len(sent) == 2 == charged(r, namespace, "claude-fix")
    # calls_used: each request, the one tool call the model asked for, one rule run.
    assert done["calls_used"] == len(sent) + 1 + 1
    assert trap.seen == []


@needs_claude
@pytest.mark.slow
def test_a_premature_stop_is_reprompted_with_the_unmet_rule(
    env: dict[str, str], scripted: Start, trap: Trap, tmp_path: Path, r: redis.Redis,
    namespace: str,
) -> None:  # fmt: skip
    CallEnvelope(r, "default", namespace).reset(100)
    upstream = scripted([{"text": "Shall I continue?"}, {"text": "Fixing.", "shell": FIX},
                         {"text": "Fixed file.txt."}])  # fmt: skip
    done = run_task(env, tmp_path, upstream, trap, "claude-early")
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert done["turns"] == 2, done
    sent = completions(upstream)
    assert len(sent) == 3 == charged(r, namespace, "claude-early")
    assert done["calls_used"] == len(sent) + 1 + 2  # one tool call, two rule runs
    first, second = (json.dumps(s["body"]["messages"]) for s in sent[:2])
    assert "says-fixed" not in first
    assert "says-fixed" in second and "sh check.sh" in second
