"""The mini-swe-agent preset: ``mini`` run as a task's agent, through this host's gateway,
against the scripted upstream. Every request it sends is one model unit; it posts plain chat
completions to its base URL and nothing anywhere else; a run it ends early is re-prompted; a
30 s model wait with a 5 s gap does not kill it, nor does its silent start-up. The reader's
account of a run and the start-up hook's pure parts are tables."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.agents import Context, Said
from overnight.coordinator.agents import mini as preset
from overnight.worker.envelope import CallEnvelope
from overnight.worker.receipts import read
from tests.helpers import OVERNIGHT, ROOT

UPSTREAM = Path(__file__).with_name("scripted_upstream.py")
MINI = shutil.which("mini")
needs_mini = pytest.mark.skipif(MINI is None, reason="mini is not installed")
COMPLETIONS = ("/v1/responses", "/v1/chat/completions", "/v1/messages")
FIX = "sed -i s/broken/fixed/ file.txt"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# The rule names its script, not file.txt: a file a rule names is protected from the agent.
RULE = ["sh", "check.sh"]


def _outcome(**kw: Any) -> bytes:
    return json.dumps({preset.KEY: kw}).encode() + b"\n"


SUBMITTED = _outcome(exit_status="Submitted", api_calls=2, cost=0.0, submission="", exception="")


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        ([], None),
        ([b"This is mini-swe-agent version 2.4.6.", b'{"returncode": 0, "output": ""}'], None),
        ([SUBMITTED], Said(True, "Submitted after 2 model calls")),
        ([_outcome(exit_status="Submitted", api_calls=1)],
         Said(True, "Submitted after 1 model call")),
        ([_outcome(exit_status="LimitsExceeded", api_calls=5, exception="")],
         Said(False, "LimitsExceeded after 5 model calls")),
        ([_outcome(exit_status="RepeatedFormatError", api_calls=3)],
         Said(False, "RepeatedFormatError after 3 model calls")),
        ([_outcome(exit_status="RuntimeError", api_calls=1, exception="Global\ncost limit")],
         Said(False, "RuntimeError after 1 model call: Global cost limit")),
        ([_outcome(exit_status=None)], Said(False, "mini-swe-agent wrote no trajectory")),
        # The hook's line comes last; one a command printed earlier does not count.
        ([_outcome(exit_status="Submitted", api_calls=9), b"{not json",
          _outcome(exit_status="TimeExceeded", api_calls=4)],
         Said(False, "TimeExceeded after 4 model calls")),
    ],
)  # fmt: skip
def test_the_reader_takes_the_hooks_outcome(lines: list[bytes], said: Said | None) -> None:
    reader = preset.MiniReader()
    for line in lines:
        reader(line)
    assert reader.said() == said


@pytest.mark.parametrize(
    ("model", "arg"),
    [("gpt-4o-mini", "openai/gpt-4o-mini"), ("Qwen/Qwen2.5-Coder", "openai/Qwen/Qwen2.5-Coder"),
     ("openai/x", "openai/openai/x")],
)  # fmt: skip
def test_litellm_is_asked_for_the_model_name_exactly(model: str, arg: str) -> None:
    assert preset.model_arg(model) == arg


def test_launch_runs_mini_itself_headless_with_its_hook() -> None:
    launch = preset.launch(Context("fix it", "/p/prompt.txt", "m", "/w", 1, "http://gw"))
    assert launch.argv == ["mini", "--yolo", "--exit-immediately", "--cost-limit", "0",
                           "--model", "openai/m", "--task", "fix it"]  # fmt: skip
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
    path.write_text(json.dumps({
        "info": {"exit_status": "RuntimeError", "submission": "",
                 "model_stats": {"api_calls": 3, "instance_cost": 0.0}},
        "messages": [{"role": "exit", "extra": {"exception_str": "boom"}}]}))  # fmt: skip
    assert outcome(str(path)) == {"exit_status": "RuntimeError", "api_calls": 3, "cost": 0.0,
                                  "submission": "", "exception": "boom"}  # fmt: skip
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
    named = subprocess.run([sys.executable, "-c", preset.PTH_LINE + after], capture_output=True,
                           text=True, timeout=30, check=True, env={**env, **hook})  # fmt: skip
    assert named.stdout == "hook as overnight_mini_hook\nleft: None\n"
    unnamed = subprocess.run([sys.executable, "-c", preset.PTH_LINE + after], capture_output=True,
                             text=True, timeout=30, check=True, env=env)  # fmt: skip
    assert unnamed.stdout == "left: None\n"


def test_the_install_script_pins_the_version_and_writes_the_pth_line() -> None:
    script = (ROOT / ".ci" / "agents" / "mini-swe-agent.sh").read_text()
    assert f"version={preset.VERSION}\n" in script
    assert f"pth_line='{preset.PTH_LINE}'\n" in script
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


def _cli(
    tenv: dict[str, str], *args: str, timeout: float = 150
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([OVERNIGHT, *args], env=tenv, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def _inline(table: dict[str, str]) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + "}"


def run_task(r: redis.Redis, env: dict[str, str], tmp_path: Path, upstream: str, trap: Trap,
             name: str, **kw: Any) -> dict[str, Any]:  # fmt: skip
    """Submit a task whose agent is mini-swe-agent, run one burst worker, return its status."""
    CallEnvelope(r, "default", env["OVERNIGHT_NAMESPACE"]).reset(100)
    _repo(tmp_path / name)
    tenv = {**env, "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"], "OVERNIGHT_GRACE": "0.5",
            "OVERNIGHT_MODEL_URL": upstream, "OVERNIGHT_GATEWAY_PORT": str(_free_port()),
            "OVERNIGHT_STATE_DIR": str(tmp_path / "state"),
            "OVERNIGHT_LOG_DIR": str(tmp_path / "logs")}  # fmt: skip
    lines = [f"id = {json.dumps(name)}", f"workdir = {json.dumps(name)}",
             'assignment = "file.txt says broken; make it say fixed."',
             'agent = "mini-swe-agent"', 'model = "scripted"', "max_calls = 20",
             f"env = {_inline(trap.env())}"]  # fmt: skip
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


def charged(r: redis.Redis, namespace: str, task: str) -> int:
    """Model requests charged to ``task``: its receipts, and the envelope's model units
    (each test has an envelope of its own)."""
    calls = sum(1 for rc in read(r, Keys(namespace), task_id=task) if rc.kind == "model_call")
    assert CallEnvelope(r, "default", namespace).snapshot().consumed_model == calls
    return calls


def agent_said(r: redis.Redis, namespace: str, task: str) -> list[tuple[str, bool]]:
    """What the reader made of each agent step of ``task``, in order."""
    return [(rc.data["agent_said"], rc.data["agent_ok"])
            for rc in read(r, Keys(namespace), task_id=task)
            if rc.kind == "step_finished" and rc.data.get("step") == "agent"]  # fmt: skip


def _text(request: dict[str, Any]) -> str:
    return json.dumps(request["body"].get("messages"))


@needs_mini
@pytest.mark.slow
def test_mini_posts_chat_completions_to_its_base_url_only(
    scripted: Start, trap: Trap, tmp_path: Path
) -> None:
    """Straight at the upstream: every request mini sends is an unstreamed POST
    /v1/chat/completions with the step's key and the bash tool, and nothing goes anywhere
    else (no cost map or tokenizer fetched), though every proxy variable points at a trap.
    Its start-up hook (run by the .pth line the install script wrote) says it is alive and
    prints the outcome, Submitted; the commands mini runs do not see the hook's variable."""
    fix = f"{FIX}; printenv OVERNIGHT_MINI_HOOK > hook.txt; true"
    upstream = scripted([{"text": "Fixing.", "shell": fix}, {"text": "Done.", "shell": SUBMIT}])
    work = _repo(tmp_path / "w")
    launch = preset.launch(Context("Fix file.txt", str(tmp_path / "p.txt"), "scripted",
                                   str(work), 1))  # fmt: skip
    home = tmp_path / "home"
    for rel, text in launch.home_files.items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text(text)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), **trap.env(),
           "OPENAI_BASE_URL": f"{upstream}/v1", "OPENAI_API_BASE": f"{upstream}/v1",
           "OPENAI_API_KEY": "tok-1", **launch.env}  # fmt: skip
    done = subprocess.run(launch.argv, cwd=work, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=120, check=False)  # fmt: skip
    out = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
    reader = preset.MiniReader()
    for line in done.stdout.splitlines():
        reader(line)
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
    assert "Fix file.txt" in _text(everything[0])
    assert trap.seen == []


@needs_mini
@pytest.mark.slow
def test_a_fix_by_mini_is_verified_and_every_request_charged(
    env: dict[str, str], scripted: Start, trap: Trap, tmp_path: Path, r: redis.Redis,
    namespace: str,
) -> None:  # fmt: skip
    upstream = scripted([{"text": "Fixing.", "shell": FIX}, {"text": "Done.", "shell": SUBMIT}])
    done = run_task(r, env, tmp_path, upstream, trap, "mini-fix")
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert done["turns"] == 1, done
    sent = completions(upstream)
    assert len(sent) == 2 == charged(r, namespace, "mini-fix")
    # calls_used: each request, each tool call the model asked for (2), one rule run.
    assert done["calls_used"] == len(sent) + 2 + 1
    assert agent_said(r, namespace, "mini-fix") == [("Submitted after 2 model calls", True)]
    assert trap.seen == []


@needs_mini
@pytest.mark.slow
def test_a_premature_stop_is_reprompted_with_the_unmet_rule(
    env: dict[str, str], scripted: Start, trap: Trap, tmp_path: Path, r: redis.Redis,
    namespace: str,
) -> None:  # fmt: skip
    """A reply without a command is a format error mini sends back; after three in a row it
    stops (RepeatedFormatError, exit 0). The rule fails, and the next turn's prompt names it."""
    ask = {"text": "Shall I continue?"}
    upstream = scripted([ask, ask, ask, {"text": "Fixing.", "shell": FIX},
                         {"text": "Done.", "shell": SUBMIT}])  # fmt: skip
    done = run_task(r, env, tmp_path, upstream, trap, "mini-early")
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert done["turns"] == 2, done
    sent = completions(upstream)
    assert len(sent) == 5 == charged(r, namespace, "mini-early")
    assert done["calls_used"] == len(sent) + 2 + 2  # two tool calls, two rule runs
    assert agent_said(r, namespace, "mini-early") == [
        ("RepeatedFormatError after 3 model calls", False),
        ("Submitted after 2 model calls", True),
    ]
    assert "says-fixed" not in _text(sent[0])
    assert "says-fixed" in _text(sent[3]) and "sh check.sh" in _text(sent[3])


@needs_mini
@pytest.mark.slow
def test_a_30s_model_wait_does_not_kill_the_step(
    env: dict[str, str], scripted: Start, trap: Trap, tmp_path: Path, r: redis.Redis,
    namespace: str,
) -> None:  # fmt: skip
    """A 5 s gap: mini's start-up (litellm's import) is covered by the hook's lines, the
    30 s answer by the gateway's beats while the request is in flight."""
    upstream = scripted([{"text": "Fixing.", "shell": FIX, "delay": 30},
                         {"text": "Done.", "shell": SUBMIT}])  # fmt: skip
    done = run_task(r, env, tmp_path, upstream, trap, "mini-slow", heartbeat_gap=5)
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-6000:]
    assert done["turns"] == 1, done
    assert len(completions(upstream)) == 2 == charged(r, namespace, "mini-slow")
