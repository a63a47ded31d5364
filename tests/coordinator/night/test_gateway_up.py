"""`overnight up` runs this host's gateway, and the built-in model step asks the model
through it with its per-lease token: metered, and never handed the real key."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.redisio.receipts import read
from tests.helpers import OVERNIGHT, free_port, seen

TASK = """id = "asks-model"
assignment = "Say hi."
workdir = "."
workspace = "in-place"
max_calls = 4

[[verifier]]
name = "answered"
run = ["grep", "-q", "hi", "out/answer.md"]
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_up_runs_the_gateway_and_the_model_step_goes_through_it(
    tmp_path: Path, env: dict[str, str], namespace: str, upstream: str, r: redis.Redis
) -> None:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "task.toml").write_text(TASK)
    env = {
        **env,
        "OVERNIGHT_MODEL_URL": f"{upstream}/v1",
        "OVERNIGHT_MODEL_API_KEY": "sk-real",
        "OVERNIGHT_MODEL_NAME": "m",
        "OVERNIGHT_GATEWAY_PORT": str(free_port()),
    }
    args = ["up", "--tasks", str(tasks), "--budget", "10", "--exit-when-done", "--workers", "1"]
    proc = subprocess.run(
        [OVERNIGHT, *args, "--state-dir", str(tmp_path / "state")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "finished_verified" in next(
        ln for ln in proc.stdout.splitlines() if ln.startswith("asks-model ")
    )
    assert (tmp_path / "state" / "logs" / "gateway.log").exists()
    calls = [rc for rc in read(r, Keys(namespace)) if rc.kind == "model_call"]
    assert [(rc.task_id, rc.data["route"], rc.data["tokens"]) for rc in calls] == [
        ("asks-model", "chat", 18)
    ]
    state = CallEnvelope(r, "default", namespace).snapshot()
    assert (state.consumed_model, state.consumed_tool, state.consumed_tokens) == (1, 1, 18)
    (asked,) = [s for s in seen(upstream) if s["path"] == "/v1/chat/completions"]
    assert asked["headers"]["Authorization"] == "Bearer sk-real"  # added by the gateway
    record = json.loads((tmp_path / "tasks" / "out" / "turn-001.json").read_text())
    assert record["answer"] == "hi" and record["source"] == "http"
