"""The reaper ends a dead supervisor's lease through the lease's cgroup: the group is proof
enough (only root creates groups under overnight's folder, and no step can move a process in
or out of one), so a step whose supervisor was SIGKILLed dies whole, pid hoppers and
``setsid`` escapees included, even with no proof file left; the group is removed after."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.lease import proof
from overnight.worker.lease.store import TERMINAL, Leases
from overnight.worker.sandbox import cgroup
from overnight.worker.sandbox.stepuser import StepUser
from tests.helpers import OVERNIGHT, capability, wait_for

PY3 = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else "python3"

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    capability(None if os.geteuid() != 0 or cgroup.available() else "no cgroup v2 here"),
]

# Starts a setsid escapee and 4 pid-hopping chains, then beats on stdout until killed.
STEP = textwrap.dedent(
    """
    import os, subprocess, sys, time
    mark = sys.argv[1]
    subprocess.Popen(["setsid", sys.executable, "-c", "import time; time.sleep(300)", mark])
    for _ in range(4):
        if os.fork() == 0:
            end = time.monotonic() + 120
            while time.monotonic() < end:
                if os.fork() != 0:
                    os._exit(0)
                time.sleep(0.001)
            os._exit(0)
    while True:
        print("tick", flush=True)
        time.sleep(0.1)
    """
)


@pytest.fixture
def stage(step_user: StepUser) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="overnight-reaper-", dir="/tmp"))
    (path / "step.py").write_text(STEP)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def marked(mark: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                if mark.encode() in fh.read():
                    found.append(int(name))
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.timeout(90)
@pytest.mark.parametrize("keep_proof", [True, False])
def test_a_sigkilled_supervisors_step_dies_through_its_cgroup(
    keep_proof: bool,
    env: dict[str, str],
    redis_server: EmbeddedRedis,
    r: redis.Redis,
    namespace: str,
    stage: Path,
    step_user: StepUser,
) -> None:
    lease_id = f"cg-{uuid.uuid4().hex[:8]}"
    mark = f"overnight-reaped-{uuid.uuid4().hex}"
    # The reaper's own proof, without the sandbox: bwrap's --die-with-parent would end the
    # tree with its supervisor and hide whether the reaper did (and the pids it writes
    # must be the host's).
    env = {**env, "OVERNIGHT_STEP_USER": step_user.name, "OVERNIGHT_SANDBOX": "off"}
    supervisor = subprocess.Popen(
        [
            OVERNIGHT,
            "supervise",
            "--quiet",
            "--gap",
            "3",
            "--grace",
            "0.5",
            "--lease-id",
            lease_id,
            "--",
            PY3,
            str(stage / "step.py"),
            mark,
        ],
        env=env,
        cwd=stage,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    path = cgroup.group_path(namespace, lease_id)
    assert path is not None
    try:
        group = wait_for(lambda: cgroup.open_existing(namespace, lease_id), timeout=30)
        wait_for(lambda: marked(mark) and len(group.pids()) >= 6, timeout=30)
        written, why = proof.read(namespace, lease_id)
        assert written is not None and written.cgroup == str(path), why
        group.remove_handle()
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(5)
        if not keep_proof:
            proof.remove(namespace, lease_id)
        # Orphaned: the tree lives on in its group until the reaper comes.
        assert marked(mark)
        leases = Leases(r, Keys(namespace))
        wait_for(lambda: not leases.is_alive(lease_id), timeout=30)
        done = subprocess.run(
            [OVERNIGHT, "reaper", "--once", "-v", "--grace", "0.5"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        # Nothing of the tree is alive when the pass returns, and the group is gone.
        assert marked(mark) == [], done.stderr
        assert not path.exists()
        doc = leases.get(lease_id)
        assert doc is not None and doc.status in TERMINAL
        assert doc.note.startswith("reaped:") and "unproven" not in doc.note, doc.note
        assert "SURVIVED" not in done.stderr
    finally:
        supervisor.kill()
        supervisor.wait(5)
        leftover = cgroup.open_existing(namespace, lease_id)
        if leftover is not None:
            leftover.kill()
            leftover.remove()
        proof.remove(namespace, lease_id)
