"""The envelope end to end: the CLI, many processes on one budget, and Redis going away."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest
import redis

from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.envelope.envelope import CallEnvelope, EnvelopeUnavailable
from tests.helpers import OVERNIGHT, ROOT, wait_for

REFUSED_MODEL = {
    "error": "envelope empty; refused model call; remaining=0",
    "remaining": 0,
    "kind": "model",
}

# One worker: waits at a start line (a Redis list) so all of them contend, then makes
# `attempts` consumes with ids `<tag>-<i>`, printing "<id> 1|0". With `stall` >= 0 it
# consumes that attempt and then hangs without printing: Redis answered, the worker died.
CHILD = """
import signal, sys, redis
from overnight.worker.envelope.envelope import CallEnvelope, EnvelopeEmpty
url, ns, tag, attempts, stall, go = sys.argv[1:7]
client = redis.Redis.from_url(url)
env = CallEnvelope(client, "shared", ns)
client.incr(go + ":ready")
client.blpop([go], timeout=30)
for i in range(int(attempts)):
    kind = "model" if i % 2 == 0 else "tool"
    rid = f"{tag}-{i}"
    try:
        env.try_consume(kind, rid)
        ok = 1
    except EnvelopeEmpty:
        ok = 0
    if i == int(stall):
        print("stalled", flush=True)
        signal.pause()
    print(rid, ok, flush=True)
"""


def overnight(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, "envelope", *args], env=env, capture_output=True, text=True, timeout=30
    )


def test_demo_halts_before_the_extra_model_call(env: dict[str, str]) -> None:
    res = overnight(env, "demo", "--budget", "3")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == ["model ok", "tool ok", "model ok", "halt"]
    assert lines[3] == "halt: envelope empty; refused tool call; remaining=0"
    assert sum(line.startswith("halt:") for line in lines) == 1
    state = json.loads("\n".join(lines[4:]))
    assert (state["remaining"], state["consumed_model"], state["consumed_tool"]) == (0, 2, 1)


def test_empty_reset_refuses_at_once(env: dict[str, str]) -> None:
    res = overnight(env, "reset", "0")
    assert res.returncode == 0 and json.loads(res.stdout)["remaining"] == 0
    res = overnight(env, "consume", "model")
    assert res.returncode == 2
    assert json.loads(res.stdout) == REFUSED_MODEL


def test_never_reset_refuses(env: dict[str, str]) -> None:
    res = overnight(env, "consume", "model", "--name", "fresh")
    assert res.returncode == 2 and json.loads(res.stdout) == REFUSED_MODEL


def test_reset_status_consume_and_dry_run(env: dict[str, str]) -> None:
    state = json.loads(overnight(env, "reset", "2", "--name", "cli").stdout)
    assert {k: state[k] for k in ("remaining", "consumed_model", "consumed_tool")} == {
        "remaining": 2,
        "consumed_model": 0,
        "consumed_tool": 0,
    }
    dry = overnight(env, "consume", "tool", "--dry-run", "--name", "cli")
    assert dry.returncode == 0 and json.loads(dry.stdout)["remaining"] == 2
    for _ in range(2):
        res = overnight(env, "consume", "model", "--request-id", "r1", "--name", "cli")
        assert res.returncode == 0 and json.loads(res.stdout)["remaining"] == 1
    assert json.loads(overnight(env, "consume", "tool", "--name", "cli").stdout)["remaining"] == 0
    res = overnight(env, "consume", "tool", "--dry-run", "--name", "cli")
    assert res.returncode == 2 and json.loads(res.stdout)["kind"] == "tool"
    status = overnight(env, "status", "--name", "cli")
    assert status.returncode == 0 and status.stdout.startswith("{\n  ")
    assert json.loads(status.stdout)["consumed_model"] == 1


def test_usage_errors_exit_64(env: dict[str, str]) -> None:
    for args in (
        ["reset", "-1"],
        ["reset", "--", "-1"],
        ["reset", "x"],
        ["consume", "image"],
        ["consume"],
        ["status", "--name", "a b"],
        ["reset"],
    ):
        res = overnight(env, *args)
        assert res.returncode == 64, (args, res.stdout, res.stderr)
        assert res.stdout == ""
    assert "-1" in overnight(env, "reset", "-1").stderr


def _spawn(
    env: dict[str, str], url: str, ns: str, tag: str, go: str, stall: int = -1
) -> subprocess.Popen[str]:
    args = [sys.executable, "-c", CHILD, url, ns, tag, "400", str(stall), go]
    return subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)


def _answers(out: str) -> dict[str, int]:
    pairs = (line.split() for line in out.splitlines() if line and line != "stalled")
    return {rid: int(ok) for rid, ok in pairs}


def _start_line(r: redis.Redis, go: str, n: int) -> None:
    wait_for(lambda: int(r.get(go + ":ready") or 0) >= n, timeout=30)
    r.rpush(go, *["go"] * n)


def _assert_exact(r: redis.Redis, ns: str, answers: dict[str, int]) -> None:
    snap = CallEnvelope(r, "shared", ns).snapshot()
    assert snap.remaining == 0
    assert snap.consumed_model + snap.consumed_tool == 1000
    allowed = [rid for rid, ok in answers.items() if ok]
    assert len(answers) == 3200 and len(allowed) == 1000
    models = sum(int(rid.rsplit("-", 1)[1]) % 2 == 0 for rid in allowed)
    assert (snap.consumed_model, snap.consumed_tool) == (models, 1000 - models)


@pytest.mark.slow
def test_eight_processes_share_one_budget_exactly(
    env: dict[str, str], r: redis.Redis, redis_server: EmbeddedRedis, namespace: str
) -> None:
    CallEnvelope(r, "shared", namespace).reset(1000)
    go = f"{{{namespace}}}:test-go"
    procs = [_spawn(env, redis_server.url, namespace, f"p{i}", go) for i in range(8)]
    _start_line(r, go, 8)
    answers: dict[str, int] = {}
    for proc in procs:
        out, _ = proc.communicate(timeout=45)
        assert proc.returncode == 0
        answers.update(_answers(out))
    _assert_exact(r, namespace, answers)


@pytest.mark.slow
def test_killed_and_restarted_workers_stay_exact(
    env: dict[str, str], r: redis.Redis, redis_server: EmbeddedRedis, namespace: str
) -> None:
    CallEnvelope(r, "shared", namespace).reset(1000)
    go = f"{{{namespace}}}:test-go"
    stalls = {"p0": 60, "p1": 131}
    procs = {
        f"p{i}": _spawn(env, redis_server.url, namespace, f"p{i}", go, stalls.get(f"p{i}", -1))
        for i in range(8)
    }
    _start_line(r, go, 8)
    for tag in stalls:
        stdout = procs[tag].stdout
        assert stdout is not None
        for line in stdout:
            if line.strip() == "stalled":
                break
        procs[tag].send_signal(signal.SIGKILL)
        procs[tag].wait(timeout=10)
        stdout.close()
        assert procs[tag].returncode == -signal.SIGKILL
        restart_go = f"{go}:{tag}"
        procs[tag] = _spawn(env, redis_server.url, namespace, tag, restart_go)
        _start_line(r, restart_go, 1)
    answers: dict[str, int] = {}
    for proc in procs.values():
        out, _ = proc.communicate(timeout=45)
        assert proc.returncode == 0
        answers.update(_answers(out))
    _assert_exact(r, namespace, answers)
    for tag, i in stalls.items():
        # The consume made just before the kill was answered again, not charged again.
        assert r.exists(
            CallEnvelope(r, "shared", namespace).keys.envelope_request("shared", f"{tag}-{i}")
        )


@pytest.mark.slow
def test_redis_stopped_refuses_with_exit_69(
    env: dict[str, str], redis_factory: Callable[..., EmbeddedRedis], namespace: str
) -> None:
    server = redis_factory()
    local = dict(env, OVERNIGHT_REDIS_URL=server.url)
    assert overnight(local, "reset", "5").returncode == 0
    server.stop()
    for kind in ("model", "tool"):
        res = overnight(local, "consume", kind)
        assert res.returncode == 69, res.stderr
        assert res.stdout == ""
        assert len(res.stderr.splitlines()) == 1 and "Redis unreachable" in res.stderr
    for args in (["status"], ["reset", "3"], ["demo"]):
        assert overnight(local, *args).returncode == 69
    client = redis.Redis.from_url(server.url, socket_connect_timeout=1)
    try:
        CallEnvelope(client, "default", namespace).try_consume("model")
        raise AssertionError("a consume without Redis was allowed")
    except EnvelopeUnavailable:
        pass
    # Without persistence the envelope came back unknown, and unknown is empty.
    server.start()
    res = overnight(local, "consume", "model")
    assert res.returncode == 2 and json.loads(res.stdout) == REFUSED_MODEL
