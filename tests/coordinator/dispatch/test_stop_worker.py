"""A stop the user asks of a worker or of `up`, with real processes and a private
Redis: the step in flight is ended and recorded as stopped, its task goes back to queued from
its checkpoint (not lost, not paused), its lease is ended, its tree is gone, and the RQ worker
is unregistered. A worker that dies (SIGKILL) is still an unknown outcome: see
test_task_rq.test_worker_sigkilled_mid_step_pauses_then_resume_finishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from rq import Worker

from overnight.config.keys import Keys
from overnight.coordinator.tasks.states import QUEUED
from overnight.coordinator.tasks.store import TaskRecord, TaskStore
from overnight.worker.lease.store import Leases
from overnight.worker.redisio import receipts
from tests.helpers import (
    OVERNIGHT,
    assert_all_gone,
    host_pids,
    kill_quietly,
    pid_alive,
    task_file,
    wait_for,
)

PY = sys.executable
# First run: a tree (itself and a `sleep`) that beats until it is stopped; with an argument
# it ignores SIGTERM, tree and all. Next run: it does the job.
AGENT = (
    "import os, pathlib, signal, subprocess, sys, time\n"
    "if pathlib.Path('started').exists():\n"
    "    pathlib.Path('ok.txt').touch(); sys.exit(0)\n"
    "if len(sys.argv) > 1: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "child = subprocess.Popen(['sleep', '600'])\n"
    "pathlib.Path('tree').write_text(f'{os.getpid()} {child.pid}')\n"
    "pathlib.Path('started').write_text('1')\n"
    "while True: print('working', flush=True); time.sleep(0.2)\n"
)


@pytest.fixture
def tenv(env: dict[str, str]) -> dict[str, str]:
    return {
        **env,
        "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"],
        "OVERNIGHT_TASK_CLAIM_TTL": "2",
        "OVERNIGHT_RECOVERY_INTERVAL": "0.5",
        "OVERNIGHT_GRACE": "0.5",
    }


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@pytest.fixture
def rq_conn(env: dict[str, str]) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(env["OVERNIGHT_REDIS_URL"])
    yield client
    client.close()


def cli(tenv: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], env=tenv, capture_output=True, text=True, timeout=45, check=False
    )


def prepare(tenv: dict[str, str], tmp_path: Path, name: str, *agent_args: str) -> Path:
    assert cli(tenv, "envelope", "reset", "20").returncode == 0
    return task_file(
        tmp_path,
        name,
        [PY, "-c", AGENT, *agent_args],
        [["test", "-f", "ok.txt"]],
        on_unknown="pause",
    )


def start_worker(
    tenv: dict[str, str], name: str, log: Path, started: list[subprocess.Popen[bytes]]
) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [OVERNIGHT, "worker", "--name", name], env=tenv, stdout=out, stderr=subprocess.STDOUT
        )
    started.append(proc)
    return proc


def step_tree(workdir: Path) -> list[int]:
    tree = workdir / "tree"
    text = wait_for(lambda: tree.exists() and tree.read_text(), timeout=30)
    return host_pids([int(pid) for pid in text.split()], workdir)


def record(r: redis.Redis, namespace: str, task_id: str) -> TaskRecord:
    rec = TaskStore(r, Keys(namespace)).get(task_id)
    assert rec is not None
    return rec


def assert_stopped(
    r: redis.Redis,
    rq_conn: redis.Redis,
    namespace: str,
    task_id: str,
    pids: list[int],
    gone_workers: list[str],
) -> dict[str, Any]:
    """The task is queued from its checkpoint, the stop is on record, the lease ended, the
    tree gone, the RQ workers unregistered; returns the stopped step's receipt data."""
    keys = Keys(namespace)
    rec = record(r, namespace, task_id)
    assert rec.state == QUEUED, (rec.state, rec.detail)
    assert rec.checkpoint.in_flight is None and rec.checkpoint.lost_leases == 0
    assert (rec.checkpoint.turn, rec.checkpoint.step, rec.attempt) == (1, 0, 1)
    assert "overnight was stopped (SIGTERM)" in rec.detail, rec.detail
    seen = receipts.read(r, keys, task_id=task_id)
    [step] = [rc for rc in seen if rc.kind == "step_finished"]
    assert step.data["stopped"] is True and step.data["note"] == "supervisor-signal-15"
    assert step.data["ending"] == "turn 1 agent stopped: overnight was stopped (SIGTERM)"
    assert [rc.kind for rc in seen if rc.kind == "task_stopped"] == ["task_stopped"]
    assert step.lease_id is not None
    doc = Leases(r, keys).get(step.lease_id)
    assert doc is not None and doc.status != "running", doc
    assert doc.note == "supervisor-signal-15"
    assert_all_gone(pids)
    names = {w.name for w in Worker.all(connection=rq_conn)}
    assert not names & set(gone_workers), names
    assert not r.exists(keys.task_claim(task_id))
    return step.data


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_warm_stop_of_a_worker_requeues_the_step_which_runs_again_after_a_restart(
    tenv: dict[str, str],
    tmp_path: Path,
    started: list[subprocess.Popen[bytes]],
    r: redis.Redis,
    rq_conn: redis.Redis,
) -> None:
    namespace = tenv["OVERNIGHT_NAMESPACE"]
    logs = tmp_path / "state" / "task-logs" / namespace
    tenv = {**tenv, "OVERNIGHT_STATE_DIR": str(tmp_path / "state")}
    ghost = logs / "ghost"  # the step logs of a task retention has forgotten
    ghost.mkdir(parents=True)
    (ghost / "turn-001-step-00-agent.log").write_text("old\n")
    week_ago = time.time() - 8 * 86400
    for old in (ghost / "turn-001-step-00-agent.log", ghost):
        os.utime(old, (week_ago, week_ago))
    path = prepare(tenv, tmp_path, "warm")
    assert cli(tenv, "submit", str(path)).returncode == 0
    name = f"warm-{namespace}"
    worker = start_worker(tenv, name, tmp_path / "worker.log", started)
    pids = step_tree(tmp_path / "warm")
    try:
        wait_for(lambda: not ghost.exists(), timeout=30)  # the worker's start-up pass
        assert record(r, namespace, "warm").state == "running"
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(60)
        log = (tmp_path / "worker.log").read_text()
        assert code == 0, log[-3000:]
        assert "asked work horse" in log
        assert_stopped(r, rq_conn, namespace, "warm", pids, [name])

        again = start_worker(tenv, f"again-{namespace}", tmp_path / "again.log", started)
        wait_for(lambda: record(r, namespace, "warm").state == "finished_verified", timeout=60)
        rec = record(r, namespace, "warm")
        assert (rec.turns, rec.checkpoint.lost_leases) == (1, 0)
        assert rec.calls_used == 2  # the stopped step ran again under its request id
        envelope = json.loads(cli(tenv, "envelope", "status").stdout)
        assert envelope["remaining"] == 18
        assert [p.name for p in logs.iterdir()] == ["warm"]  # a live task's logs stay
        again.send_signal(signal.SIGTERM)  # idle: it just goes
        assert again.wait(60) == 0
    finally:
        for pid in pids:
            kill_quietly(pid)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_forced_stop_of_a_worker_skips_the_grace_and_still_records_the_stop(
    tenv: dict[str, str],
    tmp_path: Path,
    started: list[subprocess.Popen[bytes]],
    r: redis.Redis,
    rq_conn: redis.Redis,
) -> None:
    # A step that ignores SIGTERM and a grace of ten minutes: only the forced stop ends it.
    # Off: a sandbox's bwrap dies of the SIGTERM the step ignores, and takes the step with it.
    tenv = {**tenv, "OVERNIGHT_GRACE": "600", "OVERNIGHT_SANDBOX": "off"}
    namespace = tenv["OVERNIGHT_NAMESPACE"]
    path = prepare(tenv, tmp_path, "forced", "stubborn")
    assert cli(tenv, "submit", str(path)).returncode == 0
    name = f"forced-{namespace}"
    worker = start_worker(tenv, name, tmp_path / "worker.log", started)
    pids = step_tree(tmp_path / "forced")
    try:
        worker.send_signal(signal.SIGTERM)
        first = time.monotonic()
        wait_for(lambda: "asked work horse" in (tmp_path / "worker.log").read_text(), timeout=30)
        # RQ takes a second signal within 1 s of the first for the same one.
        wait_for(lambda: time.monotonic() - first > 1.2, timeout=5)
        assert worker.poll() is None and all(pid_alive(p) for p in pids)  # warm: waiting
        worker.send_signal(signal.SIGTERM)
        worker.wait(90)
        log = (tmp_path / "worker.log").read_text()
        assert "cold shut down" in log, log[-3000:]
        assert_stopped(r, rq_conn, namespace, "forced", pids, [name])
    finally:
        for pid in pids:
            kill_quietly(pid)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigterm_to_up_mid_step_requeues_the_task(
    env: dict[str, str],
    tmp_path: Path,
    started: list[subprocess.Popen[bytes]],
    r: redis.Redis,
    rq_conn: redis.Redis,
) -> None:
    namespace = env["OVERNIGHT_NAMESPACE"]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    task_file(tasks, "upstop", [PY, "-c", AGENT], [["test", "-f", "ok.txt"]], on_unknown="pause")
    up = subprocess.Popen(
        [
            OVERNIGHT,
            "up",
            "--tasks",
            str(tasks),
            "--budget",
            "20",
            "--workers",
            "1",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        env={**env, "OVERNIGHT_GRACE": "0.5"},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    started.append(up)
    pids = step_tree(tasks / "upstop")
    try:
        up.send_signal(signal.SIGTERM)
        out, err = up.communicate(timeout=90)
        assert up.returncode == 128 + signal.SIGTERM, err.decode()[-3000:]
        line = next(ln for ln in out.decode().splitlines() if ln.startswith("upstop "))
        assert "queued" in line, line  # the final table shows it back in the queue
        assert_stopped(r, rq_conn, namespace, "upstop", pids, [f"up-{up.pid}-1"])
    finally:
        for pid in pids:
            kill_quietly(pid)
