"""Nothing of the control plane is readable from a step (the non-root path).

The whole stack runs as an unprivileged user (``nobody``) against a private Redis, with a
sentinel model API key. A task's agent, of the same uid as the worker, walks its ancestors
and every process of its uid and tries ``/proc/PID/environ``, ``/proc/PID/cmdline``,
``/proc/PID/mem`` (every readable range of ``maps``) and ``PTRACE_ATTACH``. It must find
neither the key nor the Redis URL in any of them; a same-uid dumpable decoy holding both
shows the attack would see them. A benign task of the same shape finishes verified.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from tests import reachable
from tests.helpers import kill_quietly, task_file, wait_for

PY = sys.executable
# The agent's interpreter: one ``nobody`` can exec directly (root's may live under /root).
AGENT_PY = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else PY
SETPRIV = shutil.which("setpriv")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv to run as nobody"
)

# The agent. It reads what to look for from a file nothing else of the stack opens, so the
# needles are in no process's memory but its own and the decoy's.
ATTACK = r"""
import ctypes, errno, json, os, pathlib, sys

mode, needles_file = sys.argv[1], sys.argv[2]
pathlib.Path("ok.txt").touch()
if mode != "attack":
    print("benign agent: done", flush=True)
    raise SystemExit(0)
needles = [n.encode() for n in json.loads(pathlib.Path(needles_file).read_text())]
me, uid = os.getpid(), os.getuid()
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]

def ppid_of(pid):
    with open(f"/proc/{pid}/stat", "rb") as fh:
        return int(fh.read().rsplit(b")", 1)[1].split()[1])

def uid_of(pid):
    with open(f"/proc/{pid}/status") as fh:
        return int(next(l for l in fh if l.startswith("Uid:")).split()[1])

def read(path):
    try:
        with open(path, "rb") as fh:
            return fh.read(), None
    except OSError as exc:
        return b"", errno.errorcode.get(exc.errno, str(exc.errno))

def memory(pid):
    maps, err = read(f"/proc/{pid}/maps")
    if err:
        return b"", err
    chunks, left = [], 256 << 20
    try:
        mem = open(f"/proc/{pid}/mem", "rb", buffering=0)
    except OSError as exc:
        return b"", errno.errorcode.get(exc.errno, str(exc.errno))
    with mem:
        for line in maps.decode().splitlines():
            span, perms = line.split()[:2]
            if "r" not in perms or line.endswith(("[vvar]", "[vsyscall]", "[vvar_vclock]")):
                continue
            lo, hi = (int(x, 16) for x in span.split("-"))
            size = min(hi - lo, left)
            try:
                mem.seek(lo)
                chunks.append(mem.read(size) or b"")
            except (OSError, OverflowError, ValueError):
                continue
            left -= size
            if left <= 0:
                break
    return b"".join(chunks), None

def attach(pid):
    if libc.ptrace(16, pid, None, None) != 0:  # PTRACE_ATTACH
        return errno.errorcode.get(ctypes.get_errno(), "?")
    os.waitpid(pid, 0x40000000)  # __WALL: it stops
    libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
    return "attached"

ancestors, pid = [], ppid_of(me)
while pid > 1:
    ancestors.append(pid)
    pid = ppid_of(pid)
same_uid = []
for name in os.listdir("/proc"):
    if name.isdigit() and int(name) != me:
        try:
            if uid_of(int(name)) == uid:
                same_uid.append(int(name))
        except (OSError, StopIteration):
            pass
seen = {}
for pid in dict.fromkeys(ancestors + same_uid):
    try:
        row = {"uid": uid_of(pid), "ancestor": pid in ancestors}
    except (OSError, StopIteration):
        continue
    env, row["environ"] = read(f"/proc/{pid}/environ")
    cmd, row["cmdline"] = read(f"/proc/{pid}/cmdline")
    mem, row["mem"] = memory(pid)
    row["ptrace"] = attach(pid)
    row["found"] = sorted(
        f"{where}:{i}" for where, data in (("environ", env), ("cmdline", cmd), ("mem", mem))
        for i, n in enumerate(needles) if n in data
    )
    seen[pid] = row
own = [i for i, n in enumerate(needles) if n in b"\0".join(f"{k}={v}".encode()
                                                        for k, v in os.environ.items())]
report = {"me": me, "parent": ancestors[0], "seen": seen, "own_env": own}
pathlib.Path("report.json").write_text(json.dumps(report))
print("attack agent: looked at", len(seen), "processes", flush=True)
"""

DECOY = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"


# Off: this module proves what the containment holds alone (uid, cgroup, allowlisted
# environment), the promise of OVERNIGHT_SANDBOX=off; its hostile steps also run scripts
# from the test's folder, outside any task tree a sandbox would bind.
@pytest.fixture(autouse=True)
def _containment_alone(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if "env" in request.fixturenames:
        request.getfixturevalue("env")["OVERNIGHT_SANDBOX"] = "off"
    monkeypatch.setenv("OVERNIGHT_SANDBOX", "off")


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder the unprivileged user owns (pytest's own tmp folders are root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="overnight-proc-", dir="/tmp"))
    (path / "tmp").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def shim_path(base: Path) -> str:
    """A PYTHONPATH for the unprivileged interpreter: where root's interpreter lives in a
    folder ``nobody`` cannot enter (pyenv under /root), the venv's link falls back to the
    system Python, whose older 3.11 makes redis-py import ``async_timeout``; the stdlib's
    ``asyncio.timeout`` stands in for it (nothing here runs asyncio)."""
    probe = subprocess.run(
        as_nobody([reachable.python(), "-c", "import redis"]),
        capture_output=True,
        cwd="/",
        timeout=30,
        check=False,
    )
    if probe.returncode == 0:
        return ""
    shim = base / "shim"
    shim.mkdir()
    (shim / "async_timeout.py").write_text("from asyncio import timeout\n")
    return str(shim)


def as_nobody(argv: list[str]) -> list[str]:
    assert SETPRIV is not None
    return [SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--", *argv]


def chown_tree(path: Path) -> None:
    uid, gid = pwd.getpwnam("nobody").pw_uid, grp.getgrnam("nogroup").gr_gid
    for root, dirs, files in os.walk(path):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.chown(name, uid, gid)


def test_a_step_reads_nothing_of_the_control_plane(
    redis_server: EmbeddedRedis, namespace: str, base: Path
) -> None:
    sentinel = f"sk-sentinel-{uuid.uuid4().hex}"
    url = redis_server.url
    (base / "needles.json").write_text(json.dumps([sentinel, url]))
    (base / "attack.py").write_text(ATTACK)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(base),
        "TMPDIR": str(base / "tmp"),
        "PYTHONUNBUFFERED": "1",
        "OVERNIGHT_REDIS_URL": url,
        "OVERNIGHT_NAMESPACE": namespace,
        "OVERNIGHT_QUEUE": namespace,
        "OVERNIGHT_MODEL_API_KEY": sentinel,
        "OVERNIGHT_GRACE": "0.5",
        "OVERNIGHT_REAPER_INTERVAL": "0.5",
        "OVERNIGHT_SANDBOX": "off",
    }
    shim = shim_path(base)
    if shim:
        env["PYTHONPATH"] = shim
    agent = [AGENT_PY, str(base / "attack.py")]
    needles = str(base / "needles.json")
    files = [
        task_file(base, "attack", [*agent, "attack", needles], [["test", "-f", "ok.txt"]]),
        task_file(base, "benign", [*agent, "benign", needles], [["test", "-f", "ok.txt"]]),
    ]
    chown_tree(base)

    def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            as_nobody([reachable.overnight(), *args]),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    assert cli("envelope", "reset", "10").returncode == 0
    submitted = cli("submit", *map(str, files))
    assert submitted.returncode == 0, submitted.stderr
    # A same-uid process that is dumpable and holds both secrets: the attack must find them.
    decoy = subprocess.Popen(
        as_nobody([reachable.python(), "-c", DECOY, str(base / "decoy.pid")]), env=env
    )
    reaper = subprocess.Popen(
        as_nobody([reachable.overnight(), "reaper", "--interval", "0.5"]),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        decoy_pid = int(wait_for(lambda: _text(base / "decoy.pid"), timeout=20))
        worker = subprocess.Popen(
            as_nobody([reachable.overnight(), "worker", "--burst"]),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        out, _ = worker.communicate(timeout=120)
        assert worker.returncode == 0, out[-3000:]
    finally:
        for proc in (decoy, reaper):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                kill_quietly(proc.pid)
                proc.wait(10)
        if reaper.stderr is not None:
            reaper.stderr.close()

    states = {t: json.loads(cli("status", t).stdout) for t in ("attack", "benign")}
    assert states["benign"]["state"] == "finished_verified", (states, out[-3000:])
    assert states["attack"]["state"] == "finished_verified", (states, out[-3000:])
    report: dict[str, Any] = json.loads((base / "attack" / "report.json").read_text())
    seen = {int(pid): row for pid, row in report["seen"].items()}

    # The attack works: the dumpable decoy of the same uid gives up both secrets every way.
    assert set(seen[decoy_pid]["found"]) >= {"environ:0", "environ:1", "mem:0", "mem:1"}
    assert seen[decoy_pid]["ptrace"] == "attached"
    # ... and nothing else it could reach did: not the horse, the worker, the reaper.
    leaks = {pid: row["found"] for pid, row in seen.items() if row["found"] and pid != decoy_pid}
    assert leaks == {}, leaks
    horse = report["parent"]
    for pid in (horse, worker.pid, reaper.pid):
        row = seen[pid]
        assert row["uid"] == pwd.getpwnam("nobody").pw_uid, row
        assert row["environ"] == "EACCES" and row["mem"] == "EACCES", row
        assert row["ptrace"] == "EPERM", row
        assert row["cmdline"] is None, row  # readable by anyone, so never holds a secret
    assert seen[horse]["ancestor"] and seen[worker.pid]["ancestor"]
    # Its own environment holds neither the model key nor the Redis URL.
    assert report["own_env"] == []


def _text(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None
