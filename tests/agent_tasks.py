"""Pieces of the agent CLI tests (tests/test_agent_*.py): a proxy that traps any traffic but
the model's, scripted upstreams playing turns, a repository with a bug and the rule that
finds it, the CLI run straight at the upstream or as a task's agent by one burst worker, and
what a task was charged. The fixtures (``trap``, ``scripted``, ``bench``, ``where``) are
imported by the modules that use them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from overnight.config.keys import Keys
from overnight.coordinator.agents import Launch
from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.redisio.receipts import read
from overnight.worker.sandbox.stepuser import StepUser
from tests.helpers import run_burst, scripted_upstream, seen, wait_for, worker_env

COMPLETIONS = ("/v1/responses", "/v1/chat/completions", "/v1/messages")
FIX = "sed -i s/broken/fixed/ file.txt"
ASSIGNMENT = "file.txt says broken; make it say fixed."
# The rule names its script, not file.txt: a file a rule names is protected from the agent.
RULE = ["sh", "check.sh"]
PATH = "/usr/local/bin:/usr/bin:/bin"


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
        proxy = dict.fromkeys(
            ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "ALL_PROXY", "all_proxy"),
            self.url,
        )
        return {**proxy, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


class Scripted:
    """Starts scripted upstreams: ``scripted(turns)`` plays the turns, one a completion
    request (with ``count="tools"`` a request offering no tools, such as a title, uses
    none), and returns the upstream's URL."""

    def __init__(self, folder: Path, stack: contextlib.ExitStack) -> None:
        self.folder, self.stack, self.started = folder, stack, 0

    def __call__(self, turns: list[dict[str, Any]], count: str = "all") -> str:
        script = self.folder / f"script-{self.started}.json"
        script.write_text(json.dumps({"turns": turns, "count": count}))
        self.started += 1
        return self.stack.enter_context(scripted_upstream("--script", str(script)))


def completions(upstream: str) -> list[dict[str, Any]]:
    return [s for s in seen(upstream) if s["path"] in COMPLETIONS]


def prompt_text(request: dict[str, Any]) -> str:
    """What a completion request told the model: its messages, or a Responses input."""
    body = request["body"]
    return json.dumps(body["input"] if "input" in body else body["messages"])


def repo(path: Path) -> Path:
    """A git repository whose file.txt says broken, and check.sh that fails until fixed."""
    path.mkdir()
    (path / "file.txt").write_text("broken\n")
    (path / "check.sh").write_text("grep -q fixed file.txt\n")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    for args in (["init", "-q", "."], ["add", "."], ["commit", "-qm", "a bug"]):
        subprocess.run([*git, *args], cwd=path, check=True, timeout=30)
    return path


def home(folder: Path, launch: Launch) -> Path:
    """A HOME in ``folder`` holding the files the launch asks for."""
    path = folder / "home"
    path.mkdir()
    for rel, text in launch.home_files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    return path


def run_direct(
    launch: Launch, work: Path, env: dict[str, str], reader: Callable[[bytes], None]
) -> subprocess.CompletedProcess[bytes]:
    """Run the launch's CLI in ``work`` with only ``env``, as a step would but with no
    gateway or supervisor; feed ``reader`` each line it printed."""
    done = subprocess.run(
        launch.argv,
        cwd=work,
        env={"PATH": PATH, **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
        check=False,
    )
    for line in done.stdout.splitlines():
        reader(line)
    return done


# A provider address the trap's NO_PROXY does not list and nothing listens at: a CLI that
# honours the proxy variables sends its request there through the trap; one that ignores
# them is refused and the trap sees nothing.
OFF_LIST = "http://127.0.0.2:9"


def run_until_trapped(launch: Launch, work: Path, env: dict[str, str], trap: Trap) -> list[str]:
    """Run the launch's CLI as :func:`run_direct` does until the trap got a connection or the
    CLI ended (then end it); returns what the trap saw. Fails, with the CLI's output, if it
    sent the trap nothing."""
    log = work.parent / "cli.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            launch.argv,
            cwd=work,
            env={"PATH": PATH, **env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    try:
        with contextlib.suppress(AssertionError):
            wait_for(lambda: trap.seen or proc.poll() is not None, timeout=120)
            wait_for(lambda: trap.seen, timeout=2)  # a connection made just before it ended
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert trap.seen, log.read_text(errors="replace")[-3000:]
    return list(trap.seen)


def _inline(table: dict[str, str]) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + "}"


@dataclass
class Bench:
    """A task test's Redis, namespace and environment, its folder, trap and upstreams."""

    r: redis.Redis
    namespace: str
    env: dict[str, str]
    folder: Path
    trap: Trap
    scripted: Scripted

    def run(
        self,
        upstream: str,
        name: str,
        *,
        agent: str,
        model: str = "scripted",
        max_calls: int = 10,
        folder: Path | None = None,
        user: StepUser | None = None,
        url_var: str = "OVERNIGHT_MODEL_URL",
        **keys: Any,
    ) -> dict[str, Any]:
        """Give the envelope 100 units; submit a task on a repository with a bug (``name``
        in ``folder``, else the test's) whose agent is ``agent`` with ``model`` at
        ``upstream`` (``url_var`` names it for the gateway), its env pointing every proxy at
        the trap, plus task KEYS; run one burst worker (its steps as ``user``, or as the
        suite's default, root); return the task's status."""
        CallEnvelope(self.r, "default", self.namespace).reset(100)
        folder = folder or self.folder
        repo(folder / name)
        env = self.env if user is None else {**self.env, "OVERNIGHT_STEP_USER": user.name}
        tenv = worker_env(
            env,
            **{url_var: upstream},
            OVERNIGHT_STATE_DIR=str(folder / "state"),
            OVERNIGHT_LOG_DIR=str(folder / "logs"),
        )
        lines = [
            f"id = {json.dumps(name)}",
            f"workdir = {json.dumps(name)}",
            f"assignment = {json.dumps(ASSIGNMENT)}",
            f"agent = {json.dumps(agent)}",
            f"model = {json.dumps(model)}",
            f"max_calls = {max_calls}",
            f"env = {_inline(self.trap.env())}",
        ]
        lines += [f"{key} = {json.dumps(value)}" for key, value in keys.items()]
        lines += ["[[verifier]]", 'name = "says-fixed"', f"run = {json.dumps(RULE)}"]
        path = folder / f"{name}.toml"
        path.write_text("\n".join(lines) + "\n")
        return run_burst(tenv, path, name)

    def charged(self, task: str) -> int:
        """Model requests charged to ``task``: its receipts, and the envelope's model units
        (each test has an envelope of its own)."""
        receipts = read(self.r, Keys(self.namespace), task_id=task)
        calls = sum(1 for rc in receipts if rc.kind == "model_call")
        assert CallEnvelope(self.r, "default", self.namespace).snapshot().consumed_model == calls
        return calls

    def agent_said(self, task: str) -> list[tuple[str, bool]]:
        """What the reader made of each agent step of ``task``, in order."""
        return [
            (rc.data["agent_said"], rc.data["agent_ok"])
            for rc in read(self.r, Keys(self.namespace), task_id=task)
            if rc.kind == "step_finished" and rc.data.get("step") == "agent"
        ]
