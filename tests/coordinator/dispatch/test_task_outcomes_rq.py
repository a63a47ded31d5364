"""End to end with real `overnight worker` processes on a private Redis.

RQ sees the task's outcome (a job whose task did not end finished_verified is failed, with
the state and detail as the reason); an agent command that cannot be found is refused at
submit; every step's output is kept for `overnight logs`; a rule that hangs is
ended at its own limit and says so; the worker's first line names its Redis and namespace.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry

from overnight.config.connection import connect
from overnight.config.settings import load_settings
from tests.helpers import OVERNIGHT, task_file

PY = sys.executable


def run(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture
def tenv(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    return {
        **env,
        "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"],
        "OVERNIGHT_STATE_DIR": str(tmp_path / "state"),
        "OVERNIGHT_GRACE": "0.5",
    }


@pytest.mark.timeout(120)
def test_outcomes_seen_by_rq_logs_and_receipts(tenv: dict[str, str], tmp_path: Path) -> None:
    say = "print('shall I continue?', flush=True); open('ok.txt', 'w').write('ok')"
    files = [
        task_file(tmp_path, "verified", [PY, "-c", say], [["test", "-f", "ok.txt"]]),
        task_file(
            tmp_path,
            "hanging-rule",
            [PY, "-c", "pass"],
            [[PY, "-c", "import time; time.sleep(600)"]],
            max_calls=2,
            lease_seconds=1.5,
        ),
    ]
    assert run(tenv, "envelope", "reset", "20").returncode == 0
    # §6: a typo'd agent is refused at submit, naming the command; nothing is enqueued.
    typo = task_file(tmp_path, "typo", ["my-agnet", "{prompt}"], [["true"]], max_calls=6)
    refused = run(tenv, "submit", str(typo), *map(str, files))
    assert refused.returncode == 64 and "agent: command 'my-agnet' not found" in refused.stderr
    assert run(tenv, "status").stdout.strip() == "[]"
    submitted = run(tenv, "submit", *map(str, files))
    assert submitted.returncode == 0, submitted.stderr
    worker = run(tenv, "worker", "--burst", timeout=100)
    assert worker.returncode == 0, worker.stderr[-3000:]

    # §7: the first line names the Redis (password masked) and the namespace.
    settings = load_settings()
    first = worker.stderr.splitlines()[0]
    assert first.startswith("overnight worker: Redis redis://")
    assert f"namespace {settings.namespace!r}" in first
    password = settings.redis_url.split(":")[2].split("@")[0]
    assert password and password not in worker.stderr and ":****@" in first

    states = {t: json.loads(run(tenv, "status", t).stdout) for t in ("verified", "hanging-rule")}
    assert states["verified"]["state"] == "finished_verified"

    envelope = json.loads(run(tenv, "envelope", "status").stdout)
    # verified: 2 units, hanging-rule: 2 units (agent and the rule that timed out)
    assert envelope["remaining"] == 20 - 4

    # §6: a hanging rule is ended at its own limit (lease_seconds) and says so.
    hanging = states["hanging-rule"]
    assert hanging["state"] == "halted_at_call_ceiling"
    receipts = [json.loads(ln) for ln in run(tenv, "receipts", "hanging-rule").stdout.splitlines()]
    endings = [rc["data"].get("ending") for rc in receipts if rc["kind"] == "step_finished"]
    assert "turn 1 rule rule-0 timed out after 1.5 s" in endings
    report = run(tenv, "report", "--plain").stdout
    assert "turn 1 rule rule-0 timed out after 1.5 s" in report

    # §6: what the agent printed is kept and `overnight logs` prints it.
    logs = run(tenv, "logs", "verified")
    assert logs.returncode == 0, logs.stderr
    assert "==> turn 1 agent (" in logs.stdout and "shall I continue?" in logs.stdout
    assert "shall I continue?" not in run(tenv, "logs", "verified", "--turn", "2").stdout

    # §9: RQ shows the verified task's job finished and the others failed, with the reason.
    rq_conn = connect(settings, decode_responses=False)
    queue = tenv["OVERNIGHT_QUEUE"]
    failed = set(FailedJobRegistry(queue, connection=rq_conn).get_job_ids())
    finished = set(FinishedJobRegistry(queue, connection=rq_conn).get_job_ids())
    job_of = {t: states[t]["job_id"] for t in states}
    assert job_of["verified"] in finished and job_of["verified"] not in failed
    for task in ("hanging-rule",):
        assert job_of[task] in failed and job_of[task] not in finished
        job = Job.fetch(job_of[task], connection=rq_conn)
        assert job.get_status() == JobStatus.FAILED
        result = job.latest_result()
        assert result is not None and result.exc_string is not None
        assert f"TaskNotVerified: task {task}: {states[task]['state']}" in result.exc_string
