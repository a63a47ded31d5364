"""The loop holds a uid of the pool for its task from claim to end: every step of the task (agent
and verifier rule) is asked to run as that uid, the task's prompt folder is its while the task
runs and overnight's after, and the uid is free again afterwards. With no uid free, the task
pauses with one line and runs nothing."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.tasks.loop import LoopConfig, TaskLoop
from overnight.coordinator.tasks.steps import StepOutcome, StepRequest, plain_runner
from overnight.coordinator.tasks.store import Runner, TaskStore
from overnight.coordinator.tasks.taskfile import Rule, TaskSpec
from overnight.worker.sandbox.stepuser import any_of
from overnight.worker.sandbox.uidpool import UidPool
from tests.helpers import Budget

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="handing folders to a uid needs root")


def run(
    r: redis.Redis, namespace: str, tmp_path: Path, uid: int
) -> tuple[str, str, list[StepRequest]]:
    task = TaskSpec.model_validate(
        {
            "assignment": "make ok.txt",
            "workdir": str(tmp_path),
            "agent": [sys.executable, "-c", "open('ok.txt', 'w').close()"],
            "max_calls": 10,
            "verifier": [Rule(name="has-ok", run=["test", "-f", "ok.txt"])],
        }
    )
    store = TaskStore(r, Keys(namespace))
    [rec] = store.create([task], queue="q")
    asked: list[StepRequest] = []

    def runner(req: StepRequest) -> StepOutcome:
        asked.append(req)
        return plain_runner(req)

    config = LoopConfig(
        claim_ttl=5,
        prompt_dir=tmp_path / "prompts",
        state_dir=tmp_path / "state",
        step_user=any_of(uid, uid),
    )
    end = TaskLoop(store, runner, Budget(100), config).run(rec.id, rec.attempt, Runner(worker="t"))
    got = store.get(rec.id)
    assert got is not None
    return end.label, got.detail, asked


@pytest.fixture
def uid() -> int:
    """A uid of a high range no account and no other test uses."""
    return 1_700_000_000 + secrets.randbelow(10_000_000)


def test_every_step_of_a_task_runs_as_the_uid_it_holds(
    r: redis.Redis, namespace: str, tmp_path: Path, uid: int
) -> None:
    state, _, asked = run(r, namespace, tmp_path, uid)
    assert state == "finished_verified"
    assert [req.name for req in asked] == ["agent", "has-ok"]
    for req in asked:
        assert req.user is not None and req.user.pool is None, req.user
        assert (req.user.uid, req.user.gid, req.user.groups) == (uid, uid, ())
    prompts = Path(asked[0].env["OVERNIGHT_PROMPT_FILE"]).parent
    assert prompts.stat().st_uid == 0  # given back at the end
    again = UidPool(uid, uid).take("another task")  # and the uid is free again
    again.release()


def test_no_free_uid_pauses_the_task_and_runs_nothing(
    r: redis.Redis, namespace: str, tmp_path: Path, uid: int
) -> None:
    held = UidPool(uid, uid).take("a task that holds it")
    try:
        state, detail, asked = run(r, namespace, tmp_path, uid)
    finally:
        held.release()
    assert state == "paused_for_reconciliation" and asked == []
    assert detail.startswith("no step uid:") and f"{uid}-{uid}" in detail, detail
    assert "\n" not in detail
