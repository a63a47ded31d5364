"""The gateway listens on a Unix socket in a folder only overnight writes; its loopback TCP
port is trusted only while overnight's uid holds it. A step-user process that binds the port
after the gateway was killed is never sent a token or a prompt: the worker's watch restarts
the real gateway on its socket, and a step is refused its token while a stranger holds the
port. The twin: once the port is free, the gateway takes it back and the next step's request
is metered."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.config.runtime import gateway_folder, gateway_socket
from overnight.config.settings import load_settings
from overnight.coordinator.dispatch.gateway_probe import gateway_answers
from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.gateway.grant import reach_problem
from overnight.worker.gateway.peer import Listener, listeners, port_problem, socket_problem
from overnight.worker.redisio.receipts import read
from overnight.worker.sandbox import launch
from overnight.worker.sandbox.stepuser import StepUser
from tests.helpers import OVERNIGHT, cli, lacking, pid_alive, task_file, wait_for, worker_env

ANY6 = "0" * 32  # ::
RULES = [["test", "-f", "ok.txt"]]
TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1250 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   1: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000   998        0 2 1
   2: 0100007F:1250 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 3 1
   3: 0A000001:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4 1
"""


def test_listeners_of_a_proc_net_table() -> None:
    assert listeners(TABLE.splitlines()) == [
        Listener("0100007F", 4688, 0),
        Listener("00000000", 8080, 998),
        Listener("0A000001", 80, 1000),  # 10.0.0.1: not reached from loopback
    ]


@pytest.mark.parametrize(
    ("found", "port", "want"),
    [
        ([Listener("0100007F", 4680, 0)], 4680, None),
        (
            [Listener("00000000", 4680, 0), Listener("00000000000000000000000000000000", 4680, 0)],
            4680,
            None,
        ),
        ([], 4680, "nothing listens"),
        ([Listener("0100007F", 4681, 0)], 4680, "nothing listens"),
        ([Listener("0A000001", 4680, 998)], 4680, "nothing listens"),
        ([Listener("0100007F", 4680, 998)], 4680, "held by uid 998"),
        ([Listener("0100007F", 4680, 0), Listener("00000000", 4680, 998)], 4680, "uid 998"),
        ([Listener("00000000000000000000000001000000", 4680, 998)], 4680, "uid 998"),
    ],
)
def test_a_port_is_trusted_only_while_overnight_alone_holds_it(
    found: list[Listener], port: int, want: str | None
) -> None:
    problem = port_problem(found, port, 0)
    assert problem is None if want is None else (problem is not None and want in problem)


def test_a_socket_is_trusted_by_its_place_and_peer(tmp_path: Path) -> None:
    folder = tmp_path / "gw"
    folder.mkdir(mode=0o755)
    path = folder / "ns.sock"
    assert socket_problem(path) is not None  # nothing there
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    try:
        assert socket_problem(path) is None
        assert reach_problem("http://127.0.0.1:9", str(path)) is None  # the socket decides
        os.chmod(folder, 0o777)  # anyone could have put a socket there
        assert "not a folder only uid" in str(socket_problem(path))
    finally:
        server.close()


AGENT = textwrap.dedent("""
    import json, os, urllib.request
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "PROMPT"}]})
        .encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                 "Content-Type": "application/json"})
    body = json.loads(urllib.request.urlopen(req, timeout=30).read())
    print("answered", body["usage"], flush=True)
    open("ok.txt", "w").write("ok")
""")

# The impostor: binds the gateway's port as soon as it is free and records what it is sent.
IMPOSTOR = textwrap.dedent("""
    import socket, sys, time
    port, log = int(sys.argv[1]), sys.argv[2]
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    while True:
        try:
            s.bind(("127.0.0.1", port)); break
        except OSError:
            time.sleep(0.005)
    s.listen(16)
    print("bound", flush=True)
    while True:
        c, _ = s.accept()
        c.settimeout(2)
        try:
            data = c.recv(65536)
        except OSError:
            data = b""
        with open(log, "ab") as fh:
            fh.write(data + b"\\n--\\n")
        c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\n{}")
        c.close()
""")


def _as(user: StepUser) -> list[str]:
    return ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups"]


def _gateway_children(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"gateway" in argv and pid_alive(int(entry)):
            found.append(int(entry))
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sandbox", ["off", "bwrap"])
def test_an_impostor_on_the_port_is_never_sent_a_token(
    sandbox: str,
    env: dict[str, str],
    upstream: str,
    tmp_path: Path,
    r: redis.Redis,
    namespace: str,
    step_user: StepUser,
    request: pytest.FixtureRequest,
) -> None:
    if sandbox == "bwrap" and not launch.find_bwrap():
        lacking("bubblewrap is not installed")
    wenv = worker_env(env, OVERNIGHT_MODEL_URL=upstream, OVERNIGHT_SANDBOX=sandbox)
    port = int(wenv["OVERNIGHT_GATEWAY_PORT"])
    settings = load_settings(namespace=namespace)
    path = gateway_socket(namespace)
    log_path = tmp_path / "worker.log"
    # The step user's own corner: pytest's tmp folders are root's and closed.
    corner = Path(tempfile.mkdtemp(prefix="overnight-impostor-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(corner, ignore_errors=True))
    corner.chmod(0o755)
    seen = corner / "impostor.log"
    seen.touch()
    os.chmod(seen, 0o666)
    (corner / "impostor.py").write_text(IMPOSTOR)
    CallEnvelope(r, "default", namespace).reset(20)
    # In each task's own folder: a sandboxed step sees its worktree, not the test's folders.
    for name in ("hostile", "benign"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "agent.py").write_text(AGENT)
    agent = [sys.executable, "agent.py"]
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [OVERNIGHT, "worker"], env=wenv, stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    impostor: subprocess.Popen[str] | None = None
    try:
        (first,) = wait_for(lambda: _gateway_children(worker.pid), timeout=60, interval=0.1)
        assert wait_for(lambda: gateway_answers(settings), timeout=60)
        folder = os.stat(gateway_folder())
        assert folder.st_uid == os.geteuid() and not folder.st_mode & 0o022
        assert socket_problem(path) is None
        # The loopback port is served before the socket answers: a worker that sees the
        # socket answer may start a step that speaks TCP at once.
        assert reach_problem(f"http://127.0.0.1:{port}") is None

        # The step user waits for the port; the gateway is killed; the step user takes it.
        impostor = subprocess.Popen(
            [
                "setpriv",
                f"--reuid={step_user.uid}",
                f"--regid={step_user.gid}",
                "--clear-groups",
                sys.executable,
                str(corner / "impostor.py"),
                str(port),
                str(seen),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        os.kill(first, signal.SIGKILL)
        assert impostor.stdout is not None and impostor.stdout.readline() == "bound\n"
        # The watch starts the real gateway again, on its socket: the worker uses it.
        wait_for(lambda: [p for p in _gateway_children(worker.pid) if p != first], timeout=60)
        assert wait_for(lambda: gateway_answers(settings), timeout=60)
        problem = reach_problem(f"http://127.0.0.1:{port}")
        assert problem is not None and f"uid {step_user.uid}" in problem

        hostile = task_file(
            tmp_path, "hostile", agent, [["test", "-f", "ok.txt"]], workspace="in-place"
        )
        done = cli(wenv, "submit", "--wait", str(hostile))
        status = json.loads(cli(wenv, "status", "hostile", timeout=60).stdout)
        if sandbox == "off":  # the step's client speaks TCP only: it is not started
            assert status["state"] != "finished_verified", (status, done.stderr)
            assert "the gateway cannot be trusted" in log_path.read_text()
        else:  # its sandbox binds the gateway's socket in: the real gateway answers it
            shown = cli(wenv, "logs", "hostile", timeout=60).stdout[-3000:]
            assert status["state"] == "finished_verified", (status, shown)
        said = seen.read_bytes()
        assert b"ovn-" not in said and b"PROMPT" not in said and b"Bearer" not in said, said

        # The twin: the stranger leaves; the gateway takes its port back; a step is metered.
        impostor.kill()
        impostor.wait(10)
        wait_for(lambda: reach_problem(f"http://127.0.0.1:{port}") is None, timeout=60)
        (tmp_path / "ok.txt").unlink(missing_ok=True)
        benign = task_file(
            tmp_path, "benign", agent, [["test", "-f", "ok.txt"]], workspace="in-place"
        )
        done = cli(wenv, "submit", "--wait", str(benign))
        status = json.loads(cli(wenv, "status", "benign", timeout=60).stdout)
        assert status["state"] == "finished_verified", (status, log_path.read_text()[-3000:])
        calls = [rc for rc in read(r, Keys(namespace)) if rc.kind == "model_call"]
        metered = ["benign"] if sandbox == "off" else ["hostile", "benign"]
        assert [(rc.task_id, rc.data["tokens"]) for rc in calls] == [(t, 11 + 7) for t in metered]
        assert b"ovn-" not in seen.read_bytes()
    finally:
        if impostor is not None:
            if impostor.poll() is None:
                impostor.kill()
                impostor.wait(10)
            if impostor.stdout is not None:
                impostor.stdout.close()
        worker.terminate()
        worker.wait(60)
    assert not path.exists()  # the gateway removed its socket as it stopped


@pytest.mark.timeout(120)
def test_a_steps_relay_forwards_only_to_overnights_port(
    step_user: StepUser, request: pytest.FixtureRequest
) -> None:
    from overnight.coordinator.night.embedded_redis import free_port
    from overnight.worker.sandbox.relay import Relay

    corner = Path(tempfile.mkdtemp(prefix="overnight-impostor-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(corner, ignore_errors=True))
    corner.chmod(0o755)
    seen = corner / "impostor.log"
    seen.touch()
    os.chmod(seen, 0o666)
    (corner / "impostor.py").write_text(IMPOSTOR)

    def ask(relay: Relay) -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(10)
            c.connect(relay.path)
            c.sendall(b"GET / HTTP/1.1\r\nAuthorization: Bearer ovn-secret\r\n\r\n")
            try:
                return c.recv(4096)
            except ConnectionResetError:
                return b""

    # The twin: a listener of overnight's own uid gets the request.
    own = socket.socket()
    own.bind(("127.0.0.1", 0))
    own.listen(1)
    relay = Relay("lease-own", "127.0.0.1", own.getsockname()[1])
    try:
        asked = threading.Thread(target=lambda: ask(relay), daemon=True)
        asked.start()
        conn, _ = own.accept()
        with conn:
            assert b"ovn-secret" in conn.recv(4096)
        asked.join(10)
    finally:
        relay.close()
        own.close()

    port = free_port()
    impostor = subprocess.Popen(
        [*_as(step_user), sys.executable, str(corner / "impostor.py"), str(port), str(seen)],
        stdout=subprocess.PIPE,
        text=True,
    )
    relay = Relay("lease-stranger", "127.0.0.1", port)
    try:
        assert impostor.stdout is not None and impostor.stdout.readline() == "bound\n"
        assert ask(relay) == b""  # closed: nothing forwarded
        assert seen.read_bytes() == b""
    finally:
        relay.close()
        impostor.kill()
        impostor.wait(10)
        if impostor.stdout is not None:
            impostor.stdout.close()
