"""Transient means transient: a Redis at maxmemory (noeviction) for a while stops nobody.

A private Redis with a small maxmemory; a worker and a reaper run while tasks are queued;
the test fills Redis until it refuses writes (OOM), holds it there, frees it, and the same
processes go on and finish every task, with the books exact.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.redisio.clients import not_run, transient
from tests.helpers import OVERNIGHT, hold_full, task_file, wait_for

PY = sys.executable
# One step that takes a moment, so the fill lands while tasks run and wait.
SLOW_FIX = "import time, pathlib; time.sleep(0.4); pathlib.Path('ok.txt').touch()"


def test_transient_table() -> None:
    from redis import exceptions as ex

    cases: list[tuple[BaseException, bool, bool]] = [
        (ex.ConnectionError("gone"), True, False),
        (ex.TimeoutError("slow"), True, False),
        (ex.BusyLoadingError("LOADING Redis is loading the dataset in memory"), True, True),
        (
            ex.OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'."),
            True,
            True,
        ),
        (ex.ReadOnlyError("READONLY You can't write against a read only replica."), True, True),
        (ex.ResponseError("MISCONF Redis is configured to save RDB snapshots"), True, True),
        (ex.ResponseError("ERR unknown command 'FOO'"), False, False),
        (
            ex.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"),
            False,
            False,
        ),
        (ValueError("not redis"), False, False),
    ]
    for exc, is_transient, was_not_run in cases:
        assert transient(exc) is is_transient, exc
        assert not_run(exc) is was_not_run, exc


@pytest.fixture
def small_redis(redis_factory: Callable[..., EmbeddedRedis]) -> EmbeddedRedis:
    return redis_factory(
        password=uuid.uuid4().hex,
        extra_args=["--maxmemory", "24mb", "--maxmemory-policy", "noeviction"],
    )


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_worker_and_reaper_ride_out_a_full_redis(
    small_redis: EmbeddedRedis,
    env: dict[str, str],
    namespace: str,
    tmp_path: Path,
    procs: list[subprocess.Popen[bytes]],
) -> None:
    tenv = {
        **env,
        "OVERNIGHT_REDIS_URL": small_redis.url,
        "OVERNIGHT_QUEUE": namespace,
        "OVERNIGHT_TASK_CLAIM_TTL": "20",
        "OVERNIGHT_RECOVERY_INTERVAL": "0.5",
        "OVERNIGHT_GRACE": "0.5",
    }
    client = redis.Redis.from_url(small_redis.url)
    assert _cli(tenv, "envelope", "reset", "40").returncode == 0
    logs = tmp_path / "logs"
    logs.mkdir()
    for name, args in (("worker", ["worker"]), ("reaper", ["reaper", "--interval", "0.2"])):
        out = open(logs / f"{name}.log", "wb")  # noqa: SIM115 - the child holds it
        procs.append(
            subprocess.Popen([OVERNIGHT, *args], env=tenv, stdout=out, stderr=subprocess.STDOUT)
        )
        out.close()
    wait_for(lambda: b"Listening on" in (logs / "worker.log").read_bytes(), timeout=30)

    # 1. Full while idle: the worker's heartbeat and recovery pass and the reaper's pass
    #    meet the refusal (held until both said so: a write of theirs may slip through
    #    while the test refills after a key expired).
    def both_refused() -> bool:
        return all(
            b"Redis unavailable (OutOfMemoryError" in (logs / f"{name}.log").read_bytes()
            for name in ("worker", "reaper")
        )

    hold_full(client, refusals=40, until=both_refused)
    assert all(p.poll() is None for p in procs), "a process died while Redis was full"
    # 2. Full while tasks run and wait in the queue.
    ids = [f"full-{i}" for i in range(6)]
    files = [
        task_file(tmp_path, i, [PY, "-c", SLOW_FIX], [["test", "-f", "ok.txt"]], heartbeat_gap=30)
        for i in ids
    ]
    proc = _cli(tenv, "submit", *map(str, files))
    assert proc.returncode == 0, proc.stderr
    hold_full(client, refusals=40)
    assert all(p.poll() is None for p in procs), "a process died while Redis was full"

    def states() -> list[str]:
        out = _cli(tenv, "status")
        assert out.returncode == 0, out.stderr
        rows: list[dict[str, Any]] = json.loads(out.stdout)
        return [row["state"] for row in rows if row["id"] in ids]

    try:
        wait_for(lambda: states() == ["finished_verified"] * len(ids), timeout=150, interval=0.5)
    except AssertionError:
        said = (logs / "worker.log").read_text()[-3000:]
        raise AssertionError(f"not every task verified: {states()}\n{said}") from None
    alive = [p.poll() is None for p in procs]
    assert alive == [True, True], (logs / "worker.log").read_text()[-4000:]
    total = 0
    for task_id in ids:
        st = json.loads(_cli(tenv, "status", task_id).stdout)
        total += int(st["calls_used"])
    env_state = json.loads(_cli(tenv, "envelope", "status").stdout)
    consumed = int(env_state["consumed_model"]) + int(env_state["consumed_tool"])
    assert consumed == total >= len(ids)
    assert env_state["remaining"] + consumed == 40

    # Both met the full Redis, said so, and went on (each says so at its next try: polled,
    # a backoff may still be running when the tasks are done).
    def recovered() -> bool:
        return all(
            b"Redis available again" in (logs / f"{name}.log").read_bytes()
            for name in ("worker", "reaper")
        )

    wait_for(recovered, timeout=30)
    worker_log = (logs / "worker.log").read_text()
    reaper_log = (logs / "reaper.log").read_text()
    for text in (worker_log, reaper_log):
        assert "Redis unavailable (OutOfMemoryError" in text, text[-3000:]
    assert "Traceback" not in reaper_log and "quitting" not in worker_log


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_started_before_its_redis_waits_for_it(
    redis_factory: Callable[..., EmbeddedRedis],
    env: dict[str, str],
    namespace: str,
    tmp_path: Path,
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """A worker (re)started while its Redis restarts, or before compose's Redis is up, waits
    (with backoff, up to 30 s) instead of exiting 69, then works."""
    from tests.helpers import free_port

    port = free_port()
    password = uuid.uuid4().hex
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    tenv = {
        **env,
        "OVERNIGHT_REDIS_URL": url,
        "OVERNIGHT_QUEUE": namespace,
        "OVERNIGHT_GRACE": "0.5",
    }
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as out:
        procs.append(
            subprocess.Popen([OVERNIGHT, "worker"], env=tenv, stdout=out, stderr=subprocess.STDOUT)
        )
    wait_for(lambda: b"Redis unavailable" in log_path.read_bytes(), timeout=30)
    assert procs[0].poll() is None
    redis_factory(port=port, password=password)
    wait_for(lambda: b"Listening on" in log_path.read_bytes(), timeout=30)
    assert b"Redis available again" in log_path.read_bytes()
    assert _cli(tenv, "envelope", "reset", "5").returncode == 0
    path = task_file(tmp_path, "late", ["sh", "-c", "echo ok > ok.txt"], [["test", "-f", "ok.txt"]])
    assert _cli(tenv, "submit", str(path)).returncode == 0

    def state() -> str:
        shown = _cli(tenv, "status", "late")
        return str(json.loads(shown.stdout)["state"]) if shown.returncode == 0 else ""

    wait_for(lambda: state() == "finished_verified", timeout=60, interval=0.3)
