"""Limits the step cannot edit: a step holding the Redis URL and its lease pushes the lease's
``deadline_unix`` an hour ahead and keeps its liveness key alive for an hour, and is still
ended at the deadline and at the gap of the supervisor's own spec. RQ's job timeout ends a
running step through its lease: tree dead, lease ended, task not left running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.lease.store import Leases
from tests.helpers import OVERNIGHT, assert_all_gone, pid_alive, supervise, task_file, wait_for

PY = sys.executable

# The test hands the step the Redis URL and namespace (argv); the lease id is in its
# environment by contract. It never needs the token to rewrite the lease's hash and TTL.
PUSH = """
import os, sys, time
import redis
from overnight.config.keys import Keys
url, namespace, chatty, pid_file = sys.argv[1:5]
lease = os.environ["OVERNIGHT_LEASE_ID"]
r, k = redis.Redis.from_url(url), Keys(namespace)
with open(pid_file, "w") as fh:
    fh.write(f"{os.getpid()}\\n")
while True:
    far = time.time() + 3600
    r.hset(k.lease(lease), "deadline_unix", f"{far:.6f}")
    r.pexpire(k.lease_alive(lease), 3_600_000)
    r.zadd(k.lease_expiry, {lease: far * 1000})
    if chatty == "1":
        print("working", flush=True)
    time.sleep(0.1)
"""


# Off: this module proves what the containment holds alone (uid, cgroup, allowlisted
# environment), the promise of OVERNIGHT_SANDBOX=off; its hostile steps also run scripts
# from the test's folder, outside any task tree a sandbox would bind.
@pytest.fixture(autouse=True)
def _containment_alone(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if "env" in request.fixturenames:
        request.getfixturevalue("env")["OVERNIGHT_SANDBOX"] = "off"
    monkeypatch.setenv("OVERNIGHT_SANDBOX", "off")


def test_a_pushed_deadline_does_not_extend_the_step(
    env: dict[str, str], namespace: str, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pid"
    argv = ["--deadline", "2", "--gap", "30", "--grace", "0.5", "--", PY, "-c", PUSH]
    code, doc, out = supervise(
        [*argv, env["OVERNIGHT_REDIS_URL"], namespace, "1", str(pid_file)], env, timeout=60
    )
    assert doc["deadline_unix"] > doc["started_unix"] + 1000, out  # the push landed
    assert (code, doc["status"], doc["note"]) == (2, "expired", "budget-exceeded"), out
    assert_all_gone([int(pid_file.read_text())])


def test_a_pushed_liveness_key_does_not_excuse_a_silent_step(
    env: dict[str, str], namespace: str, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pid"
    argv = ["--deadline", "120", "--gap", "1.5", "--grace", "0.5", "--", PY, "-c", PUSH]
    code, doc, out = supervise(
        [*argv, env["OVERNIGHT_REDIS_URL"], namespace, "0", str(pid_file)], env, timeout=60
    )
    assert doc["deadline_unix"] > doc["started_unix"] + 1000, out
    assert code == 3 and doc["status"] == "killed", out
    assert doc["note"].startswith("heartbeat-gap-"), doc["note"]
    assert_all_gone([int(pid_file.read_text())])


# --- RQ's job timeout ----------------------------------------------------------------------

FOREVER = (
    "import os, time; open('agent.pid', 'w').write(str(os.getpid()));"
    "[print('working', flush=True) or time.sleep(0.1) for _ in iter(int, 1)]"
)


def test_rq_job_timeout_ends_the_step_through_its_lease(
    env: dict[str, str], namespace: str, tmp_path: Path, r: redis.Redis
) -> None:
    tenv = {
        **env,
        "OVERNIGHT_QUEUE": namespace,
        "OVERNIGHT_GRACE": "0.5",
        "OVERNIGHT_TASK_CLAIM_TTL": "1",
    }
    path = task_file(tmp_path, "slow", [PY, "-c", FOREVER], [["true"]], on_unknown="pause")
    run = [OVERNIGHT, "envelope", "reset", "10"]
    assert subprocess.run(run, env=tenv, capture_output=True, timeout=30).returncode == 0
    sub = subprocess.run(
        [OVERNIGHT, "submit", str(path)], env=tenv, capture_output=True, text=True, timeout=30
    )
    assert sub.returncode == 0, sub.stderr
    (job_key,) = [key for key in r.keys("rq:job:slow-*") if r.type(key) == "hash"]
    r.hset(job_key, "timeout", 2)  # RQ's own timeout, far below the task's deadline
    work = subprocess.run(
        [OVERNIGHT, "worker", "--burst"], env=tenv, capture_output=True, text=True, timeout=90
    )
    assert work.returncode == 0, work.stderr[-3000:]
    assert "JobTimeoutException" in work.stderr, work.stderr[-3000:]
    agent = int((tmp_path / "slow" / "agent.pid").read_text())
    wait_for(lambda: not pid_alive(agent), timeout=10)
    (lease,) = [d for d in Leases(r, Keys(namespace)).recent() if d.task_id == "slow"]
    assert (lease.status, lease.note) == ("killed", "supervisor-signal-14")
    status = subprocess.run(
        [OVERNIGHT, "status", "slow"], env=tenv, capture_output=True, text=True, timeout=30
    )
    task = json.loads(status.stdout)
    assert task["state"] == "paused_for_reconciliation", task
    assert not r.exists(Keys(namespace).task_claim("slow"))
