"""The tree dies, for real: a step that tries to outlive its lease fails.

Each scenario is a step, run as the step user, that starts escapees and leaves them behind:
pid hopping (16 fork-and-exit chains at once), ``setsid`` + ``env -i``, ``nohup``, a
SIGSTOPped process, a process that ignores SIGTERM (the step itself goes silent and is
ended by its gap), ``unshare`` into its own user and PID namespace. Every escapee carries a
marker in its command line. The control runs the same step without overnight (inside a
test cgroup, to clean up after it) and shows the escapees do outlive it there; under
overnight, through the lease's cgroup and through the ``/proc`` fallback alike, none is
alive once the lease has ended, and the lease says how the step ended.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.sandbox import cgroup, launch
from overnight.worker.sandbox.stepuser import StepUser, lookup
from overnight.worker.supervise.supervisor import StepSpec, run_supervised
from tests import reachable
from tests.helpers import OVERNIGHT, capability, final_doc, lacking, wait_for

PY3 = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
HAS_CGROUP = cgroup.available()

ESCAPE = textwrap.dedent(
    """
    import os, pathlib, signal, subprocess, sys, time
    mode, mark, seen = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    py = sys.executable
    # Every escapee: a sleeper with the marker on its command line.
    sleeper = [py, "-c", "import time; time.sleep(60)", mark]
    deaf = [py, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "time.sleep(60)", mark]

    def ran(what):
        with open(seen, "a") as fh:
            fh.write(what + "\\n")

    def cmdline(pid):
        try:  # a process may exit between the listing and the read
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                return fh.read()
        except OSError:
            return b""

    if mode == "hop":
        for _ in range(16):  # 16 chains at once
            if os.fork() == 0:
                break
        else:
            ran("hop")
            print("launched", flush=True)
            os._exit(0)
        end = time.monotonic() + 60  # bounded: the lease ends it long before
        while time.monotonic() < end:
            if os.fork() != 0:  # a new pid every iteration
                os._exit(0)
            if os.getpid() % 3 == 0:
                os.setsid()
        os._exit(0)
    elif mode == "setsid":
        subprocess.Popen(["setsid", "env", "-i", *sleeper], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    elif mode == "nohup":
        subprocess.Popen(["nohup", *sleeper], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    elif mode == "sigstop":
        proc = subprocess.Popen(sleeper, start_new_session=True)
        os.kill(proc.pid, signal.SIGSTOP)
    elif mode == "deaf":
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(py, deaf)
            os._exit(0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif mode == "unshare":
        subprocess.Popen(["unshare", "--user", "--map-root-user", "--fork", "--pid",
                          "--mount-proc", *sleeper], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    if mode != "hop":
        # Wait until the escapee runs (its marker shows in the process table).
        def showed():  # this script's command line (and its supervisor's) has the mark too
            lines = [cmdline(p) for p in os.listdir("/proc") if p.isdigit()]
            return any(mark.encode() in c and b"escape.py" not in c for c in lines)

        end = time.monotonic() + 20
        while time.monotonic() < end and not showed():
            print("waiting for the escapee", flush=True)  # a beat: this can be slow
            time.sleep(0.1)
        # Only an escapee seen running counts: the tests assert ran() == [mode].
        ran(mode if showed() else mode + "-never-showed")
        print("launched", flush=True)
    if mode == "deaf":
        time.sleep(120)  # silent, deaf to SIGTERM: only the gap and SIGKILL end it
    """
)

MODES = ["hop", "setsid", "nohup", "sigstop", "deaf", "unshare"]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the step user needs root")


def marked(mark: str) -> list[int]:
    """Live processes whose command line carries ``mark``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                if mark.encode() not in fh.read():
                    continue
            with open(f"/proc/{name}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
        except OSError:
            continue
        found.append(int(name))
    return found


@pytest.fixture
def stage(step_user: StepUser) -> Iterator[Path]:
    """A folder the step user owns, holding the escape script (pytest's tmp is root's)."""
    path = Path(tempfile.mkdtemp(prefix="overnight-tree-", dir="/tmp"))
    (path / "escape.py").write_text(ESCAPE)
    os.chmod(path, 0o755)
    os.chown(path, step_user.uid, step_user.gid)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def argv(stage: Path, mode: str, mark: str) -> list[str]:
    return [PY3, str(stage / "escape.py"), mode, mark, str(stage / "seen")]


def ran(stage: Path) -> list[str]:
    try:
        return (stage / "seen").read_text().split()
    except FileNotFoundError:
        return []


@pytest.mark.slow
@pytest.mark.timeout(120)
@capability(None if HAS_CGROUP else "no cgroup v2 here: the control needs one")
@pytest.mark.parametrize("mode", MODES)
def test_control_without_overnight_the_escapees_outlive_their_step(
    mode: str, stage: Path, step_user: StepUser
) -> None:
    mark = f"overnight-escape-{uuid.uuid4().hex}"
    group = cgroup.create(f"t-{uuid.uuid4().hex[:8]}", "control")
    assert group is not None
    try:
        with subprocess.Popen(
            argv(stage, mode, mark),
            cwd=stage,
            preexec_fn=group.enter,
            user=step_user.uid,
            group=step_user.gid,
            extra_groups=[],
            stdout=subprocess.PIPE,
            start_new_session=True,
        ) as proc:
            assert proc.stdout is not None
            lines = iter(proc.stdout.readline, b"")  # beats while it waits, then "launched"
            assert b"launched" in (line.strip() for line in lines)
            if mode == "deaf":
                proc.kill()
            assert proc.wait(timeout=30) in (0, -9)
        # Its step is over; what it started lives on (16 hopping chains: 16 at least).
        if mode == "hop":  # pids change faster than /proc is listed: count the group's
            wait_for(lambda: len(group.pids()) >= 16, timeout=20)
        else:
            wait_for(lambda: marked(mark), timeout=20)
        assert ran(stage) == [mode]
    finally:
        group.kill()
        group.remove()
    assert marked(mark) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_no_escapee_outlives_the_lease(
    mode: str, stage: Path, step_user: StepUser, env: dict[str, str]
) -> None:
    mark = f"overnight-escape-{uuid.uuid4().hex}"
    env = {**env, "OVERNIGHT_STEP_USER": step_user.name}
    if mode == "unshare":
        # A sandboxed step cannot make a user namespace at all (its own test below): the
        # tree kill of one that did is proved where it can, without the sandbox.
        env["OVERNIGHT_SANDBOX"] = "off"
    args = ["--gap", "6", "--grace", "0.5", "--"]
    proc = subprocess.run(
        [OVERNIGHT, "supervise", *args, *argv(stage, mode, mark)],
        env=env,
        cwd=stage,
        capture_output=True,
        text=True,
        timeout=90,
    )
    # At the moment the lease has ended, nothing of the tree is alive: no wait here.
    alive = marked(mark)
    assert alive == [], (alive, proc.stderr[-2000:])
    assert ran(stage) == [mode], proc.stderr[-2000:]
    doc = final_doc(proc.stdout)
    if mode == "deaf":
        assert proc.returncode == 3 and doc["note"].startswith("heartbeat-gap-"), proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert (doc["status"], doc["note"]) == ("done", "worker-complete")
    assert "SURVIVED" not in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_the_proc_fallback_holds_too(
    mode: str, stage: Path, step_user: StepUser, r: redis.Redis, namespace: str
) -> None:
    """Where no cgroup can be made (a plain user), the /proc path ends the tree: repeated
    scans to a fixed point, SIGSTOP before SIGKILL."""
    mark = f"overnight-escape-{uuid.uuid4().hex}"
    spec = StepSpec(
        argv=argv(stage, mode, mark),
        cwd=str(stage),
        gap=6,
        grace=0.5,
        user=step_user,
        contain=False,
    )
    result = run_supervised(r, Keys(namespace), spec, on_output=lambda line: None)
    alive = marked(mark)
    assert alive == [], alive
    assert ran(stage) == [mode]
    assert result.kill is not None and not result.kill.via_cgroup
    assert result.kill.survivors == set()
    assert result.exit_code == (3 if mode == "deaf" else 0)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["hop", "setsid", "deaf"])
def test_a_plain_user_supervisor_ends_the_tree_through_proc(mode: str, env: dict[str, str]) -> None:
    """The whole of `overnight supervise` as an unprivileged user (no cgroup, no step user):
    the /proc path alone ends every escapee."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("no setpriv")
    nobody = lookup("nobody")
    assert nobody is not None
    stage = Path(tempfile.mkdtemp(prefix="overnight-plain-", dir="/tmp"))
    try:
        (stage / "escape.py").write_text(ESCAPE)
        os.chmod(stage, 0o755)
        os.chown(stage, nobody.uid, nobody.gid)
        mark = f"overnight-escape-{uuid.uuid4().hex}"
        plain = {k: v for k, v in env.items() if k != "OVERNIGHT_ALLOW_ROOT_STEPS"}
        as_nobody = [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
        probe = subprocess.run(
            [*as_nobody, reachable.python(), "-c", "import redis"],
            cwd="/",
            capture_output=True,
            timeout=30,
            check=False,
        )
        if probe.returncode != 0:
            # Root's interpreter out of reach (pyenv under /root): the system Python stands
            # in, whose 3.11 makes redis-py import async_timeout; asyncio's does the job.
            (stage / "shim").mkdir()
            (stage / "shim" / "async_timeout.py").write_text("from asyncio import timeout\n")
            plain["PYTHONPATH"] = str(stage / "shim")
        args = ["--gap", "6", "--grace", "0.5", "--"]
        proc = subprocess.run(
            [*as_nobody, reachable.overnight(), "supervise", *args, *argv(stage, mode, mark)],
            env=plain,
            cwd=stage,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert marked(mark) == [], proc.stderr[-2000:]
        assert ran(stage) == [mode], proc.stderr[-2000:]
        assert proc.returncode == (3 if mode == "deaf" else 0), proc.stderr[-2000:]
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sandbox", "made"), [("bwrap", False), ("off", True)])
def test_a_sandboxed_step_cannot_make_a_user_namespace(
    sandbox: str, made: bool, stage: Path, step_user: StepUser, env: dict[str, str]
) -> None:
    if sandbox == "bwrap" and launch.find_bwrap() is None:
        lacking("bubblewrap is not installed")
    if shutil.which("unshare") is None:
        lacking("no unshare(1) on this host")
    env = {**env, "OVERNIGHT_STEP_USER": step_user.name, "OVERNIGHT_SANDBOX": sandbox}
    made_it = "echo made-a-user-namespace"
    proc = subprocess.run(
        [OVERNIGHT, "supervise", "--", "unshare", "--user", "--map-root-user", "sh", "-c", made_it],
        env=env,
        cwd=stage,
        capture_output=True,
        text=True,
        timeout=50,
    )
    doc = final_doc(proc.stdout)
    # The twin without the sandbox shows the same step as the step user does make one.
    assert ("made-a-user-namespace" in proc.stdout) == made, proc.stdout + proc.stderr
    assert (doc["exit_code"] == 0) == made, doc
