"""The recovery index, retention and the recovery lead, on a real private Redis.

The task scripts keep two sorted sets that recovery reads instead of every task (claim
expiries of running tasks; queued tasks due a check of their RQ job) and an index of ended
tasks whose records expire after the retention. One process per namespace holds the lead.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.config.settings import Settings, load_settings
from overnight.coordinator.dispatch.lead import RecoveryLead
from overnight.coordinator.dispatch.recovery import recover
from overnight.coordinator.tasks.states import State
from overnight.coordinator.tasks.store import Checkpoint, Next, Runner, TaskStore
from overnight.coordinator.tasks.taskfile import Rule, TaskSpec
from overnight.worker.redisio import receipts
from tests.helpers import wait_for

RUNNER = Runner(host="h", pid=1, worker="w", job_id="j")


def _spec(tmp_path: Path) -> TaskSpec:
    return TaskSpec(
        assignment="x",
        workdir=str(tmp_path),
        agent=["true"],
        max_calls=3,
        verifier=[Rule(name="r", run=["true"])],
    )


def _settings(env: dict[str, str], **over: object) -> Settings:
    """Settings of ``env`` (the fixture put it in this process's environment)."""
    assert env["OVERNIGHT_REDIS_URL"]
    return load_settings(**over)


def _members(r: redis.Redis, key: str) -> dict[str, float]:
    return {str(k): float(v) for k, v in r.zrange(key, 0, -1, withscores=True)}


def test_scripts_keep_the_index(
    r: redis.Redis, env: dict[str, str], namespace: str, tmp_path: Path
) -> None:
    keys = Keys(namespace)
    store = TaskStore(r, keys, retention=3600, queued_grace=30)
    a, b, c = store.create([_spec(tmp_path)] * 3, "q")
    queued = _members(r, keys.task_queued)
    assert set(queued) == {a.id, b.id, c.id}
    assert all(abs(score - (a.submitted_unix + 30)) < 1 for score in queued.values())

    rec = store.claim(a.id, 1, "tok", 10.0, RUNNER)
    claims = _members(r, keys.task_claims)
    assert list(claims) == [a.id] and a.id not in _members(r, keys.task_queued)
    assert abs(claims[a.id] / 1000 - (store.now() + 10)) < 1
    store.renew(a.id, "tok", 20.0)
    assert abs(_members(r, keys.task_claims)[a.id] / 1000 - (store.now() + 20)) < 1

    store.save(rec, "tok", Next(Checkpoint(), State.FINISHED_VERIFIED, "done"))
    assert a.id not in _members(r, keys.task_claims)
    assert a.id in _members(r, keys.tasks_ended)
    assert 3500 < r.ttl(keys.task(a.id)) <= 3600

    store.abort(b.id, "no")
    assert b.id not in _members(r, keys.task_queued)
    assert b.id in _members(r, keys.tasks_ended)
    assert 3500 < r.ttl(keys.task(b.id)) <= 3600
    # A live task has no expiry.
    assert r.ttl(keys.task(c.id)) == -1


def test_a_lapsed_claim_is_found_by_the_index_and_requeued(
    r: redis.Redis, env: dict[str, str], namespace: str, tmp_path: Path
) -> None:
    keys = Keys(namespace)
    settings = _settings(env)
    store = TaskStore(r, keys, retention=3600)
    [a] = store.create([_spec(tmp_path)], "q")
    store.claim(a.id, 1, "tok", 0.05, RUNNER)
    wait_for(lambda: not r.exists(keys.task_claim(a.id)), timeout=5)
    rq_conn = redis.Redis.from_url(env["OVERNIGHT_REDIS_URL"])
    actions = recover(r, rq_conn, keys, settings)
    assert len(actions) == 1 and actions[0].startswith(f"{a.id}: queued: "), actions
    got = store.get(a.id)
    assert got is not None and (got.state, got.attempt) == (State.QUEUED, 2)
    assert a.id not in _members(r, keys.task_claims)
    assert a.id in _members(r, keys.task_queued)
    assert recover(r, rq_conn, keys, settings) == []  # nothing changed: nothing done


def test_a_queued_task_whose_job_is_gone_is_enqueued_again_once(
    r: redis.Redis, env: dict[str, str], namespace: str, tmp_path: Path
) -> None:
    keys = Keys(namespace)
    settings = _settings(env)
    store = TaskStore(r, keys, retention=3600, queued_grace=0.0)
    [a] = store.create([_spec(tmp_path)], "q")  # no RQ job was ever enqueued for it
    rq_conn = redis.Redis.from_url(env["OVERNIGHT_REDIS_URL"])
    time.sleep(0.01)  # its check is due at once (grace 0), in server time
    actions = recover(r, rq_conn, keys, settings)
    assert actions == [f"{a.id}: re-enqueued attempt 1"]
    # Its next check is a grace (the default 30 s for the pass's own store) away.
    assert _members(r, keys.task_queued)[a.id] > store.now() + 20
    assert recover(r, rq_conn, keys, settings) == []


def test_retention_forgets_ended_tasks_and_old_receipts(
    r: redis.Redis, env: dict[str, str], namespace: str, tmp_path: Path
) -> None:
    keys = Keys(namespace)
    settings = _settings(env, retention=1)
    store = TaskStore(r, keys, retention=1)
    [a, b] = store.create([_spec(tmp_path)] * 2, "q")
    store.abort(a.id, "gone")
    wait_for(lambda: not r.exists(keys.task(a.id)), timeout=10, interval=0.1)
    assert r.xlen(keys.receipts) > 0
    # Receipts written before the cut-off go by age (MINID); the pass sees them as old.
    rq_conn = redis.Redis.from_url(env["OVERNIGHT_REDIS_URL"])
    actions = recover(r, rq_conn, keys, settings, now=store.now() + 5)
    assert "retention: 1 ended task(s) forgotten" in actions
    assert store.ids() == [b.id]
    assert _members(r, keys.tasks_ended) == {}
    assert r.xlen(keys.receipts) == 0
    assert receipts.read(r, keys) == []


def test_one_process_leads_recovery(r: redis.Redis, namespace: str) -> None:
    keys = Keys(namespace)
    first, second = RecoveryLead(r, keys, 5.0), RecoveryLead(r, keys, 5.0)
    assert first.hold() and not second.hold()
    assert first.hold()  # renewing is holding
    first.release()
    assert second.hold() and not first.hold()
    r.delete(keys.recovery_leader)  # a leader that vanished: the lead is free again
    assert first.hold()


@pytest.mark.parametrize("queued", [10_000])
def test_a_pass_over_many_queued_tasks_reads_only_what_is_due(
    r: redis.Redis, env: dict[str, str], namespace: str, tmp_path: Path, queued: int
) -> None:
    keys = Keys(namespace)
    store = TaskStore(r, keys, retention=3600)
    spec = _spec(tmp_path)
    for _ in range(queued // 1000):
        store.create([spec] * 1000, "q")
    rq_conn = redis.Redis.from_url(env["OVERNIGHT_REDIS_URL"])
    r.execute_command("CONFIG", "RESETSTAT")
    assert recover(r, rq_conn, keys, _settings(env)) == []
    stats = r.info("commandstats")
    # No per-task reads: none of the 10,000 records or jobs is fetched.
    assert "cmdstat_hgetall" not in stats and "cmdstat_hmget" not in stats
    assert int(stats.get("cmdstat_zrangebyscore", {}).get("calls", 0)) >= 2
