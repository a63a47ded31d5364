"""Tasks end to end: `overnight submit`, real RQ workers in subprocesses, real leases and Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.config.keys import Keys
from tests.helpers import (
    OVERNIGHT,
    Model,
    host_pids,
    kill_quietly,
    pid_alive,
    task_file,
    wait_for,
    working_in,
)

PY = sys.executable
RQ = str(Path(OVERNIGHT).with_name("rq"))


@pytest.fixture
def tenv(env: dict[str, str]) -> dict[str, str]:
    """Environment for task tests: a private queue, small claim TTL and recovery interval."""
    return {
        **env,
        "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"],
        "OVERNIGHT_TASK_CLAIM_TTL": "1",
        "OVERNIGHT_RECOVERY_INTERVAL": "0.5",
        "OVERNIGHT_GRACE": "0.5",
    }


@pytest.fixture
def workers(tenv: dict[str, str]) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def cli(tenv: dict[str, str], *args: str, timeout: float = 45) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], env=tenv, capture_output=True, text=True, timeout=timeout, check=False
    )


def submit(tenv: dict[str, str], *files: Path) -> list[str]:
    proc = cli(tenv, "submit", *map(str, files))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def burst(tenv: dict[str, str], *extra: str) -> None:
    proc = cli(tenv, "worker", "--burst", *extra, timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]


def status(tenv: dict[str, str], task_id: str) -> dict[str, Any]:
    proc = cli(tenv, "status", task_id)
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def receipt_kinds(tenv: dict[str, str], task_id: str) -> list[dict[str, Any]]:
    proc = cli(tenv, "receipts", task_id)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def reset_envelope(tenv: dict[str, str], n: int) -> None:
    assert cli(tenv, "envelope", "reset", str(n)).returncode == 0


FIX_ON_TURN_TWO = (
    "import os, pathlib; p = pathlib.Path(os.environ['OVERNIGHT_PROMPT_FILE']).read_text();"
    "print('turn', os.environ['OVERNIGHT_TURN'], flush=True);"
    "'rule-0' in p and pathlib.Path('ok.txt').touch()"
)
NEVER = "import uuid; print(uuid.uuid4(), flush=True)"


@pytest.mark.slow
def test_three_outcomes_on_one_worker(tenv: dict[str, str], tmp_path: Path) -> None:
    reset_envelope(tenv, 100)
    files = [
        task_file(tmp_path, "first", ["touch", "ok.txt"], [["test", "-f", "ok.txt"]]),
        task_file(tmp_path, "second", [PY, "-c", FIX_ON_TURN_TWO], [["test", "-f", "ok.txt"]]),
        task_file(tmp_path, "never", [PY, "-c", NEVER], [["false"]], max_calls=5),
    ]
    assert submit(tenv, *files) == ["first", "second", "never"]
    burst(tenv)
    first, second, never = (status(tenv, t) for t in ("first", "second", "never"))
    assert (first["state"], first["turns"], first["calls_used"]) == ("finished_verified", 1, 2)
    assert first["last_verdict"]["ok"] is True
    assert (second["state"], second["turns"], second["calls_used"]) == ("finished_verified", 2, 4)
    assert never["state"] == "halted_at_call_ceiling" and never["calls_used"] == 5
    assert "max_calls" in never["detail"] and never["last_verdict"]["failed"] == ["rule-0"]
    kinds = [rc["kind"] for rc in receipt_kinds(tenv, "never")]
    assert kinds.count("verdict") == 2 and "call_refused" in kinds
    report = cli(tenv, "report")
    assert report.returncode == 0
    assert [line.split()[0] for line in report.stdout.splitlines()[1:4]] == [
        "first",
        "second",
        "never",
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_workers_share_an_envelope_of_ten(
    tenv: dict[str, str], tmp_path: Path, workers: list[subprocess.Popen[bytes]], r: redis.Redis
) -> None:
    # Nothing here is about a worker that dies: a claim that outlives a busy machine's
    # stalls, so a starved worker is never taken for a dead one by an idle one.
    tenv = {**tenv, "OVERNIGHT_TASK_CLAIM_TTL": "60"}
    reset_envelope(tenv, 10)
    slow_never = "import time, uuid; time.sleep(0.2); print(uuid.uuid4(), flush=True)"
    files = [
        task_file(tmp_path, f"share-{i}", [PY, "-c", slow_never], [["false"]], max_calls=50)
        for i in range(3)
    ]
    ids = submit(tenv, *files)
    for _ in range(3):
        workers.append(
            subprocess.Popen(
                [OVERNIGHT, "worker", "--burst"],
                env=tenv,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )

    def settled() -> list[dict[str, Any]] | None:
        now = [status(tenv, t) for t in ids]
        return now if all(s["state"] not in ("queued", "running") for s in now) else None

    states = wait_for(settled, timeout=240, interval=0.5)
    for proc in workers:
        assert proc.wait(60) == 0  # burst workers leave once the queue is empty
    assert all(s["state"] == "halted_at_call_ceiling" for s in states), states
    assert all("envelope" in s["detail"] for s in states)
    assert sum(s["calls_used"] for s in states) == 10
    env_state = json.loads(cli(tenv, "envelope", "status").stdout)
    assert env_state["remaining"] == 0
    assert env_state["consumed_model"] + env_state["consumed_tool"] == 10


@pytest.mark.slow
def test_hanging_step_is_killed_by_its_gap_and_the_task_goes_on(
    tenv: dict[str, str], tmp_path: Path
) -> None:
    reset_envelope(tenv, 20)
    hang_once = (
        "import os, pathlib, time\n"
        "if not pathlib.Path('hung').exists():\n"
        "    pathlib.Path('hung').write_text(str(os.getpid())); time.sleep(60)\n"
        "pathlib.Path('ok.txt').touch()\n"
    )
    path = task_file(
        tmp_path,
        "hang",
        [PY, "-c", hang_once],
        [["test", "-f", "ok.txt"]],
        heartbeat_gap=1,
        lease_seconds=30,
    )
    submit(tenv, path)
    burst(tenv)
    st = status(tenv, "hang")
    assert (st["state"], st["turns"], st["calls_used"]) == ("finished_verified", 2, 4)
    assert (tmp_path / "hang" / "hung").exists()  # the first turn hung
    assert working_in(tmp_path / "hang") == []  # and nothing of it is left
    rcs = receipt_kinds(tenv, "hang")
    expired = [rc for rc in rcs if rc["kind"] == "subprocess_lease_expired"]
    assert len(expired) == 1 and expired[0]["data"]["note"].startswith("heartbeat-gap")
    steps = [rc["data"] for rc in rcs if rc["kind"] == "step_finished"]
    assert steps[0]["step"] == "agent" and steps[0]["exit_code"] == 3


def _sigkill_mid_step(
    tenv: dict[str, str],
    tmp_path: Path,
    name: str,
    on_unknown: str,
    workers: list[subprocess.Popen[bytes]],
    r: redis.Redis,
) -> int:
    """Start a worker, SIGKILL it while the agent step runs; returns the orphaned step's pid."""
    reset_envelope(tenv, 20)
    slow_once = (
        "import os, pathlib, time\n"
        "if not pathlib.Path('started').exists():\n"
        "    pathlib.Path('started').write_text(str(os.getpid()))\n"
        "    while True: print('working', flush=True); time.sleep(0.2)\n"
        "pathlib.Path('ok.txt').touch()\n"
    )
    path = task_file(
        tmp_path, name, [PY, "-c", slow_once], [["test", "-f", "ok.txt"]], on_unknown=on_unknown
    )
    submit(tenv, path)
    worker = subprocess.Popen(
        [OVERNIGHT, "worker"], env=tenv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    workers.append(worker)
    marker = tmp_path / name / "started"
    wait_for(lambda: marker.exists() and marker.read_text(), timeout=20)
    [step_pid] = host_pids([int(marker.read_text())], tmp_path / name)
    st = status(tenv, name)
    assert st["state"] == "running" and st["in_flight"]["name"] == "agent"
    horse = st["runner"]["pid"]
    worker.send_signal(signal.SIGKILL)
    worker.wait(10)
    wait_for(lambda: not pid_alive(horse), timeout=10)
    wait_for(lambda: not r.exists(Keys(tenv["OVERNIGHT_NAMESPACE"]).task_claim(name)), timeout=10)
    return step_pid


@pytest.mark.slow
def test_worker_sigkilled_mid_step_pauses_then_resume_finishes(
    tenv: dict[str, str], tmp_path: Path, workers: list[subprocess.Popen[bytes]], r: redis.Redis
) -> None:
    step_pid = _sigkill_mid_step(tenv, tmp_path, "crashy", "pause", workers, r)
    try:
        assert status(tenv, "crashy")["orphaned"] is True
        burst(tenv)  # its start-up recovery pass notices the dead worker
        st = status(tenv, "crashy")
        assert st["state"] == "paused_for_reconciliation", st
        assert st["in_flight"]["name"] == "agent" and "unknown" in st["detail"]
        burst(tenv)
        assert status(tenv, "crashy")["state"] == "paused_for_reconciliation"
        proc = cli(tenv, "reconcile", "crashy", "--resume")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["state"] == "queued"
        burst(tenv)
        st = status(tenv, "crashy")
        assert (st["state"], st["turns"]) == ("finished_verified", 1)
        assert st["calls_used"] == 2  # the re-run step was not charged twice
        env_state = json.loads(cli(tenv, "envelope", "status").stdout)
        assert env_state["remaining"] == 18
    finally:
        kill_quietly(step_pid)


@pytest.mark.slow
def test_worker_sigkilled_mid_step_is_retried(
    tenv: dict[str, str], tmp_path: Path, workers: list[subprocess.Popen[bytes]], r: redis.Redis
) -> None:
    step_pid = _sigkill_mid_step(tenv, tmp_path, "retry", "retry", workers, r)
    try:
        burst(tenv)  # the orphaned step's lease may still be alive: the task is not re-run
        assert status(tenv, "retry")["state"] == "running"
        kill_quietly(step_pid)  # as this host's reaper would, once the lease lapsed

        def finished() -> dict[str, Any] | None:
            burst(tenv)  # re-run once the lease lapsed plus the kill margin
            st = status(tenv, "retry")
            return st if st["state"] == "finished_verified" else None

        st = wait_for(finished, timeout=30, interval=0.5)
        assert (st["lost_leases"], st["attempt"]) == (1, 2)
    finally:
        kill_quietly(step_pid)


@pytest.mark.slow
def test_reconcile_abort(tenv: dict[str, str], tmp_path: Path) -> None:
    path = task_file(tmp_path, "gone", ["true"], [["true"]])
    submit(tenv, path)
    proc = cli(tenv, "reconcile", "gone", "--abort")
    assert proc.returncode == 0 and json.loads(proc.stdout)["state"] == "aborted"
    burst(tenv)
    assert status(tenv, "gone")["state"] == "aborted"
    assert cli(tenv, "reconcile", "gone", "--resume").returncode == 64


def test_rq_info_and_rq_worker_class(
    tenv: dict[str, str], tmp_path: Path, workers: list[subprocess.Popen[bytes]]
) -> None:
    reset_envelope(tenv, 10)
    queue = tenv["OVERNIGHT_QUEUE"]
    worker = subprocess.Popen(
        [OVERNIGHT, "worker", "--name", f"w-{queue}"],
        env=tenv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    workers.append(worker)
    url = tenv["OVERNIGHT_REDIS_URL"]

    def listed() -> str | None:
        out = subprocess.run(
            [RQ, "info", "--url", url, queue],
            env=tenv,
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        ).stdout
        return out if f"w-{queue}" in out else None

    out = wait_for(listed, timeout=20, interval=0.2)
    assert queue in out
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    submit(tenv, task_file(tmp_path, "via-rq", ["touch", "ok.txt"], [["test", "-f", "ok.txt"]]))
    proc = subprocess.run(
        [
            RQ,
            "worker",
            "--burst",
            "--url",
            url,
            "-w",
            "overnight.coordinator.dispatch.OvernightWorker",
            queue,
        ],
        env=tenv,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert status(tenv, "via-rq")["state"] == "finished_verified"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ok", "500", "hang"])
def test_model_step_in_the_loop(tenv: dict[str, str], tmp_path: Path, mode: str) -> None:
    reset_envelope(tenv, 10)
    with Model(mode) as model:
        env = {
            **tenv,
            "OVERNIGHT_MODEL_URL": model.url,
            "OVERNIGHT_MODEL_API_KEY": "sk-hidden-1",
            "OVERNIGHT_MODEL_TIMEOUT": "6",
        }
        path = task_file(
            tmp_path,
            f"model-{mode}",
            None,
            [["test", "-f", "out/answer.md"]],
            # Long enough that a loaded machine's interpreter start-up is not a gap kill.
            heartbeat_gap=3,
            max_calls=2,
        )
        submit(env, path)
        burst(env)
        st = status(env, f"model-{mode}")
    rcs = receipt_kinds(tenv, f"model-{mode}")
    agent = next(rc["data"] for rc in rcs if rc["kind"] == "step_finished")
    if mode == "ok":
        assert st["state"] == "finished_verified"
        record = json.loads((tmp_path / f"model-{mode}" / "out" / "turn-001.json").read_text())
        assert record["answer"] == "ANSWER-42"
    else:
        assert st["state"] == "halted_at_call_ceiling" and st["turns"] == 1
        # A hung model is a model at work: the gateway keeps the lease (3 s gap) beaten
        # until OVERNIGHT_MODEL_TIMEOUT, then fails the request, and the step exits 1.
        assert agent["exit_code"] == 1
    if mode == "hang":
        assert not any(rc["kind"] == "subprocess_lease_expired" for rc in rcs)
    assert "sk-hidden-1" not in json.dumps(rcs) + json.dumps(st)


def test_model_step_stub_without_url(tenv: dict[str, str], tmp_path: Path) -> None:
    reset_envelope(tenv, 10)
    path = task_file(tmp_path, "stub", None, [["test", "-f", "out/answer.md"]])
    submit(tenv, path)
    burst(tenv)
    assert status(tenv, "stub")["state"] == "finished_verified"
    record = json.loads((tmp_path / "stub" / "out" / "turn-001.json").read_text())
    assert record["source"] == "stub" and "Create ok.txt" in record["answer"]
    assert os.environ.get("OVERNIGHT_MODEL_URL") is None


def test_horse_killed_alone_is_recovered_at_once(
    tenv: dict[str, str], tmp_path: Path, workers: list[subprocess.Popen[bytes]]
) -> None:
    """The worker survives its horse: it drops the dead horse's claim and retries now,
    long before the claim (30 s here) would have lapsed."""
    tenv = {**tenv, "OVERNIGHT_TASK_CLAIM_TTL": "30"}
    reset_envelope(tenv, 20)
    slow_once = (
        "import os, pathlib, time\n"
        "if not pathlib.Path('started').exists():\n"
        "    pathlib.Path('started').write_text(str(os.getpid()))\n"
        "    while True: print('working', flush=True); time.sleep(0.2)\n"
        "pathlib.Path('ok.txt').touch()\n"
    )
    path = task_file(
        tmp_path, "horse", [PY, "-c", slow_once], [["test", "-f", "ok.txt"]], on_unknown="retry"
    )
    submit(tenv, path)
    worker = subprocess.Popen(
        [OVERNIGHT, "worker"], env=tenv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    workers.append(worker)
    marker = tmp_path / "horse" / "started"
    wait_for(lambda: marker.exists() and marker.read_text(), timeout=20)
    [step_pid] = host_pids([int(marker.read_text())], tmp_path / "horse")
    try:
        horse = status(tenv, "horse")["runner"]["pid"]
        os.kill(horse, signal.SIGKILL)
        wait_for(lambda: status(tenv, "horse")["state"] == "finished_verified", timeout=15)
        st = status(tenv, "horse")
        assert (st["attempt"], st["lost_leases"], st["calls_used"]) == (2, 1, 2)
        assert worker.poll() is None
    finally:
        kill_quietly(step_pid)


def test_submit_wait_and_receipts_follow(
    tenv: dict[str, str], tmp_path: Path, workers: list[subprocess.Popen[bytes]]
) -> None:
    reset_envelope(tenv, 10)
    follow = subprocess.Popen(
        [OVERNIGHT, "receipts", "waited", "--follow"],
        env=tenv,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    workers.append(follow)
    workers.append(
        subprocess.Popen(
            [OVERNIGHT, "worker"], env=tenv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    )
    ok = task_file(tmp_path, "waited", ["touch", "ok.txt"], [["test", "-f", "ok.txt"]])
    proc = cli(tenv, "submit", "--wait", "--timeout", "30", str(ok))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["waited"] and "waited: finished_verified" in proc.stderr
    assert follow.stdout is not None
    seen = []
    for line in follow.stdout:
        seen.append(json.loads(line))
        if seen[-1]["kind"] == "task_state" and seen[-1]["data"]["state"] == "finished_verified":
            break
    assert {rc["task_id"] for rc in seen} == {"waited"}
    assert seen[0]["kind"] == "task_submitted"
    bad = task_file(tmp_path, "unverified", ["true"], [["false"]], max_calls=2)
    proc = cli(tenv, "submit", "--wait", "--timeout", "30", str(bad))
    assert proc.returncode == 2 and "halted_at_call_ceiling" in proc.stderr
