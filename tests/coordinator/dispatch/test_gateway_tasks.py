"""Tasks through the gateway: `overnight worker` runs this host's gateway, every model request
an agent sends is one model unit of the task and the envelope, a silent step costs its floor
unit, and an envelope that runs out mid-step halts the task at the call ceiling."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.redisio.receipts import read
from tests.helpers import GATEWAY_AGENT, cli, run_burst, task_file, worker_env


@pytest.fixture
def tenv(env: dict[str, str], upstream: str) -> dict[str, str]:
    return worker_env(env, OVERNIGHT_MODEL_URL=upstream)


def _run_task(
    tenv: dict[str, str], tmp_path: Path, name: str, agent_args: list[str], **kw: Any
) -> dict[str, Any]:
    # In the task's own folder: a sandboxed step sees only its tree.
    (tmp_path / name).mkdir()
    (tmp_path / name / "agent.py").write_text(GATEWAY_AGENT)
    agent = [sys.executable, "agent.py", *agent_args]
    path = task_file(tmp_path, name, agent, [["test", "-f", "ok.txt"]], workspace="in-place", **kw)
    return run_burst(tenv, path, name)


def test_every_request_is_one_unit_and_a_silent_step_its_floor(
    tenv: dict[str, str], tmp_path: Path, r: redis.Redis, namespace: str
) -> None:
    envelope = CallEnvelope(r, "default", namespace)
    envelope.reset(100)
    done = _run_task(tenv, tmp_path, "three", ["3", "0"])
    assert done["state"] == "finished_verified", done
    assert done["calls_used"] == 3 + 1  # three model requests, one rule run
    state = envelope.snapshot()
    assert (state.consumed_model, state.consumed_tool) == (3, 1)
    assert state.consumed_tokens == 3 * (11 + 7)
    calls = [rc for rc in read(r, Keys(namespace)) if rc.kind == "model_call"]
    assert [rc.task_id for rc in calls] == ["three"] * 3
    silent = _run_task(tenv, tmp_path, "silent", ["0", "0"])
    assert silent["state"] == "finished_verified", silent
    assert silent["calls_used"] == 1 + 1  # the agent step's floor unit, one rule run
    assert envelope.snapshot().consumed_model == 4
    report = cli(tenv, "report", "--plain")
    assert report.returncode == 0, report.stderr
    assert "ledger three: 3 model requests, tokens in 33 out 21 cache 0, 0 tool calls" in (
        report.stdout
    )
    assert "ledger silent" not in report.stdout


def test_an_envelope_spent_mid_step_halts_the_task(
    tenv: dict[str, str], tmp_path: Path, r: redis.Redis, namespace: str
) -> None:
    envelope = CallEnvelope(r, "default", namespace)
    envelope.reset(3)
    ended = _run_task(tenv, tmp_path, "spender", ["10", "60"], heartbeat_gap=30)
    assert ended["state"] == "halted_at_call_ceiling", ended
    state = envelope.snapshot()
    assert (state.consumed_model, state.remaining) == (3, 0)
    kinds = [rc.kind for rc in read(r, Keys(namespace))]
    assert kinds.count("model_call") == 3
