"""Host beats: one script call renews every due lease of a host, each under its own checks
(``lease_beat_many.lua``), and the supervisors of a host share that call through their batch
folder (``worker.beat.batch``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import fakeredis
import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.beat.batch import HostBatch, Request, Seat, due, due_at, next_point
from overnight.worker.lease.store import LeaseDoc, Leases
from overnight.worker.supervise.keeper import Keeper
from tests.helpers import wait_for

# --- which leases are due in a batch: a table ------------------------------------------------


def req(renewed: float, seen: float, period: float = 10.0, lease_id: str = "a") -> Request:
    return Request(lease_id, 1, period, renewed, seen)


@pytest.mark.parametrize(
    ("renewed", "seen", "period", "now", "is_due", "why"),
    [
        (3.0, 5.0, 10.0, 10.0, True, "progress since the renewal, at its grid point"),
        (3.0, 5.0, 10.0, 9.9, False, "before its grid point"),
        (3.0, 3.0, 10.0, 10.0, False, "no progress since the renewal"),
        (3.0, 2.0, 10.0, 20.0, False, "progress older than the renewal"),
        (10.0, 10.5, 10.0, 20.0, True, "renewed at a grid point: due at the next one"),
        (10.0, 10.5, 10.0, 10.0, False, "never twice at one grid point"),
        (3.0, 12.0, 10.0, 10.0, False, "progress after the grid point: not yet"),
        (3.0, 12.0, 10.0, 20.0, True, "progress after the grid point: the next one"),
        (0.0, 0.1, 0.25, 0.25, True, "a short interval: its own grid"),
        (3.0, 5.0, 20.0, 10.0, False, "a longer interval is not due at a shorter one's point"),
        (3.0, 5.0, 10.0, 10.0 - 0.0005, True, "within float dust of the point"),
    ],
)
def test_which_leases_are_due(
    renewed: float, seen: float, period: float, now: float, is_due: bool, why: str
) -> None:
    r = req(renewed, seen, period)
    assert (due([r], now) == [r]) is is_due, why


def test_a_renewal_never_comes_later_than_an_interval_after_the_progress() -> None:
    for renewed in (0.0, 3.3, 9.99, 10.0):
        for seen in (renewed + 0.01, renewed + 5.0, renewed + 9.0, renewed + 25.0):
            at = due_at(req(renewed, seen))
            assert at <= max(renewed, seen) + 10.0 and at > renewed
            assert at == next_point(at - 10.0, 10.0)  # always a grid point


# --- the script: per-lease checks in one call ------------------------------------------------


@pytest.fixture(params=["fake", "real"])
def leases(request: pytest.FixtureRequest, namespace: str) -> Leases:
    client: redis.Redis
    if request.param == "fake":
        client = fakeredis.FakeRedis(decode_responses=True)
    else:
        client = request.getfixturevalue("r")
    return Leases(client, Keys(namespace))


def test_a_batch_renews_each_owned_live_lease(leases: Leases) -> None:
    docs = [leases.acquire(budget_sec=60, gap_sec=5) for _ in range(3)]
    time.sleep(0.05)  # so a renewal moves the TTL and the beat time measurably
    got = leases.beat_many([(d.lease_id, d.token) for d in docs])
    assert got == [5.0, 5.0, 5.0]
    for doc in docs:
        now = leases.get(doc.lease_id)
        assert now is not None and now.heartbeat_unix > doc.heartbeat_unix
        assert 4900 < leases.client.pttl(leases.keys.lease_alive(doc.lease_id)) <= 5000
        score = leases.client.zscore(leases.keys.lease_expiry, doc.lease_id)
        assert score is not None and abs(score / 1000 - now.lapse_unix) < 0.002


def test_a_lease_whose_owner_changed_is_refused_and_the_others_renewed(leases: Leases) -> None:
    a, b, c = (leases.acquire(budget_sec=60, gap_sec=5) for _ in range(3))
    got = leases.beat_many([(a.lease_id, a.token), (b.lease_id, b.token + 1), (c.lease_id, 7)])
    assert got == [5.0, "stale-token", "stale-token"]
    got = leases.beat_many([(a.lease_id, a.token), ("no-such-lease", 1), (c.lease_id, c.token)])
    assert got == [5.0, "unknown", 5.0]
    stale = leases.get(b.lease_id)
    assert stale is not None and stale.heartbeat_unix == b.heartbeat_unix


def test_an_ended_lease_is_refused(leases: Leases) -> None:
    a, b = (leases.acquire(budget_sec=60, gap_sec=5) for _ in range(2))
    leases.reap([(a.lease_id, a.token, "killed", "x")])  # live: the reaper refuses
    leases.client.delete(leases.keys.lease_alive(a.lease_id))
    assert leases.reap([(a.lease_id, a.token, "killed", "reaped: test")]) == [None]
    assert leases.beat_many([(a.lease_id, a.token), (b.lease_id, b.token)]) == [
        "not-running:killed",
        5.0,
    ]


def test_an_expired_lease_is_not_revived(leases: Leases) -> None:
    short = leases.acquire(budget_sec=60, gap_sec=0.2)
    live = leases.acquire(budget_sec=60, gap_sec=5)
    alive = leases.keys.lease_alive(short.lease_id)
    wait_for(lambda: not leases.client.exists(alive), timeout=10)
    got = leases.beat_many([(short.lease_id, short.token), (live.lease_id, live.token)])
    assert got == ["lapsed", 5.0]
    assert not leases.client.exists(alive)
    doc = leases.get(short.lease_id)
    assert doc is not None and doc.heartbeat_unix == short.heartbeat_unix


def test_a_lease_past_its_deadline_is_refused(leases: Leases) -> None:
    brief = leases.acquire(budget_sec=0.3, gap_sec=5)
    live = leases.acquire(budget_sec=60, gap_sec=5)
    time.sleep(0.35)  # past the deadline; whether the key has lapsed yet is Redis's timing
    got = leases.beat_many([(brief.lease_id, brief.token), (live.lease_id, live.token)])
    assert got[0] in ("deadline", "lapsed") and got[1] == 5.0


def test_a_renewal_never_passes_the_deadline(leases: Leases) -> None:
    doc = leases.acquire(budget_sec=2, gap_sec=5)
    (secs,) = leases.beat_many([(doc.lease_id, doc.token)])
    assert isinstance(secs, float) and 1.5 < secs <= 2.0


# --- one round trip per batch, on a private server --------------------------------------------


@pytest.fixture
def private(redis_factory: Callable[..., EmbeddedRedis], namespace: str) -> Iterator[Leases]:
    client = redis.Redis.from_url(redis_factory().url, decode_responses=True)
    yield Leases(client, Keys(namespace))
    client.close()


def scripts_run(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_eval"))


def test_one_round_trip_renews_a_hundred_leases(private: Leases) -> None:
    docs = [private.acquire(budget_sec=60, gap_sec=30) for _ in range(100)]
    private.beat_many([(docs[0].lease_id, docs[0].token)])  # the script is loaded
    private.client.config_resetstat()
    got = private.beat_many([(d.lease_id, d.token) for d in docs])
    assert got == [30.0] * 100
    assert scripts_run(private.client) == 1


def host_batch(leases: Leases, folder: Path) -> HostBatch:
    return HostBatch(Leases(leases.client, leases.keys), folder)


def test_the_supervisors_of_a_host_share_one_call(private: Leases, tmp_path: Path) -> None:
    folder = tmp_path / "run" / "ns" / "beats"
    docs = [private.acquire(budget_sec=60, gap_sec=30) for _ in range(20)]
    idle = docs[-1]  # no progress: no request, never renewed
    seats = [host_batch(private, folder) for _ in docs]  # one per supervisor
    now = time.monotonic()
    period = 0.5
    renewed = now - 0.01
    reqs = [Request(d.lease_id, d.token, period, renewed, now) for d in docs[:-1]]
    point = due_at(reqs[0])
    for seat, r in zip(seats, reqs, strict=False):
        seat.request(r)
    private.beat_many([(docs[0].lease_id, docs[0].token)])  # the script is loaded
    private.client.config_resetstat()
    wait_for(lambda: time.monotonic() >= point, timeout=5)
    results = [seat.collect(r, wait=5.0) for seat, r in zip(seats, reqs, strict=False)]
    assert all(got is not None and got.secs == 30.0 and not got.reason for got in results)
    assert scripts_run(private.client) == 1
    untouched = private.get(idle.lease_id)
    assert untouched is not None and untouched.heartbeat_unix == idle.heartbeat_unix
    # Served now: a later request is a new one, due at the next point, not renewed twice.
    later = dataclasses.replace(reqs[0], renewed=results[0].at, seen=time.monotonic())  # type: ignore[union-attr]
    assert due_at(later) > results[0].at  # type: ignore[union-attr]


def test_a_refusal_in_the_shared_call_reaches_only_its_lease(
    private: Leases, tmp_path: Path
) -> None:
    folder = tmp_path / "run" / "ns" / "beats"
    mine, theirs = (private.acquire(budget_sec=60, gap_sec=30) for _ in range(2))
    private.client.hset(private.keys.lease(theirs.lease_id), "token", str(theirs.token + 1))
    a, b = host_batch(private, folder), host_batch(private, folder)
    now = time.monotonic()
    ra = Request(mine.lease_id, mine.token, 0.2, now - 0.01, now)
    rb = Request(theirs.lease_id, theirs.token, 0.2, now - 0.01, now)
    a.request(ra)
    b.request(rb)
    wait_for(lambda: time.monotonic() >= due_at(ra), timeout=5)
    got_a, got_b = a.collect(ra, wait=5.0), b.collect(rb, wait=5.0)
    assert got_a is not None and got_a.secs == 30.0 and not got_a.reason
    assert got_b is not None and got_b.reason == "stale-token"


def test_keepers_renew_through_the_batch(private: Leases, tmp_path: Path) -> None:
    """Chatty keepers on one host: every lease stays renewed while the calls made are one per
    grid point, not one per lease."""
    folder = tmp_path / "run" / "ns" / "beats"
    gap, n = 0.9, 10
    keepers = []
    for _ in range(n):
        doc = private.acquire(budget_sec=60, gap_sec=gap)
        own = Leases(private.client, private.keys)
        now = time.monotonic()
        k = Keeper(own, doc, gap=gap, deadline=60, beat_while_alive=False, host="h", now=now)
        k.seat = Seat(HostBatch(own, folder), doc.lease_id, doc.token, k.renew_interval)
        keepers.append(k)
    private.beat_many([(keepers[0].lease_id, keepers[0].token)])  # the script is loaded
    private.client.config_resetstat()
    started = time.monotonic()
    first = [k.last_beat for k in keepers]
    while time.monotonic() < started + 4 * gap:
        for k in keepers:
            k.beat_pending = True  # a line of output
            assert k.tick(time.monotonic()) is None
        time.sleep(max(0.0, min(k.next_wake() for k in keepers) - time.monotonic()))
    assert all(k.last_beat > f for k, f in zip(keepers, first, strict=True))
    points = {round(k.last_beat / keepers[0].renew_interval) for k in keepers}
    assert len(points) == 1  # every keeper was last renewed at the same grid point
    calls = scripts_run(private.client)
    renewals = 4 * gap / keepers[0].renew_interval
    assert 1 <= calls <= renewals + 2  # per grid point, not per lease (that would be ~n x)
    for k in keepers:
        assert private.client.pttl(private.keys.lease_alive(k.lease_id)) > 0
        doc = private.get(k.lease_id)
        assert isinstance(doc, LeaseDoc) and doc.status == "running"


def _supervisors(url: str, namespace: str, folder: str, n: int, gap: float, until: float) -> None:
    """One process playing ``n`` chatty supervisors of one host; exit 1 if any lease ended."""
    client = redis.Redis.from_url(url, decode_responses=True)
    leases = Leases(client, Keys(namespace))
    keepers = []
    for _ in range(n):
        doc = leases.acquire(budget_sec=60, gap_sec=gap)
        k = Keeper(
            leases,
            doc,
            gap=gap,
            deadline=60,
            beat_while_alive=False,
            host="h",
            now=time.monotonic(),
        )
        k.seat = Seat(HostBatch(leases, Path(folder)), doc.lease_id, doc.token, k.renew_interval)
        k.beat_pending = True
        keepers.append(k)
    while time.monotonic() < until:
        for k in keepers:
            for _line in range(2):  # the tick that was due, then a line just after it
                k.beat_pending = True
                if k.tick(time.monotonic()) is not None:
                    raise SystemExit(1)
        time.sleep(max(0.0, min(k.next_wake() for k in keepers) - time.monotonic()))
    raise SystemExit(0)


def test_supervisor_processes_of_a_host_share_the_call(private: Leases, tmp_path: Path) -> None:
    """Three processes of chatty supervisors on one host: no lease lapses, and the calls are
    about one per grid point for all of them (separately: one per lease per interval)."""
    import multiprocessing

    folder = tmp_path / "run" / "ns" / "beats"
    url = private.client.connection_pool.connection_kwargs
    server = f"redis://:{url['password']}@{url['host']}:{url['port']}/0"
    gap, n, seconds = 3.0, 20, 6.0
    private.beat_many([])
    ctx = multiprocessing.get_context("fork")
    until = time.monotonic() + seconds
    procs = [
        ctx.Process(
            target=_supervisors, args=(server, private.keys.namespace, str(folder), n, gap, until)
        )
        for _ in range(3)
    ]
    private.client.config_resetstat()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=seconds + 30)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    stats = private.client.info("commandstats")
    renewals = int(stats.get("cmdstat_pexpire", {}).get("calls", 0))
    calls = scripts_run(private.client)
    assert renewals >= 3 * n * 3  # every lease renewed about every gap/3 over the run
    assert calls < renewals / 10, (calls, renewals)


def test_a_batch_drops_results_left_by_dead_supervisors(private: Leases, tmp_path: Path) -> None:
    import os

    folder = tmp_path / "run" / "ns" / "beats"
    doc = private.acquire(budget_sec=60, gap_sec=30)
    batch = host_batch(private, folder)
    now = time.monotonic()
    batch.request(Request(doc.lease_id, doc.token, 0.2, now - 0.01, now))
    left, fresh = folder / "res-dead-supervisor", folder / "res-live-supervisor"
    left.write_text("{}")
    fresh.write_text("{}")
    os.utime(left, (time.time() - 7200, time.time() - 7200))
    got = batch.flush(Request(doc.lease_id, doc.token, 0.2, now - 0.01, now))
    assert got.secs == 30.0
    assert not left.exists() and fresh.exists()
    batch.forget(doc.lease_id)
    assert sorted(p.name for p in folder.iterdir()) == ["res-live-supervisor"]
