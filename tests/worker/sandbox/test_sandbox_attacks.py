"""A step in its sandbox (OVERNIGHT_SANDBOX=bwrap) as a hostile agent: each attack fails, and
its benign twin (the same step without the sandbox, or the step's own legitimate work inside
it) succeeds, so no test passes because the step never ran.

Run as root, both with the step user (bwrap then runs unprivileged, through a user
namespace: what a plain user's overnight gets) and with root steps (the explicit opt-in).
"""

from __future__ import annotations

import contextlib
import http.server
import os
import shutil
import socketserver
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.gateway.grant import Grant
from overnight.worker.sandbox import cgroup, launch
from overnight.worker.sandbox.stepuser import StepUser
from overnight.worker.supervise.supervisor import StepSpec, run_supervised
from tests.helpers import capability, wait_for

PY3 = "/usr/bin/python3"
pytestmark = [
    capability(None if launch.find_bwrap() else "bubblewrap is not installed"),
    capability(None if os.access(PY3, os.X_OK) else "no system python3"),
    pytest.mark.skipif(os.geteuid() != 0, reason="runs steps as the step user: needs root"),
]


@pytest.fixture(params=["step-user", "root"])
def who(request: pytest.FixtureRequest, step_user: StepUser) -> str:
    return str(request.param)


@pytest.fixture
def place(who: str, step_user: StepUser) -> Iterator[Path]:
    """A folder outside pytest's 0700 tree, everyone's to enter: the worktree goes in it."""
    folder = Path(f"/tmp/overnight-sbx-{uuid.uuid4().hex[:10]}")
    folder.mkdir(mode=0o755)
    (folder / "wt").mkdir()
    if who == "step-user":
        os.chown(folder / "wt", step_user.uid, step_user.gid)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def run(env: dict[str, str], who: str, sandbox: str, cwd: Path, *argv: str) -> tuple[int, str]:
    """``overnight supervise`` of ``argv`` in ``cwd``: (exit code, the step's output)."""
    step_env = {**env, "OVERNIGHT_SANDBOX": sandbox}
    if who == "step-user":
        step_env["OVERNIGHT_STEP_USER"] = "overnight-step"
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("overnight")), "supervise", "--quiet", "--", *argv],
        env=step_env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_no_other_worktree_state_folder_or_run_overnight(
    env: dict[str, str], who: str, place: Path
) -> None:
    other = place / "other-task"
    other.mkdir(mode=0o755)
    (other / "secret.txt").write_text("OTHER-TASK-SECRET\n")
    (other / "secret.txt").chmod(0o644)
    run_dir = Path("/run/overnight")
    run_dir.mkdir(mode=0o700, exist_ok=True)
    run_mode = run_dir.stat().st_mode & 0o7777
    probe = run_dir / f"probe-{uuid.uuid4().hex[:8]}"
    probe.write_text("RUN-SECRET\n")
    probe.chmod(0o644)
    # Open for this test alone (the benign twin reads it as any user could); overnight's
    # own supervisors refuse a /run/overnight that is not private, so it is put back.
    os.chmod(run_dir, 0o755)
    (place / "wt" / "mine.txt").write_text("MY-OWN-FILE\n")
    (place / "wt" / "mine.txt").chmod(0o644)
    script = (
        f"cat mine.txt; cat {other}/secret.txt; cat {probe}; echo LS:$(ls {place} | tr '\\n' ,)"
    )
    try:
        code, out = run(env, who, "bwrap", place / "wt", "sh", "-c", script)
        assert code == 0, out
        assert "MY-OWN-FILE" in out  # the step ran and reads its own worktree
        assert "OTHER-TASK-SECRET" not in out and "RUN-SECRET" not in out
        assert "LS:wt," in out  # the worktree's parent holds only the worktree inside
        code, out = run(env, who, "off", place / "wt", "sh", "-c", script)
        assert "OTHER-TASK-SECRET" in out  # there to be read
        # /run/overnight is root's (overnight's workers keep it 0700): only root reads it.
        assert "RUN-SECRET" in out or who != "root", out
        assert "other-task" in out.split("LS:")[1]
    finally:
        probe.unlink()
        os.chmod(run_dir, run_mode)


def test_no_other_steps_environment_or_signals(env: dict[str, str], who: str, place: Path) -> None:
    marker = f"TOKEN-{uuid.uuid4().hex}"
    step_env = {**env, "OVERNIGHT_SANDBOX": "bwrap"}
    if who == "step-user":
        step_env["OVERNIGHT_STEP_USER"] = "overnight-step"
    exe = str(Path(sys.executable).with_name("overnight"))
    (place / "a").mkdir(mode=0o777)
    first = subprocess.Popen(
        [exe, "supervise", "--quiet", "--env", f"SECRET_A={marker}", "--", "sleep", "60"],
        env=step_env,
        cwd=place / "a",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def holder() -> int | None:
            for pid in filter(str.isdigit, os.listdir("/proc")):
                with contextlib.suppress(OSError):
                    if marker.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                        return int(pid)
            return None

        target = wait_for(holder, timeout=20)
        scan = (
            "import os\n"
            "try:\n"
            f"    os.kill({target}, 0); print('SIGNALLED')\n"
            "except OSError as e: print('NO-SIGNAL', e)\n"
            "for p in filter(str.isdigit, os.listdir('/proc')):\n"
            "    try:\n"
            f"        if b'{marker}' in open(f'/proc/{{p}}/environ','rb').read(): print('FOUND')\n"
            "    except OSError: pass\n"
            "print('scanned', len(os.listdir('/proc')))\n"
        )
        code, out = run(env, who, "bwrap", place / "wt", PY3, "-c", scan)
        assert code == 0 and "scanned" in out, out
        assert "FOUND" not in out and "NO-SIGNAL" in out
        code, out = run(env, who, "off", place / "wt", PY3, "-c", scan)
        assert "FOUND" in out, out  # the other step was there, its environment readable
        assert "SIGNALLED" in out  # and it could be signalled
    finally:
        first.terminate()
        first.wait(timeout=30)


def test_no_host_loopback_redis(
    env: dict[str, str], who: str, place: Path, redis_factory: Callable[..., EmbeddedRedis]
) -> None:
    server = redis_factory(password=None)  # what many hosts have on 127.0.0.1
    ping = (
        "import socket\n"
        "try:\n"
        f"    s = socket.create_connection(('127.0.0.1', {server.port}), timeout=5)\n"
        "    s.sendall(b'PING\\r\\n'); print('REPLY', s.recv(64))\n"
        "except OSError as e: print('REFUSED', e)\n"
    )
    code, out = run(env, who, "bwrap", place / "wt", PY3, "-c", ping)
    assert code == 0 and "REFUSED" in out and "PONG" not in out, out
    code, out = run(env, who, "off", place / "wt", PY3, "-c", ping)
    assert "PONG" in out, out


def test_private_tmp_vanishes_with_the_step(env: dict[str, str], who: str, place: Path) -> None:
    name = f"left-{uuid.uuid4().hex[:8]}"
    folders = ("/tmp", "/var/tmp", "/dev/shm")
    write = " && ".join(f"echo x > {d}/{name} && cat {d}/{name}" for d in folders)
    try:
        code, out = run(env, who, "bwrap", place / "wt", "sh", "-c", write)
        assert code == 0 and out.count("x\n") == 3, out  # written and read back inside
        assert not any(os.path.exists(f"{d}/{name}") for d in folders)
        code, out = run(env, who, "off", place / "wt", "sh", "-c", write)
        assert code == 0 and all(os.path.exists(f"{d}/{name}") for d in folders), out
    finally:
        for d in folders:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{d}/{name}")


def test_no_root_only_system_file(env: dict[str, str], who: str, place: Path) -> None:
    """A root step (a verifier rule, when overnight runs as root) reads no root-only file of
    /etc in its sandbox; its twin without the sandbox does (for root, the secret is there)."""
    script = "cat /etc/shadow; ls /etc/ssl/private; echo END"
    code, out = run(env, who, "bwrap", place / "wt", "sh", "-c", script)
    assert code == 0 and "END" in out, out
    assert "root:" not in out
    code, out = run(env, who, "off", place / "wt", "sh", "-c", script)
    assert ("root:" in out) is (who == "root"), out


def test_writes_only_its_worktree(env: dict[str, str], who: str, place: Path) -> None:
    outside = place / "outside"
    outside.mkdir()
    outside.chmod(0o777)
    system = f"/usr/planted-{uuid.uuid4().hex[:8]}"
    script = f"echo ok > made.txt; echo bad > {outside}/planted.txt"
    code, out = run(env, who, "bwrap", place / "wt", "sh", "-c", f"{script}; echo bad > {system}")
    assert (place / "wt" / "made.txt").read_text() == "ok\n", out
    assert code != 0, out  # the last write, into /usr, was refused
    assert not (outside / "planted.txt").exists() and not os.path.exists(system)
    run(env, who, "off", place / "wt", "sh", "-c", script)
    assert (outside / "planted.txt").exists()


@pytest.mark.parametrize("who", ["step-user"])  # root steps keep bwrap's own defaults
def test_no_user_namespace_of_its_own(env: dict[str, str], who: str, place: Path) -> None:
    script = "unshare -U true && echo NESTED || echo REFUSED"
    code, out = run(env, who, "bwrap", place / "wt", "sh", "-c", script)
    assert code == 0 and "REFUSED" in out and "NESTED" not in out, out
    code, out = run(env, who, "off", place / "wt", "sh", "-c", script)
    assert "NESTED" in out, out


def test_git_works_inside_on_the_worktree(
    env: dict[str, str], who: str, place: Path, step_user: StepUser
) -> None:
    wt = place / "wt"
    script = (
        "git init -q . && git config user.email a@b && git config user.name agent && "
        "echo hi > f.txt && git add f.txt && git commit -qm first && git status --short && "
        "git log --format=%s"
    )
    code, out = run(env, who, "bwrap", wt, "sh", "-c", script)
    assert code == 0, out
    assert "first" in out
    log = subprocess.run(
        ["git", "-c", f"safe.directory={wt}", "log", "--format=%s"],
        cwd=wt,
        capture_output=True,
        text=True,
        check=True,
    )
    assert log.stdout == "first\n"
    owner = (wt / ".git").stat().st_uid
    assert owner == (step_user.uid if who == "step-user" else 0)  # the step's own uid outside


def marked(marker: str) -> list[int]:
    """The pids of this host whose command line has ``marker`` as one of its words."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                found.append(int(pid))
    return found


def supervise_in_background(
    env: dict[str, str], who: str, cwd: Path, script: str
) -> subprocess.Popen[bytes]:
    """``overnight supervise`` of ``sh -c script`` in its sandbox, started and left running
    (gap 30 s, deadline 60 s)."""
    step_env = {**env, "OVERNIGHT_SANDBOX": "bwrap"}
    if who == "step-user":
        step_env["OVERNIGHT_STEP_USER"] = "overnight-step"
    exe = str(Path(sys.executable).with_name("overnight"))
    return subprocess.Popen(
        [exe, "supervise", "--quiet", "--gap", "30", "--deadline", "60", "--", "sh", "-c", script],
        env=step_env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_the_tree_kill_reaches_into_the_sandbox(env: dict[str, str], who: str, place: Path) -> None:
    marker = f"sleeper-{uuid.uuid4().hex[:8]}"
    script = f"setsid {PY3} -c 'import time; time.sleep(300)' {marker} & sleep 300"

    proc = supervise_in_background(env, who, place / "wt", script)
    try:
        seen = wait_for(lambda: marked(marker) or None, timeout=20)  # the escapee really ran
        proc.terminate()
        assert proc.wait(timeout=30) != 0
        assert not marked(marker), seen
    finally:
        proc.kill()
        proc.wait(timeout=30)
        for pid in marked(marker):
            os.kill(pid, 9)


def test_a_killed_supervisor_takes_the_sandbox_with_it(
    env: dict[str, str], who: str, place: Path
) -> None:
    """SIGKILL to ``overnight supervise`` (nothing of it runs its end): bwrap dies with its
    parent, and the pid namespace with it, escapees included."""
    marker = f"orphan-{uuid.uuid4().hex[:8]}"
    script = f"setsid {PY3} -c 'import time; time.sleep(300)' {marker} & sleep 300"

    proc = supervise_in_background(env, who, place / "wt", script)
    try:
        wait_for(lambda: marked(marker) or None, timeout=20)  # the escapee really ran
        proc.kill()
        proc.wait(timeout=30)
        wait_for(lambda: not marked(marker), timeout=10)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        for pid in marked(marker):
            os.kill(pid, 9)


def test_a_daemon_left_behind_dies_with_its_step(
    env: dict[str, str], who: str, place: Path
) -> None:
    """A step that starts a detached daemon deaf to SIGTERM and exits 0: the daemon ends
    with the step's pid namespace (where no cgroup would hold its limits, a sandboxed step
    has none: the namespace is what ends its tree). Its benign twin is the daemon's own
    work: it ran, and wrote its file into the worktree."""
    marker = f"daemon-{uuid.uuid4().hex[:8]}"
    wt = place / "wt"
    daemon = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "open('alive', 'w').write('yes'); time.sleep(300)"
    )
    script = (
        f'setsid {PY3} -c "{daemon}" {marker} </dev/null >/dev/null 2>&1 & '
        "while [ ! -e go ]; do sleep 0.05; done; exit 0"
    )

    proc = supervise_in_background(env, who, wt, script)
    try:
        seen = wait_for(lambda: marked(marker) or None, timeout=20)
        wait_for(lambda: (wt / "alive").exists(), timeout=20)
        lines = Path(f"/proc/{seen[0]}/cgroup").read_text().splitlines()
        in_own_group = any("/overnight/" in line for line in lines)
        assert in_own_group is cgroup.holds_limits(env["OVERNIGHT_NAMESPACE"]), lines
        (wt / "go").write_text("")
        assert proc.wait(timeout=30) == 0
        assert (wt / "alive").read_text() == "yes"
        assert not marked(marker), seen
    finally:
        proc.kill()
        proc.wait(timeout=30)
        for pid in marked(marker):
            os.kill(pid, 9)


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"HELLO-FROM-GATEWAY"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _UnixHTTP(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@contextlib.contextmanager
def _serving(server: socketserver.BaseServer) -> Iterator[None]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


FETCH = (
    "import os, urllib.request\n"
    "url = os.environ['OPENAI_BASE_URL']\n"
    "print(urllib.request.urlopen(url, timeout=10).read().decode())\n"
    "open('proof.txt', 'w').write('written')\n"
)


@pytest.mark.parametrize("through", ["gateway-socket", "relay"])
def test_the_step_reaches_its_gateway_and_nothing_else(
    r: redis.Redis,
    namespace: str,
    who: str,
    place: Path,
    step_user: StepUser,
    through: str,
) -> None:
    """Benign twin of the network attacks: through the bridge, the step's base_url answers
    (the gateway's own Unix socket, or the per-step relay to a TCP-only gateway)."""
    wt = place / "wt"
    if through == "gateway-socket":
        sock_dir = place / "gw"
        sock_dir.mkdir(mode=0o711)
        path = str(sock_dir / "gateway.sock")
        server: socketserver.BaseServer = _UnixHTTP(path, _Hello)
        os.chmod(path, 0o666)
        port = 4680
    else:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
        path, port = None, server.server_address[1]  # type: ignore[assignment]
    lines: list[bytes] = []
    spec = StepSpec(
        argv=[PY3, "-c", FETCH],
        deadline=60,
        gap=30,
        cwd=str(wt),
        sandbox=True,
        user=step_user if who == "step-user" else None,
        grant=Grant(f"http://127.0.0.1:{port}"),
        gateway_socket=path,
    )
    with _serving(server):
        result = run_supervised(r, Keys(namespace), spec, on_output=lines.append)
    out = b"".join(lines).decode()
    assert result.exit_code == 0, out
    assert "HELLO-FROM-GATEWAY" in out
    assert (wt / "proof.txt").read_text() == "written"
