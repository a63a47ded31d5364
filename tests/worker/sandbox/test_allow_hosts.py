"""A task's ``allow_hosts`` for real: a far host (a network namespace made here, joined to
this one by a veth pair on a private 10.233.K.0/30 link) serves HTTP; a sandboxed step
reaches it through its proxy only when the host is listed, gets 403 for anything else
(each refusal said in its output and overnight's log), and cannot reach it directly.

Every connection goes to an address of a namespace this module made, or to this host's
loopback; a refused name is refused before it is resolved.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.report.logs import print_logs
from overnight.coordinator.tasks.steps import OutputCapture
from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.sandbox import launch
from overnight.worker.sandbox.stepuser import StepUser
from overnight.worker.supervise.supervisor import StepSpec, run_supervised
from tests.helpers import capability, cli, run_burst, task_file, wait_for, worker_env
from tests.hosts import namespaces_refused

PY3 = "/usr/bin/python3"
pytestmark = [
    capability(None if launch.find_bwrap() else "bubblewrap is not installed"),
    capability(None if os.access(PY3, os.X_OK) else "no system python3"),
    capability(namespaces_refused()),
]
PORT, OTHER = 8080, 8081

SERVER = """
import http.server, socketserver, sys, threading
class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("HELLO-FROM-FAR-HOST %d" % self.server.server_address[1]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
servers = [http.server.ThreadingHTTPServer((sys.argv[1], int(p)), Hello) for p in sys.argv[2:]]
for s in servers[1:]:
    threading.Thread(target=s.serve_forever, daemon=True).start()
servers[0].serve_forever()
"""

# What a step tries, each on its own line: a plain-HTTP GET and a CONNECT tunnel through
# the proxy its environment names, a CONNECT to an unlisted port, to an unlisted name and
# to a listed name that resolves to loopback, and a connection that ignores the proxy.
STEP = """
import http.client, os, socket, sys, urllib.parse, urllib.request
host, port, other, loop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
proxy = os.environ.get("HTTPS_PROXY")

def tunnel(to, to_port):
    if proxy is None:
        return "NO-PROXY-ENV"
    where = urllib.parse.urlsplit(proxy)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=10)
    conn.set_tunnel(to, to_port)
    conn.request("GET", "/")
    return conn.getresponse().read().decode()

def get():
    return urllib.request.urlopen("http://%s:%d/" % (host, port), timeout=10).read().decode()

def direct():
    socket.create_connection((host, port), timeout=5).close()
    return "CONNECTED"

tries = {
    "GET": get,
    "CONNECT": lambda: tunnel(host, port),
    "OTHER-PORT": lambda: tunnel(host, other),
    "NAME": lambda: tunnel("unlisted.example.com", 443),
    "LOOPBACK": lambda: tunnel("localhost", loop),
    "DIRECT": direct,
}
for name, attempt in tries.items():
    try:
        print(name + ":", attempt(), flush=True)
    except Exception as exc:
        print(name + ": FAILED", type(exc).__name__, exc, flush=True)
"""


@dataclass
class FarHost:
    address: str
    netns: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def far() -> Iterator[FarHost]:
    """A namespace with an HTTP server on PORT and OTHER, linked to this one by a veth pair."""
    tag = secrets.token_hex(3)
    netns, here, there = f"ovnpx{tag}", f"ovpx{tag}a", f"ovpx{tag}b"
    k = secrets.randbelow(250) + 1
    near, address = f"10.233.{k}.1", f"10.233.{k}.2"
    server = None
    try:
        _ip("netns", "add", netns)
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", netns)
        _ip("addr", "add", f"{near}/30", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", netns, "addr", "add", f"{address}/30", "dev", there)
        _ip("-n", netns, "link", "set", there, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        server = subprocess.Popen(
            ["ip", "netns", "exec", netns, PY3, "-c", SERVER, address, str(PORT), str(OTHER)]
        )

        def answers() -> bool:
            try:
                socket.create_connection((address, PORT), timeout=1).close()
            except OSError:
                return False
            return True

        wait_for(answers, timeout=20, interval=0.1)
        yield FarHost(address, netns)
    finally:
        if server is not None:
            server.kill()
            server.wait(timeout=20)
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=20)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=20)


@pytest.fixture
def loopback_server() -> Iterator[int]:
    """A server on this host's loopback (where a name resolving to 127.0.0.1 would lead)."""
    server = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b"HTTP/1.0 200 OK\r\n\r\nLOOPBACK-SERVICE")
            conn.close()

    threading.Thread(target=answer, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


@pytest.fixture(params=["step-user", "root"])
def who(request: pytest.FixtureRequest, step_user: StepUser) -> StepUser | None:
    return step_user if request.param == "step-user" else None


def run_step(
    r: redis.Redis, namespace: str, tmp: Path, who: StepUser | None, allow: list[str], *args: str
) -> tuple[int, str]:
    wt = Path(f"/tmp/overnight-px-{secrets.token_hex(5)}")
    wt.mkdir()
    if who is not None:
        os.chown(wt, who.uid, who.gid)
    log = tmp / "logs" / "turn-001-step-01-agent.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    capture = OutputCapture(log=open(log, "ab"))  # noqa: SIM115 - closed below
    spec = StepSpec(
        argv=[PY3, "-c", STEP, *args],
        deadline=90,
        gap=60,
        cwd=str(wt),
        sandbox=True,
        user=who,
        task_id="far-task",
        allow_hosts=tuple(allow),
    )
    try:
        result = run_supervised(r, Keys(namespace), spec, on_output=capture)
    finally:
        capture.close()
        os.rmdir(wt)
    return result.exit_code, log.read_text()


def test_a_listed_host_is_reached_through_the_proxy_and_nothing_else(
    r: redis.Redis,
    namespace: str,
    tmp_path: Path,
    who: StepUser | None,
    far: FarHost,
    loopback_server: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    args = (far.address, str(PORT), str(OTHER), str(loopback_server))
    allow = [f"{far.address}:{PORT}", f"localhost:{loopback_server}"]
    with caplog.at_level(logging.WARNING, logger="overnight.proxy"):
        code, out = run_step(r, namespace, tmp_path, who, allow, *args)
    assert code == 0, out
    lines = {line.split(":")[0]: line for line in out.splitlines() if ": " in line}
    # Benign: the listed host answers, by a plain GET and through a CONNECT tunnel.
    assert lines["GET"] == f"GET: HELLO-FROM-FAR-HOST {PORT}", out
    assert lines["CONNECT"] == f"CONNECT: HELLO-FROM-FAR-HOST {PORT}", out
    # Attacks: an unlisted port, an unlisted name, a listed name leading to this host.
    for name in ("OTHER-PORT", "NAME", "LOOPBACK"):
        assert lines[name].startswith(f"{name}: FAILED") and "403" in lines[name], out
    assert "HELLO" not in lines["OTHER-PORT"] and "LOOPBACK-SERVICE" not in out
    assert lines["DIRECT"].startswith("DIRECT: FAILED"), out  # no route but the proxy
    refused = f"overnight: task far-task: proxy refused {far.address}:{OTHER}: not in allow_hosts"
    assert refused in out
    assert "proxy refused unlisted.example.com:443: not in allow_hosts" in out
    assert "proxy refused localhost:" in out and "resolves to 127.0.0.1" in out
    assert "proxy refused 3 connection(s)" in out and "2 let through" in out
    said = [rec.getMessage() for rec in caplog.records if rec.name == "overnight.proxy"]
    assert any(f"task=far-task: proxy refused {far.address}:{OTHER}" in m for m in said), said
    # What `overnight logs` prints for the step holds the count.
    printed = tmp_path / "printed.txt"
    with open(printed, "w") as fh:
        print_logs(tmp_path / "logs", fh)
    assert "proxy refused 3 connection(s)" in printed.read_text()
    # The benign twin of DIRECT and LOOPBACK: outside the sandbox both servers answer.
    socket.create_connection((far.address, PORT), timeout=5).close()
    with socket.create_connection(("127.0.0.1", loopback_server), timeout=5) as conn:
        assert b"LOOPBACK-SERVICE" in conn.recv(100)


def test_without_allow_hosts_the_far_host_is_out_of_reach(
    r: redis.Redis, namespace: str, tmp_path: Path, who: StepUser | None, far: FarHost
) -> None:
    args = (far.address, str(PORT), str(OTHER), "1")
    code, out = run_step(r, namespace, tmp_path, who, [], *args)
    assert code == 0, out
    assert "HELLO-FROM-FAR-HOST" not in out
    assert "GET: FAILED" in out and "CONNECT: NO-PROXY-ENV" in out and "DIRECT: FAILED" in out
    assert "proxy refused" not in out


def test_a_task_with_allow_hosts_is_verified_and_its_refusals_are_in_its_logs(
    env: dict[str, str], upstream: str, tmp_path: Path, r: redis.Redis, namespace: str, far: FarHost
) -> None:
    """The key end to end: submitted, its agent fetches from the listed host and tries an
    unlisted port; the rule checks what it fetched; ``overnight logs`` shows the refusal."""
    CallEnvelope(r, "default", namespace).reset(20)
    tenv = worker_env(env, OVERNIGHT_MODEL_URL=upstream, OVERNIGHT_SANDBOX="bwrap")
    fetch = (
        "import urllib.request as u, sys\n"
        "def get(port):\n"
        "    try:\n"
        f"        return u.urlopen('http://{far.address}:%d/' % port, timeout=10).read().decode()\n"
        "    except Exception as exc:\n"
        "        return 'FAILED %s' % exc\n"
        f"print(get({OTHER}))\n"
        f"open('out.txt', 'w').write(get({PORT}))\n"
    )
    (tmp_path / "far").mkdir()
    (tmp_path / "far" / "fetch.py").write_text(fetch)
    os.chmod(tmp_path / "far", 0o777)
    agent = [PY3, "fetch.py"]
    rule = ["grep", "-qx", f"HELLO-FROM-FAR-HOST {PORT}", "out.txt"]
    allow = [f"{far.address}:{PORT}"]
    path = task_file(tmp_path, "far", agent, [rule], workspace="in-place", allow_hosts=allow)
    refused = cli({**tenv, "OVERNIGHT_SANDBOX": "off"}, "submit", str(path))
    assert refused.returncode == 64, refused.stderr
    assert "allow_hosts: needs OVERNIGHT_SANDBOX=bwrap" in refused.stderr
    done = run_burst(tenv, path, "far")
    assert done["state"] == "finished_verified", json.dumps(done, indent=1)[-4000:]
    logs = cli(tenv, "logs", "far")
    assert logs.returncode == 0, logs.stderr
    assert f"proxy refused {far.address}:{OTHER}: not in allow_hosts" in logs.stdout
    assert "proxy refused 1 connection(s)" in logs.stdout
