"""Tasks whose steps run sandboxed (OVERNIGHT_SANDBOX=bwrap) under `overnight worker`: the
built-in model step runs there, an agent reaches this host's gateway through the bridge (each
request metered), and its verifier rule runs sandboxed too (bwrap's host name proves where)."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis

from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.sandbox import launch
from tests.helpers import GATEWAY_AGENT, capability, run_burst, task_file, worker_env

needs_bwrap = capability(None if launch.find_bwrap() else "bubblewrap is not installed")
pytestmark = [needs_bwrap]
INSIDE = "overnight-sandbox"  # bwrap's --hostname


@pytest.fixture
def tenv(env: dict[str, str], upstream: str) -> dict[str, str]:
    return worker_env(env, OVERNIGHT_MODEL_URL=upstream, OVERNIGHT_SANDBOX="bwrap")


@pytest.mark.parametrize("sandbox", ["bwrap", "off"])
def test_the_model_step_runs_sandboxed(
    tenv: dict[str, str], tmp_path: Path, r: redis.Redis, namespace: str, sandbox: str
) -> None:
    CallEnvelope(r, "default", namespace).reset(10)
    path = task_file(tmp_path, "model", None, [["test", "-f", "out/answer.md"]])
    done = run_burst({**tenv, "OVERNIGHT_SANDBOX": sandbox}, path, "model")
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-4000:]


def test_an_agent_reaches_the_gateway_through_the_bridge(
    tenv: dict[str, str], tmp_path: Path, r: redis.Redis, namespace: str
) -> None:
    envelope = CallEnvelope(r, "default", namespace)
    envelope.reset(100)
    (tmp_path / "three").mkdir()
    (tmp_path / "three" / "agent.py").write_text(
        GATEWAY_AGENT.replace(
            'open("ok.txt", "w").write("ok")', 'open("ok.txt", "w").write(os.uname()[1])'
        )
    )
    agent = [sys.executable, "agent.py", "3", "0"]
    rule = ["sh", "-c", f'grep -qx {INSIDE} ok.txt && test "$(hostname)" = {INSIDE}']
    path = task_file(tmp_path, "three", agent, [rule], workspace="in-place")
    done = run_burst(tenv, path, "three")
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-4000:]
    assert (tmp_path / "three" / "ok.txt").read_text() == INSIDE
    assert done["calls_used"] == 3 + 1  # three model requests through the bridge, one rule
    assert envelope.snapshot().consumed_model == 3


def test_a_worktree_task_in_a_subfolder_is_fixed_and_verified_sandboxed(
    tenv: dict[str, str], tmp_path: Path, r: redis.Redis, namespace: str
) -> None:
    """The agent edits its worktree above its folder; the rule, in the fresh checkout's same
    subfolder, reads the checkout's root: both sandboxes hold the whole tree."""
    CallEnvelope(r, "default", namespace).reset(20)
    repo = tmp_path / "proj"
    (repo / "sub").mkdir(parents=True)
    (repo / "file.txt").write_text("broken\n")
    (repo / "sub" / "check.sh").write_text(
        f'grep -q fixed ../file.txt && test "$(hostname)" = {INSIDE}\n'
    )
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    for args in (["init", "-q", "."], ["add", "."], ["commit", "-qm", "a bug"]):
        subprocess.run([*git, *args], cwd=repo, check=True, timeout=30)
    agent = ["sh", "-c", "git status --short && sed -i s/broken/fixed/ ../file.txt"]
    lines = [
        'id = "sub"',
        'workdir = "proj/sub"',
        'assignment = "Fix file.txt."',
        f"agent = {json.dumps(agent)}",
        "max_calls = 10",
        "heartbeat_gap = 5",
        "[[verifier]]",
        'name = "fixed"',
        'run = ["sh", "check.sh"]',
    ]
    path = tmp_path / "sub.toml"
    path.write_text("\n".join(lines) + "\n")
    done = run_burst({**tenv, "OVERNIGHT_STATE_DIR": str(tmp_path / "state")}, path, "sub")
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-4000:]
    assert done["workspace"] == "worktree" and done["diffstat"], done


@pytest.mark.parametrize(("value", "ok"), [("none", True), ("host", True), ("bridge", False)])
def test_the_network_key(value: str, ok: bool) -> None:
    from pydantic import ValidationError

    from overnight.coordinator.tasks.taskfile import TaskSpec

    data = {"assignment": "x", "verifier": [{"name": "r", "run": ["true"]}], "network": value}
    if ok:
        assert TaskSpec.model_validate(data).network == value
    else:
        with pytest.raises(ValidationError):
            TaskSpec.model_validate(data)


PROBE = (
    "import socket, sys\n"
    "try:\n"
    "    s = socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5)\n"
    "    out = 'REACHED ' + s.recv(16).decode()\n"
    "except OSError as e:\n"
    "    out = 'REFUSED'\n"
    "open('out.txt', 'w').write(out)\n"
)


@pytest.mark.parametrize(("network", "seen"), [("none", "REFUSED"), ("host", "REACHED HELLO")])
def test_network_host_is_the_tasks_explicit_opt_out(
    tenv: dict[str, str], tmp_path: Path, r: redis.Redis, namespace: str, network: str, seen: str
) -> None:
    """A server on the host's loopback: the agent of a task with ``network = "host"`` reaches
    it (and its log says the step shared the host's network); with the default it cannot."""
    CallEnvelope(r, "default", namespace).reset(20)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                conn.sendall(b"HELLO")
                conn.close()

    threading.Thread(target=answer, daemon=True).start()
    try:
        (tmp_path / "net").mkdir()
        (tmp_path / "net" / "probe.py").write_text(PROBE)
        agent = [sys.executable, "probe.py", str(port)]
        rule = ["grep", "-qx", seen, "out.txt"]
        path = task_file(tmp_path, "net", agent, [rule], workspace="in-place", network=network)
        done = run_burst(tenv, path, "net")
    finally:
        server.close()
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-4000:]
    assert (tmp_path / "net" / "out.txt").read_text() == seen
    said = "network = host: the step shares the host's network"
    logs = [Path(s["log"]).read_text() for s in done["steps"] if s["log"]]
    assert any(said in text for text in logs) is (network == "host"), logs
