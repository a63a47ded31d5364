"""Faults: Redis restarts (with and without persistence) and a wall clock that lies.

Real processes against private redis-servers that the tests kill and restart.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.envelope.envelope import CallEnvelope, EnvelopeEmpty, EnvelopeUnavailable
from overnight.worker.lease.store import LeaseRefused, Leases
from overnight.worker.supervise.supervisor import StepSpec, run_supervised
from tests.helpers import (
    OVERNIGHT,
    assert_all_gone,
    final_doc,
    host_pids,
    pid_alive,
    read_pids,
    start,
    wait_for,
)

PY = sys.executable
# Every test here restarts or kills Redis, or waits out real gaps and deadlines.
pytestmark = pytest.mark.slow


def client_of(server: Any, timeout: float = 0.5) -> redis.Redis:
    return redis.Redis.from_url(
        server.url, decode_responses=True, socket_timeout=timeout, socket_connect_timeout=timeout
    )


def restart(server: Any, *, kill: bool = True) -> None:
    """SIGKILL (default) or SIGTERM the server and start it again on the same port."""
    server.stop(kill=kill)
    server.start()


def lease_receipts(client: redis.Redis, namespace: str, lease_id: str) -> list[dict[str, Any]]:
    out = []
    for _id, fields in client.xrange(Keys(namespace).receipts):
        data = json.loads(fields["data"])
        if data.get("lease_id") == lease_id:
            out.append({"kind": fields["kind"], **data})
    return out


# --- Redis with AOF restarts: nothing is lost ---------------------------------------------


@pytest.mark.timeout(60)
def test_aof_restart_keeps_a_running_lease_and_its_token(
    env: dict[str, str], redis_factory: Any, tmp_path: Path, namespace: str
) -> None:
    server = redis_factory(appendonly=True)
    env = {**env, "OVERNIGHT_REDIS_URL": server.url}
    lease_file, go, beat_ok = tmp_path / "lease.json", tmp_path / "go", tmp_path / "beat-ok"
    # Chatty until told to go on, then beats with `overnight beat` once and exits 0.
    child = (
        f"while [ ! -e {go} ]; do echo tick; sleep 0.1; done; "
        f"{OVERNIGHT} beat --note after-restart && touch {beat_ok}"
    )
    argv = ["--gap", "3", "--lease-file", str(lease_file), "--", "sh", "-c", child]
    proc = start(argv, env, cwd=tmp_path)  # a sandboxed step sees its files there
    wait_for(lease_file.exists, timeout=15)
    before = wait_for(lambda: json.loads(lease_file.read_text()), timeout=5)
    time.sleep(0.3)
    restart(server)  # SIGKILL: only what AOF (fsync always) acknowledged survives
    client = client_of(server)
    doc = Leases(client, Keys(namespace)).get(before["lease_id"])
    assert doc is not None and doc.status == "running" and doc.token == before["token"]
    go.touch()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    final = final_doc(out)
    assert (final["status"], final["token"]) == ("done", before["token"])
    assert beat_ok.exists(), err
    ends = [
        r
        for r in lease_receipts(client, namespace, before["lease_id"])
        if r["kind"] in ("lease_ended", "subprocess_lease_expired")
    ]
    assert len(ends) == 1 and ends[0]["data"]["token"] == before["token"]


@pytest.mark.timeout(60)
def test_envelope_consumes_across_a_restart_are_exact(redis_factory: Any, namespace: str) -> None:
    """Four threads consume; each stops at a gate after its first ten, Redis is killed, the
    gate opens (every thread's next consume meets a dead Redis and retries), Redis comes
    back from its AOF and they finish: the count is exact across the restart."""
    server = redis_factory(appendonly=True)
    budget, calls, threads, before = 200, 160, 4, 10
    CallEnvelope(client_of(server), "shared", namespace).reset(budget)
    answers: dict[str, bool] = {}
    lock = threading.Lock()
    retries = [0] * threads
    at_gate = threading.Semaphore(0)
    gate = threading.Event()

    def spend(worker: int) -> None:
        env = CallEnvelope(client_of(server, 0.3), "shared", namespace)
        for n, i in enumerate(range(worker, calls, threads)):
            if n == before:
                at_gate.release()
                assert gate.wait(30)
            rid = f"req-{i}"
            until = time.monotonic() + 30
            while True:
                try:
                    env.try_consume("model" if i % 2 else "tool", request_id=rid)
                    allowed = True
                except EnvelopeEmpty:
                    allowed = False
                except EnvelopeUnavailable:
                    assert time.monotonic() < until, "Redis never came back"
                    with lock:
                        retries[worker] += 1
                    time.sleep(0.05)
                    continue
                with lock:
                    answers[rid] = allowed
                break

    pool = [threading.Thread(target=spend, args=(w,)) for w in range(threads)]
    for t in pool:
        t.start()
    for _ in range(threads):
        assert at_gate.acquire(timeout=20)
    assert len(answers) == threads * before
    server.stop(kill=True)  # SIGKILL: only what AOF (fsync always) acknowledged survives
    gate.set()
    wait_for(lambda: all(retries), timeout=20)  # every thread met the dead Redis
    server.start()
    for t in pool:
        t.join(40)
    assert all(n > 0 for n in retries), retries
    assert len(answers) == calls and all(answers.values())
    state = CallEnvelope(client_of(server), "shared", namespace).snapshot()
    assert state.consumed_model + state.consumed_tool == calls
    assert state.remaining == budget - calls and state.budget == budget
    # Asking again with the same ids charges nothing more.
    again = CallEnvelope(client_of(server), "shared", namespace)
    for i in range(calls):
        assert again.try_consume("model" if i % 2 else "tool", request_id=f"req-{i}").replayed
    assert again.snapshot().remaining == budget - calls


@pytest.mark.timeout(90)
@pytest.mark.parametrize("when", ["starting", "idle"])
def test_worker_reconnects_by_itself_after_a_restart(
    env: dict[str, str], redis_factory: Any, tmp_path: Path, namespace: str, when: str
) -> None:
    from tests.helpers import task_file

    server = redis_factory(appendonly=True)
    tenv = {
        **env,
        "OVERNIGHT_REDIS_URL": server.url,
        "OVERNIGHT_QUEUE": namespace,
        "OVERNIGHT_RECOVERY_INTERVAL": "0.5",
        "OVERNIGHT_TASK_CLAIM_TTL": "2",
    }
    assert (
        subprocess.run(
            [OVERNIGHT, "envelope", "reset", "10"], env=tenv, capture_output=True, timeout=30
        ).returncode
        == 0
    )
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen([OVERNIGHT, "worker"], env=tenv, stdout=log, stderr=log)
    try:
        client = client_of(server)
        # "starting": the restart lands while RQ is still setting the worker up.
        wait_for(lambda: client.keys("rq:worker:*"), timeout=20, interval=0.002)
        if when == "idle":
            time.sleep(2.0)
        restart(server)
        time.sleep(1.0)  # the worker meets the restart while blocked on its queue
        path = task_file(tmp_path, "after", ["touch", "ok.txt"], [["test", "-f", "ok.txt"]])
        sub = subprocess.run(
            [OVERNIGHT, "submit", str(path)], env=tenv, capture_output=True, text=True, timeout=30
        )
        assert sub.returncode == 0, sub.stderr

        def state() -> str | None:
            raw = client_of(server).hget(Keys(namespace).task("after"), "state")
            return raw if raw not in (None, "queued", "running") else None

        try:
            assert wait_for(state, timeout=45, interval=0.2) == "finished_verified"
        except AssertionError:
            log.flush()
            raise AssertionError((tmp_path / "worker.log").read_text()[-3000:]) from None
        assert worker.poll() is None, "the worker died instead of reconnecting"
    finally:
        worker.kill()
        worker.wait(10)
        log.close()


# --- Redis without persistence restarts: everything reads as absent ------------------------


@pytest.mark.timeout(60)
def test_data_loss_refuses_beats_and_consumes_and_never_repeats_a_token(
    redis_factory: Any, namespace: str
) -> None:
    server = redis_factory()
    client = client_of(server)
    leases = Leases(client, Keys(namespace))
    env = CallEnvelope(client, "default", namespace)
    env.reset(100)
    held = leases.acquire(budget_sec=60, gap_sec=30)
    # A burst of acquires, so tokens would run ahead of a coarse clock floor.
    k = leases.keys
    pipe = client.pipeline(transaction=False)
    for i in range(3000):
        lid = f"burst-{i}"
        leases._acquire(
            keys=[
                k.lease(lid),
                k.lease_alive(lid),
                k.lease_seq,
                k.lease_expiry,
                k.leases,
                k.receipts,
            ],
            args=[lid, "h", 0, "60", "30", "burst", "", "", 100_000, 3600],
            client=pipe,
        )
    issued = [int(res[1]) for res in pipe.execute()] + [held.token]
    restart(server)
    client = client_of(server)
    leases = Leases(client, Keys(namespace))
    assert leases.get(held.lease_id) is None
    with pytest.raises(LeaseRefused) as refused:
        leases.beat(held.lease_id, held.token)
    assert refused.value.reason == "unknown"
    with pytest.raises(LeaseRefused):
        leases.end(held.lease_id, held.token, "done", "worker-complete")
    with pytest.raises(EnvelopeEmpty) as empty:
        CallEnvelope(client, "default", namespace).try_consume("model")
    assert empty.value.reason == "unknown" and empty.value.remaining == 0
    after = [leases.acquire(budget_sec=60, gap_sec=30).token for _ in range(3)]
    assert min(after) > max(issued) and after == sorted(set(after))


@pytest.mark.timeout(60)
def test_supervisor_fails_closed_when_redis_forgets_its_lease(
    env: dict[str, str], redis_factory: Any, tmp_path: Path
) -> None:
    server = redis_factory()
    env = {**env, "OVERNIGHT_REDIS_URL": server.url}
    pids = tmp_path / "pids"
    chatty = f"echo $$ > {pids}; sleep 120 & echo $! >> {pids}; while :; do echo x; sleep 0.1; done"
    proc = start(["--gap", "2", "--grace", "0.5", "--", "sh", "-c", chatty], env, cwd=tmp_path)
    tree = host_pids(read_pids(pids, 2), tmp_path)
    time.sleep(0.3)
    restart(server)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 4, err
    doc = final_doc(out)
    assert (doc["status"], doc["note"]) == ("killed", "lease-lost")
    assert_all_gone(tree, timeout=2)
    assert not any(pid_alive(p) for p in tree)


# --- the wall clock lies; local deadlines are monotonic, TTLs are server time --------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shift", [-86_400.0, 86_400.0, "jumping"])
def test_a_shifted_wall_clock_kills_neither_early_nor_late(
    r: redis.Redis, namespace: str, monkeypatch: pytest.MonkeyPatch, shift: float | str
) -> None:
    real = time.time
    jumps = [0.0]

    def fake_time() -> float:
        if shift == "jumping":  # every reading an hour away from the last, either way
            jumps[0] = -jumps[0] + (3600.0 if jumps[0] <= 0 else -3600.0)
            return real() + jumps[0]
        return real() + float(shift)

    monkeypatch.setattr(time, "time", fake_time)
    keys = Keys(namespace)
    # A chatty child that ends by itself after 1.5 s, well inside its deadline: not killed early.
    t0 = time.monotonic()
    ok = run_supervised(
        r,
        keys,
        StepSpec(
            argv=[
                PY,
                "-c",
                "import time\nfor _ in range(15): print('x', flush=True); time.sleep(0.1)",
            ],
            gap=1.0,
            deadline=4.0,
            grace=0.5,
        ),
        on_output=lambda _line: None,
    )
    took = time.monotonic() - t0
    assert (ok.exit_code, ok.doc.status) == (0, "done") and took > 1.4
    assert abs(ok.doc.started_unix - real()) < 30  # the document holds server time
    # A silent child: killed by its 1 s gap, not a day early or late.
    t0 = time.monotonic()
    gap = run_supervised(
        r,
        keys,
        StepSpec(argv=["sleep", "30"], gap=1.0, deadline=20.0, grace=0.2),
        on_output=lambda _line: None,
    )
    took = time.monotonic() - t0
    assert gap.exit_code == 3 and gap.doc.status == "killed" and took > 0.9
    assert gap.doc.note.startswith("heartbeat-gap-")  # the gap, not the 20 s deadline
    # A chatty child past its 1.5 s deadline: expired on time.
    t0 = time.monotonic()
    late = run_supervised(
        r,
        keys,
        StepSpec(
            argv=[PY, "-c", "import time\nwhile True: print('x', flush=True); time.sleep(0.1)"],
            gap=1.0,
            deadline=1.5,
            grace=0.2,
        ),
        on_output=lambda _line: None,
    )
    took = time.monotonic() - t0
    assert late.exit_code == 2 and late.doc.note == "budget-exceeded" and took > 1.4
