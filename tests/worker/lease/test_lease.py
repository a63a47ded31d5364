"""The lease's Lua rules, on fakeredis and on the real private redis-server, plus pure helpers."""

from __future__ import annotations

import json
import os

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.lease.store import (
    CONTRACT_FIELDS,
    STREAM_MAXLEN,
    LeaseCorrupt,
    LeaseDoc,
    LeaseRefused,
    Leases,
    lapse_reason,
    lapsed_reason,
    status_for,
)
from overnight.worker.redisio import receipts
from tests.helpers import wait_for


@pytest.fixture(params=["fake", "real"])
def client(request: pytest.FixtureRequest) -> redis.Redis:
    """Each rule runs on fakeredis (lupa) and on real Redis (Lua 5.1, real TTLs)."""
    return request.getfixturevalue("fake" if request.param == "fake" else "r")


@pytest.fixture
def leases(client: redis.Redis, namespace: str) -> Leases:
    return Leases(client, Keys(namespace))


@pytest.fixture
def real(r: redis.Redis, namespace: str) -> Leases:
    """The holder's end checks its end key with redis.sha1hex, which fakeredis lacks: its
    tests run on real Redis only."""
    return Leases(r, Keys(namespace))


def _receipts(leases: Leases) -> list[dict[str, object]]:
    rows = leases.client.xrange(leases.keys.receipts)
    return [{"kind": f["kind"], **json.loads(f["data"])} for _id, f in rows]


def test_acquire_writes_a_running_document(leases: Leases) -> None:
    doc = leases.acquire(budget_sec=60, gap_sec=5, note="boot", supervisor_pid=os.getpid())
    assert doc.status == "running" and doc.note == "boot"
    assert doc.holder_pid == 0 and doc.supervisor_pid == os.getpid()
    assert doc.deadline_unix == pytest.approx(doc.started_unix + 60, abs=1e-3)
    assert list(doc.public())[: len(CONTRACT_FIELDS)] == list(CONTRACT_FIELDS)
    assert leases.is_alive(doc.lease_id)
    pttl = leases.client.pttl(leases.keys.lease_alive(doc.lease_id))
    assert 4000 < pttl <= 5000


def test_tokens_grow(leases: Leases) -> None:
    tokens = [leases.acquire(budget_sec=60, gap_sec=5).token for _ in range(5)]
    assert tokens == sorted(tokens) and len(set(tokens)) == 5


def test_acquire_of_an_existing_id_is_refused(leases: Leases) -> None:
    leases.acquire(budget_sec=60, gap_sec=5, lease_id="same")
    with pytest.raises(LeaseRefused) as err:
        leases.acquire(budget_sec=60, gap_sec=5, lease_id="same")
    assert err.value.reason == "exists"


def test_stale_token_is_refused_for_beat_note_and_end(leases: Leases) -> None:
    doc = leases.acquire(budget_sec=60, gap_sec=5)
    stale = doc.token - 1
    for call in (
        lambda: leases.beat(doc.lease_id, stale),
        lambda: leases.set_note(doc.lease_id, stale, "forged"),
        lambda: leases.end(doc.lease_id, stale, "done", "forged"),
        lambda: leases.attach(doc.lease_id, stale, pid=1, pgid=1, start=1),
    ):
        with pytest.raises(LeaseRefused) as err:
            call()
        assert err.value.reason == "stale-token"
    after = leases.get(doc.lease_id)
    assert after is not None and after.status == "running" and after.note == "boot"


def test_beat_renews_and_sets_the_note(leases: Leases) -> None:
    doc = leases.acquire(budget_sec=60, gap_sec=5)
    left = leases.beat(doc.lease_id, doc.token, note="step 1")
    assert 4.0 < left <= 5.0
    after = leases.get(doc.lease_id)
    assert after is not None and after.note == "step 1"
    assert after.heartbeat_unix >= doc.heartbeat_unix


def test_beat_is_capped_at_the_deadline(leases: Leases) -> None:
    doc = leases.acquire(budget_sec=2, gap_sec=30)
    assert leases.beat(doc.lease_id, doc.token) <= 2.0


def test_terminal_status_is_final(real: Leases) -> None:
    doc = real.acquire(budget_sec=60, gap_sec=5)
    real.end(doc.lease_id, doc.token, "done", "worker-complete", exit_code=0)
    for status in ("killed", "expired", "done"):
        with pytest.raises(LeaseRefused) as err:
            real.end(doc.lease_id, doc.token, status, "again")  # type: ignore[arg-type]
        assert err.value.reason == "already-ended:done"
    after = real.get(doc.lease_id)
    assert after is not None
    assert (after.status, after.note, after.exit_code) == ("done", "worker-complete", 0)
    assert after.ended_unix is not None and not real.is_alive(doc.lease_id)


def test_beat_and_note_after_end_are_refused(real: Leases) -> None:
    doc = real.acquire(budget_sec=60, gap_sec=5)
    real.end(doc.lease_id, doc.token, "killed", "worker-exit-3", exit_code=3)
    with pytest.raises(LeaseRefused) as err:
        real.beat(doc.lease_id, doc.token)
    assert err.value.reason == "not-running:killed"
    with pytest.raises(LeaseRefused):
        real.set_note(doc.lease_id, doc.token, "late")


def test_beat_after_the_liveness_key_lapsed_is_refused(leases: Leases) -> None:
    doc = leases.acquire(budget_sec=60, gap_sec=0.1)
    wait_for(lambda: not leases.is_alive(doc.lease_id), timeout=5)
    with pytest.raises(LeaseRefused) as err:
        leases.beat(doc.lease_id, doc.token)
    assert err.value.reason == "lapsed"
    with pytest.raises(LeaseRefused):
        leases.set_note(doc.lease_id, doc.token, "late")
    after = leases.get(doc.lease_id)
    assert after is not None and after.status == "running"  # only an end makes it terminal
    assert doc.lease_id in leases.lapsed_ids()


def test_unknown_lease_is_refused(leases: Leases) -> None:
    with pytest.raises(LeaseRefused) as err:
        leases.beat("nope", 1)
    assert err.value.reason == "unknown"


def test_an_ended_lease_writes_exactly_one_receipt(real: Leases) -> None:
    doc = real.acquire(budget_sec=60, gap_sec=5, task_id="t1")
    real.end(
        doc.lease_id,
        doc.token,
        "expired",
        "budget-exceeded",
        exit_code=2,
        receipt_kind="subprocess_lease_expired",
    )
    with pytest.raises(LeaseRefused):
        real.end(doc.lease_id, doc.token, "killed", "again")
    ended = [rc for rc in _receipts(real) if rc["kind"] != "lease_acquired"]
    assert len(ended) == 1
    assert ended[0]["kind"] == "subprocess_lease_expired"
    assert ended[0]["lease_id"] == doc.lease_id and ended[0]["task_id"] == "t1"
    want = {
        "status": "expired",
        "note": "budget-exceeded",
        "exit_code": 2,
        "writer": "supervisor",
        "token": doc.token,
    }
    assert ended[0]["data"] == want


def test_reap_waits_for_the_lapse_and_never_writes_done(leases: Leases) -> None:
    doc = leases.acquire(budget_sec=60, gap_sec=0.2)
    assert leases.reap([(doc.lease_id, doc.token, "killed", "reaped: x")]) == ["alive"]
    wait_for(lambda: not leases.is_alive(doc.lease_id), timeout=5)
    assert leases.reap([(doc.lease_id, doc.token, "done", "reaped: x")]) == ["bad-status"]
    assert leases.reap([(doc.lease_id, doc.token + 1, "killed", "x")]) == ["stale-token"]
    assert leases.reap([(doc.lease_id, doc.token, "killed", "reaped: x")]) == [None]
    assert doc.lease_id not in leases.lapsed_ids()
    assert leases.reap([(doc.lease_id, doc.token, "expired", "again")]) == ["already-ended:killed"]
    ended = [rc for rc in _receipts(leases) if rc["kind"] != "lease_acquired"]
    assert [rc["data"] for rc in ended] == [
        {"status": "killed", "note": "reaped: x", "writer": "reaper", "token": doc.token}
    ]


def test_only_the_holder_of_the_end_key_may_end_a_lease(real: Leases) -> None:
    doc = real.acquire(budget_sec=60, gap_sec=5)
    stranger = Leases(real.client, real.keys)  # has the token, not the end key
    with pytest.raises(LeaseRefused) as err:
        stranger.end(doc.lease_id, doc.token, "done", "forged")
    assert err.value.reason == "end-key"
    real.end(doc.lease_id, doc.token, "done", "worker-complete", exit_code=0)


def test_the_end_key_check_is_never_skipped_on_fakeredis(fake: redis.Redis) -> None:
    leases = Leases(fake, Keys("unit"))
    doc = leases.acquire(budget_sec=60, gap_sec=5)
    # fakeredis's Lua has no redis.sha1hex: the holder's end fails rather than skip the check.
    with pytest.raises(redis.ResponseError):
        leases.end(doc.lease_id, doc.token, "done", "worker-complete")
    after = leases.get(doc.lease_id)
    assert after is not None and after.status == "running"


def test_probe_reports_ttl_document_and_server_time(leases: Leases) -> None:
    doc = leases.acquire(budget_sec=60, gap_sec=5)
    pttl, seen, now = leases.probe(doc.lease_id)
    assert 4000 < pttl <= 5000 and seen is not None and seen.token == doc.token
    assert now >= doc.started_unix
    assert leases.probe("missing")[:2] == (-2, None)


def test_recent_lists_newest_first(leases: Leases) -> None:
    ids = {leases.acquire(budget_sec=60, gap_sec=5).lease_id for _ in range(3)}
    docs = leases.recent(10)
    assert {d.lease_id for d in docs} == ids
    started = [d.started_unix for d in docs]
    assert started == sorted(started, reverse=True)


# --- pure helpers ------------------------------------------------------------------------


def _doc(**kw: object) -> LeaseDoc:
    base: dict[str, object] = dict(
        lease_id="x",
        token=1,
        budget_sec=10,
        started_unix=100.0,
        deadline_unix=110.0,
        heartbeat_unix=100.0,
        heartbeat_max_gap_sec=2.0,
        status="running",
    )
    base.update(kw)
    return LeaseDoc(**base)  # type: ignore[arg-type]


def test_lapse_reason_is_a_pure_predicate() -> None:
    doc = _doc()
    assert lapse_reason(doc, 101.9) is None
    assert lapse_reason(doc, 102.5) == "heartbeat-gap-2.5s"
    assert lapse_reason(doc, 110.0) == "budget-exceeded"
    assert lapse_reason(_doc(heartbeat_unix=109.0), 110.5) == "budget-exceeded"


def test_lapsed_reason_never_answers_none() -> None:
    doc = _doc()
    # The key vanished a hair before heartbeat + gap (TTL rounding): still a gap lapse.
    assert lapsed_reason(doc, 101.9995) == "heartbeat-gap-2.0s"
    assert lapsed_reason(_doc(heartbeat_unix=109.0), 109.999) == "budget-exceeded"
    assert status_for("budget-exceeded") == "expired"
    assert status_for("heartbeat-gap-2.0s") == "killed"


def test_from_hash_parses_and_rejects_corrupt_records() -> None:
    raw = {k: str(v) for k, v in _doc().model_dump().items() if v is not None}
    raw.update(exit_code="", ended_unix="", task_id="", child_start_ticks="")
    doc = LeaseDoc.from_hash(raw)
    assert doc.exit_code is None and doc.task_id is None and doc.token == 1
    for broken in (
        {"token": "abc"},
        {"status": "zombie"},
        {"deadline_unix": ""},
        {"heartbeat_unix": "nan"},
    ):
        with pytest.raises(LeaseCorrupt):
            LeaseDoc.from_hash({**raw, **broken})
    missing = dict(raw)
    del missing["budget_sec"]
    with pytest.raises(LeaseCorrupt, match="budget_sec"):
        LeaseDoc.from_hash(missing)


def test_stream_cap_matches_receipts() -> None:
    assert STREAM_MAXLEN == receipts.STREAM_MAXLEN


def test_acquire_refuses_a_nonpositive_budget_or_gap(leases: Leases) -> None:
    for budget, gap in ((0, 5), (60, 0), (-1, 5)):
        with pytest.raises(LeaseRefused) as err:
            leases.acquire(budget_sec=budget, gap_sec=gap)
        assert err.value.reason == "bad-args"
