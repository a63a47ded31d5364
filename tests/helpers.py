"""Helpers shared by test modules (test modules never import from each other or from conftest):
polling with a deadline, process checks, the installed command, running ``overnight
supervise``, a stand-in model server, the scripted upstream and the gateway, task files and
a burst worker's run of one."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest
import redis

from overnight.coordinator.tasks.loop import CallRefused

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
OVERNIGHT = str(Path(sys.executable).with_name("overnight"))


def in_ci() -> bool:
    """True under CI (``CI=true``), where every capability the suite tests is expected."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def lacking(reason: str) -> NoReturn:
    """This machine lacks what the test needs: skip it locally, fail it in CI, where a
    skip would read as a pass."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: expected here, so this is a failure, not a skip)")
    pytest.skip(reason)


def capability(missing: str | None) -> pytest.MarkDecorator:
    """Mark a test as needing a capability; ``missing`` says why it is absent (None: present).
    tests/conftest.py's setup hook calls :func:`lacking` for it: a skip locally, a failure
    in CI."""
    return pytest.mark.capability(missing)


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {predicate}")
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` names a live process (zombies count as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def kill_quietly(pid: int, sig: int = 9) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def remove_demo_scratch(state: Path) -> None:
    """Remove the scratch folders the demos run with ``--state-dir state`` made in the temp
    folder (as root, where the step user could not enter ``state``), as ``make clean`` does."""
    import shutil

    for link in state.glob("demo/*/scratch"):
        if link.is_symlink():
            shutil.rmtree(os.readlink(link), ignore_errors=True)


# --- overnight supervise ---------------------------------------------------------------


def start(args: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen[str]:
    """Start ``overnight supervise ARGS`` in the background."""
    return subprocess.Popen(
        [OVERNIGHT, "supervise", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def supervise(
    args: list[str], env: dict[str, str], timeout: float = 30, **kw: Any
) -> tuple[int, dict[str, Any], str]:
    """Run ``overnight supervise ARGS``; returns (exit code, final document, child output)."""
    proc = start(args, env, **kw)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, final_doc(out), out + err


def final_doc(stdout: str) -> dict[str, Any]:
    """The lease document printed at the end of stdout (after the child's own output)."""
    at = stdout.rfind('{\n  "lease_id"')
    assert at >= 0, f"no lease document in {stdout!r}"
    doc: dict[str, Any] = json.loads(stdout[at:])
    return doc


def read_pids(path: Path, count: int, timeout: float = 10) -> list[int]:
    """Wait until ``path`` holds ``count`` PIDs (one a line) and return them."""

    def ready() -> list[int] | None:
        try:
            lines = path.read_text().split()
        except FileNotFoundError:
            return None
        return [int(x) for x in lines] if len(lines) >= count else None

    return wait_for(ready, timeout=timeout)


def _nspid(pid: str) -> list[int]:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    return []


def host_pids(inner: list[int], cwd: Path, timeout: float = 10) -> list[int]:
    """The pids, as this host numbers them, of the processes a step wrote down as ``inner``
    (``os.getpid()`` inside a sandbox is its own pid namespace's number), the first of which
    works in ``cwd``. Pids of a step without a pid namespace are returned as they are."""
    want = os.path.realpath(cwd)

    def found() -> list[int] | None:
        ours: str | None = None
        mapped: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                chain = _nspid(entry)
                if not chain or chain[-1] != inner[0] or os.readlink(f"/proc/{entry}/cwd") != want:
                    continue
                if len(chain) == 1:
                    return inner
                ours = os.readlink(f"/proc/{entry}/ns/pid")
            except OSError:
                continue
            mapped[inner[0]] = int(entry)
            break
        if ours is None:
            return None
        for entry in os.listdir("/proc"):
            with contextlib.suppress(OSError):
                chain = _nspid(entry) if entry.isdigit() else []
                if chain and chain[-1] in inner and os.readlink(f"/proc/{entry}/ns/pid") == ours:
                    mapped[chain[-1]] = int(entry)
        return [mapped[p] for p in inner] if len(mapped) == len(set(inner)) else None

    return wait_for(found, timeout=timeout)


def working_in(cwd: Path) -> list[int]:
    """The pids of every process whose working folder is ``cwd`` (a sandboxed step's too)."""
    want = os.path.realpath(cwd)
    found = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and os.readlink(f"/proc/{entry}/cwd") == want:
                found.append(int(entry))
    return found


def assert_all_gone(pids: list[int], timeout: float = 5) -> None:
    try:
        wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=timeout)
    finally:
        for pid in pids:
            kill_quietly(pid)
    assert not any(pid_alive(p) for p in pids)


# --- a stand-in OpenAI-compatible model server --------------------------------------------


class Model:
    """A tiny OpenAI-compatible server: mode is "ok", "500" or "hang"."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.requests: list[dict[str, Any]] = []
        self.release = threading.Event()
        model = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                model.requests.append(
                    {"path": self.path, "auth": self.headers.get("Authorization"), "body": body}
                )
                if model.mode == "hang":
                    model.release.wait(30)
                    return
                if model.mode == "500":
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b'{"error": "boom"}')
                    return
                answer = {"choices": [{"message": {"role": "assistant", "content": "ANSWER-42"}}]}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Model:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


# --- the scripted upstream and the gateway ------------------------------------------------

UPSTREAM = Path(__file__).with_name("scripted_upstream.py")


@contextlib.contextmanager
def scripted_upstream(*args: str) -> Iterator[str]:
    """Run tests/scripted_upstream.py with ARGS (such as ``--script FILE``); yields its URL."""
    proc = subprocess.Popen(
        [sys.executable, str(UPSTREAM), *args], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    try:
        yield f"http://127.0.0.1:{proc.stdout.readline().split()[1]}"
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()


def seen(url: str) -> list[dict[str, Any]]:
    """Every request the scripted upstream at ``url`` got, in order."""
    with urllib.request.urlopen(f"{url}/_seen", timeout=10) as answer:
        got: list[dict[str, Any]] = json.load(answer)
    return got


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def run_gateway(env: dict[str, str], folder: Path, port: int = 0) -> Iterator[str]:
    """Run ``overnight gateway`` on ``port`` (0: a free one), its log in ``folder``; yields
    its URL once it listens."""
    log = folder / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([OVERNIGHT, "gateway", "--port", str(port)], env=env, stderr=out)

    def listening() -> str:
        text = log.read_text()
        return text.split("listening on ")[1].split()[0] if "listening on " in text else ""

    try:
        yield wait_for(listening, timeout=20)
    finally:
        proc.terminate()
        proc.wait(10)


def worker_env(env: dict[str, str], **more: str) -> dict[str, str]:
    """``env`` for an ``overnight worker`` of this test's namespace, quick to give up on a
    step, with a gateway of its own on a free port; plus MORE (such as the model's URL)."""
    return {
        **env,
        "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"],
        "OVERNIGHT_GRACE": "0.5",
        "OVERNIGHT_GATEWAY_PORT": str(free_port()),
        **more,
    }


# --- task files ----------------------------------------------------------------------------


def task_file(
    directory: Path, name: str, agent: list[str] | None, rules: list[list[str]], **kw: Any
) -> Path:
    lines = [f"id = {json.dumps(name)}", 'assignment = "Create ok.txt in the work directory."']
    if agent is not None:
        lines.append(f"agent = {json.dumps(agent)}")
    kw.setdefault("max_calls", 10)
    kw.setdefault("heartbeat_gap", 5)
    for key, value in kw.items():
        lines.append(f"{key} = {json.dumps(value)}")
    for i, run in enumerate(rules):
        lines += ["[[verifier]]", f'name = "rule-{i}"', f"run = {json.dumps(run)}"]
    workdir = directory / name
    workdir.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.toml"
    path.write_text("\n".join([*lines[:2], f'workdir = "{name}"', *lines[2:]]) + "\n")
    return path


def cli(env: dict[str, str], *args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def run_burst(env: dict[str, str], path: Path, name: str) -> dict[str, Any]:
    """Submit the task file at ``path``, run one burst worker, return task ``name``'s status."""
    submitted = cli(env, "submit", str(path))
    assert submitted.returncode == 0, submitted.stderr
    worked = cli(env, "worker", "--burst")
    assert worked.returncode == 0, worked.stderr[-3000:]
    shown = cli(env, "status", name)
    assert shown.returncode == 0, shown.stderr
    data: dict[str, Any] = json.loads(shown.stdout)
    return data


# --- folders that would shadow our modules ----------------------------------------------

# Every name the project's layers had (or have) as top-level imports; each file raises if
# it is ever imported, so a run from such a folder proves the working folder is never on
# the import path of any interpreter we start.
SHADOWS = (
    "config.py",
    "worker.py",
    "overnight.py",
    "coordinator/__init__.py",
    "config/settings/__init__.py",
)


def plant_shadows(folder: Path) -> Path:
    """Fill ``folder`` with modules named like ours that raise when imported; return it."""
    for name in SHADOWS:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"raise RuntimeError('shadowed: {name} imported from {folder}')\n")
    return folder


# --- a Redis at maxmemory -----------------------------------------------------------


def fill_redis(client: redis.Redis) -> int:
    """Write values (big, then small: Redis counts a command's own size against the limit)
    until Redis refuses even a small write (OOM); returns how many were written."""
    n, fill = 0, uuid.uuid4().hex[:8]  # new names each time: overwriting frees nothing
    for size in (262_144, 4096, 64):
        chunk = b"x" * size
        while True:
            try:
                client.set(f"filler:{fill}:{n}", chunk)
            except redis.exceptions.OutOfMemoryError:
                break
            n += 1
            assert n < 100_000, "Redis never refused a write: maxmemory not in force"
    return n


def hold_full(client: redis.Redis, refusals: int, until: Callable[[], bool] = lambda: True) -> None:
    """Fill Redis, keep it full until it refused ``refusals`` probes (about 50 ms apart) and
    ``until()`` holds, then free it."""
    fill_redis(client)
    seen = {"n": 0}

    def refused_enough() -> bool:
        try:
            client.set("probe", b"x")
        except redis.exceptions.OutOfMemoryError:
            seen["n"] += 1
        else:  # something freed memory meanwhile (a key expired): fill again
            client.delete("probe")
            fill_redis(client)
        return seen["n"] >= refusals and until()

    wait_for(refused_enough, timeout=60, interval=0.05)
    for key in client.scan_iter("filler:*", count=1000):
        client.delete(key)


class Budget:
    """A stand-in for the shared envelope: n units, idempotent per request id."""

    def __init__(self, n: int) -> None:
        self.remaining = n
        self.seen: set[str] = set()

    def __call__(self, name: str, kind: str, request_id: str) -> None:
        if request_id in self.seen:
            return
        if self.remaining <= 0:
            raise CallRefused("envelope", f"envelope {name!r} empty; refused {kind} call")
        self.remaining -= 1
        self.seen.add(request_id)


# An agent: sends N chat requests through the gateway its environment names (retrying a
# gateway that is still starting), counts the answers, writes ok.txt, then waits.
GATEWAY_AGENT = textwrap.dedent("""
    import json, os, sys, time, urllib.request, urllib.error
    times, wait = int(sys.argv[1]), float(sys.argv[2])
    answered = 0
    for _ in range(times):
        req = urllib.request.Request(
            os.environ["OPENAI_BASE_URL"] + "/chat/completions",
            data=json.dumps({"model": "m", "messages": []}).encode(),
            headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                     "Content-Type": "application/json"})
        for _ in range(100):
            try:
                urllib.request.urlopen(req, timeout=30).read()
                answered += 1
                break
            except urllib.error.HTTPError:
                break
            except urllib.error.URLError:
                time.sleep(0.1)
    print(f"answered {answered}", flush=True)
    open("ok.txt", "w").write("ok")
    time.sleep(wait)
""")
