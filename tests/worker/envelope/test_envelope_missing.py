"""A never-created envelope says so: in its status, in a refusal, and in a halted task."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import fakeredis
import pytest
import redis

from overnight import CallEnvelope, EnvelopeEmpty
from tests.helpers import OVERNIGHT


def envelope_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, "envelope", *args], env=env, capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize("backend", ["fake", "r"])
def test_snapshot_tells_a_missing_envelope_from_a_spent_one(
    backend: str, request: pytest.FixtureRequest, namespace: str
) -> None:
    client: redis.Redis | fakeredis.FakeRedis = request.getfixturevalue(backend)
    missing = CallEnvelope(client, "never", namespace).snapshot()
    assert missing.exists is False and missing.remaining == 0
    spent = CallEnvelope(client, "spent", namespace)
    spent.reset(0)
    assert spent.snapshot().exists is True


@pytest.mark.parametrize("backend", ["fake", "r"])
def test_refusal_names_the_missing_envelope_and_how_to_create_it(
    backend: str, request: pytest.FixtureRequest, namespace: str
) -> None:
    client: redis.Redis | fakeredis.FakeRedis = request.getfixturevalue(backend)
    with pytest.raises(EnvelopeEmpty) as info:
        CallEnvelope(client, "nightly", namespace).try_consume("model")
    assert info.value.reason == "unknown" and info.value.state.exists is False
    assert str(info.value).startswith("envelope 'nightly' does not exist (create it with")
    assert "overnight envelope reset N" in str(info.value) and "OVERNIGHT_BUDGET" in str(info.value)
    # The CLI's error JSON keeps the contract's wording.
    assert info.value.public()["error"] == "envelope empty; refused model call; remaining=0"
    spent = CallEnvelope(client, "spent", namespace)
    spent.reset(0)
    with pytest.raises(EnvelopeEmpty) as empty:
        spent.try_consume("model")
    assert str(empty.value) == "envelope empty; refused model call; remaining=0"


def test_status_of_a_missing_envelope_exits_2_with_exists_false(env: dict[str, str]) -> None:
    res = envelope_cli(env, "status", "--name", "never")
    assert res.returncode == 2
    state = json.loads(res.stdout)
    assert state["exists"] is False and state["remaining"] == 0
    assert "does not exist" in res.stderr and "overnight envelope reset N" in res.stderr
    assert envelope_cli(env, "reset", "0", "--name", "never").returncode == 0
    res = envelope_cli(env, "status", "--name", "never")
    assert res.returncode == 0 and json.loads(res.stdout)["exists"] is True


def test_consume_on_a_missing_envelope_hints_on_stderr(env: dict[str, str]) -> None:
    res = envelope_cli(env, "consume", "tool", "--name", "never")
    assert res.returncode == 2
    assert json.loads(res.stdout)["error"] == "envelope empty; refused tool call; remaining=0"
    assert "envelope 'never' does not exist" in res.stderr


TASK = """
id = "{id}"
assignment = "say hello"
workdir = "."
agent = ["true"]
max_calls = 4
envelope = "{envelope}"
[[verifier]]
name = "ok"
run = ["true"]
"""


def test_submit_warns_and_the_task_halts_naming_the_missing_envelope(
    env: dict[str, str], tmp_path: Path, r: redis.Redis
) -> None:
    env = {**env, "OVERNIGHT_QUEUE": f"q-{env['OVERNIGHT_NAMESPACE']}"}
    (tmp_path / "t.toml").write_text(TASK.format(id="lonely", envelope="nightly"))
    sub = subprocess.run(
        [OVERNIGHT, "submit", str(tmp_path / "t.toml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert sub.returncode == 0 and sub.stdout.split() == ["lonely"], sub.stderr
    assert "warning: envelope 'nightly' does not exist" in sub.stderr
    work = subprocess.run(
        [OVERNIGHT, "worker", "--burst"], env=env, capture_output=True, text=True, timeout=120
    )
    assert work.returncode == 0, work.stderr[-2000:]
    status = subprocess.run(
        [OVERNIGHT, "status", "lonely"], env=env, capture_output=True, text=True, timeout=30
    )
    task = json.loads(status.stdout)
    assert task["state"] == "halted_at_call_ceiling"
    assert "envelope 'nightly' does not exist (create it with" in task["detail"]


def test_submit_says_nothing_when_the_envelope_exists(env: dict[str, str], tmp_path: Path) -> None:
    env = {**env, "OVERNIGHT_QUEUE": f"q-{env['OVERNIGHT_NAMESPACE']}"}
    assert envelope_cli(env, "reset", "5", "--name", "nightly").returncode == 0
    (tmp_path / "t.toml").write_text(TASK.format(id="fed", envelope="nightly"))
    sub = subprocess.run(
        [OVERNIGHT, "submit", str(tmp_path / "t.toml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert sub.returncode == 0 and "warning" not in sub.stderr
