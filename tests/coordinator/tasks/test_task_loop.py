"""The turn loop's logic in-process: real Redis for the task record, plain subprocess steps."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.tasks.loop import LoopConfig, ServerClock, TaskLoop
from overnight.coordinator.tasks.prepare import build_prompt
from overnight.coordinator.tasks.steps import StepOutcome, StepRequest, plain_runner
from overnight.coordinator.tasks.store import Begun, Memory, Runner, TaskStore
from overnight.coordinator.tasks.taskfile import Rule, TaskSpec
from overnight.worker.redisio import receipts
from tests.helpers import Budget

PY = sys.executable
real_time = time.time


def spec(tmp_path: Path, **kw: object) -> TaskSpec:
    data: dict[str, object] = {
        "assignment": "make ok.txt",
        "workdir": str(tmp_path),
        "agent": [PY, "-c", "print('hi')"],
        "max_calls": 10,
        "verifier": [Rule(name="has-ok", run=["test", "-f", "ok.txt"])],
        **kw,
    }
    return TaskSpec.model_validate(data)


def run_task(
    r: redis.Redis, namespace: str, tmp_path: Path, task: TaskSpec, budget: Budget | None = None
) -> tuple[str, TaskStore]:
    store = TaskStore(r, Keys(namespace))
    [rec] = store.create([task], queue="q")
    config = LoopConfig(claim_ttl=5, prompt_dir=tmp_path / "prompts")
    loop = TaskLoop(store, plain_runner, budget or Budget(100), config)
    return loop.run(rec.id, rec.attempt, Runner(worker="test")).label, store


def test_success_on_turn_one(r: redis.Redis, namespace: str, tmp_path: Path) -> None:
    task = spec(tmp_path, agent=["touch", "ok.txt"])
    state, store = run_task(r, namespace, tmp_path, task)
    assert state == "finished_verified"
    [rec] = store.all()
    assert (rec.state, rec.calls_used, rec.turns) == ("finished_verified", 2, 1)
    assert rec.checkpoint.last_verdict is not None and rec.checkpoint.last_verdict.ok
    assert not store.claim_alive(rec.id)
    kinds = [rc.kind for rc in receipts.read(r, Keys(namespace), task_id=rec.id)]
    assert kinds == [
        "task_submitted",
        "task_state",
        "step_finished",
        "step_finished",
        "verdict",
        "task_state",
    ]


def test_reprompted_with_the_unmet_rule(r: redis.Redis, namespace: str, tmp_path: Path) -> None:
    agent = (
        "import os, pathlib; p = pathlib.Path(os.environ['OVERNIGHT_PROMPT_FILE']).read_text();"
        "print('turn', os.environ['OVERNIGHT_TURN']);"
        "'has-ok' in p and pathlib.Path('ok.txt').touch()"
    )
    state, store = run_task(r, namespace, tmp_path, spec(tmp_path, agent=[PY, "-c", agent]))
    [rec] = store.all()
    assert (state, rec.turns, rec.calls_used) == ("finished_verified", 2, 4)


def test_ceiling_of_the_task(r: redis.Redis, namespace: str, tmp_path: Path) -> None:
    task = spec(tmp_path, agent=[PY, "-c", "import uuid; print(uuid.uuid4())"], max_calls=5)
    state, store = run_task(r, namespace, tmp_path, task)
    [rec] = store.all()
    assert state == "halted_at_call_ceiling"
    assert rec.calls_used == 5 and "max_calls" in rec.detail
    assert rec.turns == 3


def test_ceiling_of_the_envelope(r: redis.Redis, namespace: str, tmp_path: Path) -> None:
    task = spec(tmp_path, agent=[PY, "-c", "import uuid; print(uuid.uuid4())"], max_calls=50)
    budget = Budget(3)
    state, store = run_task(r, namespace, tmp_path, task, budget)
    [rec] = store.all()
    assert state == "halted_at_call_ceiling" and "envelope" in rec.detail
    assert rec.calls_used == 3 and budget.remaining == 0


def test_stuck_after_three_same_turns(r: redis.Redis, namespace: str, tmp_path: Path) -> None:
    state, store = run_task(r, namespace, tmp_path, spec(tmp_path, agent=["echo", "same"]))
    [rec] = store.all()
    assert state == "halted_stuck" and rec.turns == 3
    kinds = [rc.kind for rc in receipts.read(r, Keys(namespace), task_id=rec.id)]
    assert "task_stuck" in kinds


def test_expired_by_task_deadline(r: redis.Redis, namespace: str, tmp_path: Path) -> None:
    task = spec(tmp_path, agent=["sleep", "5"], deadline=0.5, lease_seconds=60)
    state, store = run_task(r, namespace, tmp_path, task)
    assert state == "expired"
    assert store.all()[0].ended_unix is not None


def test_prompt_names_exactly_the_unmet_rules(tmp_path: Path) -> None:
    task = spec(
        tmp_path,
        verifier=[Rule(name="a", run=["true"]), Rule(name="b", run=["false"])],
    )
    assert "b" not in build_prompt(task, None).split("Assignment:")[0]
    text = build_prompt(task, Memory(unmet=["b"], rule="b", note="worker-exit-1", evidence="E!"))
    assert "- b: `false`" in text and "- a:" not in text and "E!" in text
    assert "make ok.txt" in text


def test_refused_claim_runs_nothing(r: redis.Redis, namespace: str, tmp_path: Path) -> None:
    store = TaskStore(r, Keys(namespace))
    [rec] = store.create([spec(tmp_path)], queue="q")
    calls: list[StepRequest] = []

    def runner(req: StepRequest) -> StepOutcome:
        calls.append(req)
        return plain_runner(req)

    loop = TaskLoop(store, runner, Budget(10), LoopConfig(prompt_dir=tmp_path))
    assert loop.run(rec.id, 2, Runner()).label == "skipped:stale-attempt"
    assert calls == []
    raw = r.hgetall(Keys(namespace).task(rec.id))
    assert raw["state"] == "queued" and json.loads(raw["spec"])["id"] == rec.id


def test_task_times_are_redis_server_time(
    r: redis.Redis, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose wall clock is a day ahead neither expires the task nor stamps its times."""
    monkeypatch.setattr(time, "time", lambda: real_time() + 86_400)
    task = spec(tmp_path, agent=["touch", "ok.txt"], deadline=600)
    state, store = run_task(r, namespace, tmp_path, task)
    assert state == "finished_verified"
    [rec] = store.all()
    secs, micros = r.time()
    server = secs + micros / 1e6
    stamps = [rec.submitted_unix, rec.started_unix, rec.ended_unix, rec.updated_unix]
    assert all(s is not None and server - 60 < s <= server for s in stamps), (server, stamps)
    assert rec.ended_unix is not None and rec.started_unix is not None
    assert rec.ended_unix >= rec.started_unix >= rec.submitted_unix


class CountingStore(TaskStore):
    """A store that records which of its writes the loop called, in order."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        super().__init__(client, keys)
        self.calls: list[str] = []

    def begin(self, *args: Any, **kw: Any) -> Begun:
        self.calls.append("begin")
        return super().begin(*args, **kw)

    def save(self, *args: Any, **kw: Any) -> float:
        self.calls.append("save")
        return super().save(*args, **kw)


def test_one_write_to_begin_a_step_and_one_to_end_it(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    store = CountingStore(r, Keys(namespace))
    task = spec(tmp_path, agent=["touch", "ok.txt"])
    [rec] = store.create([task], queue="q")
    loop = TaskLoop(store, plain_runner, Budget(10), LoopConfig(prompt_dir=tmp_path))
    assert loop.run(rec.id, rec.attempt, Runner()).label == "finished_verified"
    assert store.calls == ["begin", "save", "begin", "save"]  # the agent, then one rule


def test_server_clock_runs_from_the_last_reply() -> None:
    clock = ServerClock(1_000.0)
    first = clock()
    assert first >= 1_000.0 and clock() >= first
    clock.set(5.0)
    assert 5.0 <= clock() < first
