"""A task's agent over its limits (the task's own ``limits`` table) under ``overnight
worker``: its tree is killed, the turn's ending names the limit in ``overnight status``,
the next prompt begins with it, and the next turn, under the same limits, finishes the
task (the benign twin, in the same run). The key's rule and the words are tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import redis

from overnight.coordinator.tasks.judge import ending
from overnight.coordinator.tasks.prepare import build_prompt, step_limits
from overnight.coordinator.tasks.record import Memory
from overnight.coordinator.tasks.taskfile import TaskLimits, TaskSpec
from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.sandbox import launch
from overnight.worker.sandbox.limits import Limits, apply_cgroup
from tests.helpers import lacking, run_burst, task_file, worker_env

MIB = 1024**2


@pytest.mark.parametrize(
    ("table", "ok"),
    [
        ({"pids": 64, "memory": "512M", "disk": 10 * MIB}, True),
        ({"open_files": 0, "cpu": 60}, True),
        ({"pids": -1}, False),
        ({"memory": "lots"}, False),
        ({"threads": 4}, False),
    ],
)
def test_the_limits_key(table: dict[str, object], ok: bool) -> None:
    raw = {"assignment": "a", "verifier": [{"name": "t", "run": ["true"]}], "limits": table}
    if not ok:
        with pytest.raises(ValueError):
            TaskSpec.model_validate(raw)
        return
    spec = TaskSpec.model_validate(raw)
    assert spec.limits is not None
    merged = step_limits(spec)
    for key, value in table.items():
        expected = 512 * MIB if value == "512M" else value
        assert getattr(merged, key) == expected


def test_a_task_without_limits_gets_the_settings(env: dict[str, str]) -> None:
    raw = {"assignment": "a", "verifier": [{"name": "t", "run": ["true"]}]}
    plain = TaskSpec.model_validate(raw)
    assert step_limits(plain) == Limits(512, 4 * 1024**3, 4096, 3600, 2 * 1024**3)
    own = plain.model_copy(update={"limits": TaskLimits(pids=9)})
    assert step_limits(own) == Limits(9, 4 * 1024**3, 4096, 3600, 2 * 1024**3)


@pytest.mark.parametrize(
    ("note", "said"),
    [
        (
            "over-limit: process limit reached (40 processes)",
            "turn 2 agent killed: process limit reached (40 processes)",
        ),
        (
            "over-limit: memory limit reached (1 GiB)",
            "turn 2 agent killed: memory limit reached (1 GiB)",
        ),
    ],
)
def test_the_ending_names_the_limit(note: str, said: str) -> None:
    assert ending(2, "agent", False, "killed", note, 60) == said


def test_the_next_prompt_begins_with_it() -> None:
    spec = TaskSpec.model_validate(
        {"assignment": "fix it", "verifier": [{"name": "t", "run": ["true"]}]}
    )
    memory = Memory(
        unmet=["t"], rule="t", stopped="turn 1 agent killed: disk limit reached (1 GiB)"
    )
    prompt = build_prompt(spec, memory)
    assert "Your last turn was stopped: turn 1 agent killed: disk limit reached (1 GiB)." in prompt
    assert "stopped" not in build_prompt(spec, Memory(unmet=["t"], rule="t"))


def test_cgroup_files_are_written_where_the_controllers_are(tmp_path: Path) -> None:
    delegated, bare = tmp_path / "delegated", tmp_path / "bare"
    delegated.mkdir()
    bare.mkdir()
    for name in ("pids.max", "memory.max"):
        (delegated / name).write_text("max\n")
    assert apply_cgroup(str(delegated), Limits(pids=40, memory=MIB)) == ["pids.max", "memory.max"]
    assert (delegated / "pids.max").read_text() == "40"
    assert apply_cgroup(str(bare), Limits(pids=40, memory=MIB)) == []
    assert list(bare.iterdir()) == []


AGENT = """
import os, sys, time
told = "Your last turn was stopped: turn 1 agent killed: process limit reached (40 processes)"
if told in open(os.environ["OVERNIGHT_PROMPT_FILE"]).read():
    open("ok.txt", "w").write("ok")
    sys.exit(0)
while True:
    try:
        if os.fork() == 0:
            time.sleep(3600)
            os._exit(0)
    except OSError:
        time.sleep(0.05)
"""


@pytest.mark.parametrize("sandbox", ["bwrap", "off"])
def test_a_fork_bombing_agent_is_stopped_and_told(
    env: dict[str, str], tmp_path: Path, sandbox: str, r: redis.Redis, namespace: str
) -> None:
    CallEnvelope(r, "default", namespace).reset(100)
    if sandbox == "bwrap" and launch.find_bwrap() is None:
        lacking("bubblewrap is not installed")
    (tmp_path / "bomb").mkdir()
    (tmp_path / "bomb" / "agent.py").write_text(AGENT)
    agent = [sys.executable, "agent.py"]
    path = task_file(
        tmp_path,
        "bomb",
        agent,
        [["test", "-f", "ok.txt"]],
        workspace="in-place",
        limits={"pids": 40},
    )
    path.write_text(path.read_text().replace('limits = {"pids": 40}', "limits = { pids = 40 }"))
    done = run_burst(worker_env(env, OVERNIGHT_SANDBOX=sandbox), path, "bomb")
    shown = json.dumps(done, indent=1)
    assert done["state"] == "finished_verified", shown[-4000:]
    assert "turn 1 agent killed: process limit reached (40 processes)" in shown, shown[-4000:]
    assert done["turns"] == 2, shown[-4000:]
