"""The reaper's decisions, without processes: the pure rule, then passes on fakeredis."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import fakeredis
import pytest

from overnight.config.keys import Keys
from overnight.worker.lease.store import LeaseDoc, Leases
from overnight.worker.reaper.reaper import RECEIPT_KIND, Facts, decide, lease_tag, reap_once
from overnight.worker.redisio.receipts import read
from overnight.worker.supervise import procs
from overnight.worker.supervise.procs import TAG_VAR
from tests.helpers import wait_for

HOST = "here"
BOOT = "boot-1"
NOW = 1_000_000.0


def doc(**over: object) -> LeaseDoc:
    base: dict[str, object] = {
        "lease_id": "L1",
        "token": 7,
        "holder_pid": 4242,
        "pgid": 4242,
        "host": HOST,
        "budget_sec": 100.0,
        "started_unix": NOW - 50,
        "deadline_unix": NOW + 50,
        "heartbeat_unix": NOW - 3.2,
        "heartbeat_max_gap_sec": 3.0,
        "status": "running",
        "supervisor_pid": 4000,
        "child_start_ticks": 555,
        "boot_id": BOOT,
    }
    base.update(over)
    return LeaseDoc(**base)  # type: ignore[arg-type]


def rule(facts: Facts, now: float = NOW, hold_off: float = 7.0) -> tuple[str, str, str | None]:
    d = decide(facts, host=HOST, boot=BOOT, now=now, hold_off=hold_off)
    assert d.action in ("skip", "prune") or d.note.startswith("reaped: ")
    return d.action, d.why, d.status


def test_nothing_to_do_for_missing_ended_or_live_leases() -> None:
    assert rule(Facts(doc=None)) == ("prune", "no-document", None)
    assert rule(Facts(doc=doc(status="done"))) == ("prune", "already-done", None)
    assert rule(Facts(doc=doc(), alive=True)) == ("skip", "alive", None)


def test_supervisor_gone_kills_the_tree_as_killed_with_the_gap_in_the_note() -> None:
    d = decide(
        Facts(doc=doc(), holder_same=True, holder_exists=True, unproven=""),
        host=HOST,
        boot=BOOT,
        now=NOW,
        hold_off=7.0,
    )
    assert (d.action, d.status, d.signal_group) == ("reap", "killed", True)
    assert d.note == "reaped: heartbeat-gap-3.2s, supervisor-gone"


def test_past_deadline_is_expired() -> None:
    d = decide(
        Facts(doc=doc(deadline_unix=NOW - 1), holder_same=True, unproven=""),
        host=HOST,
        boot=BOOT,
        now=NOW,
        hold_off=7.0,
    )
    assert (d.action, d.status, d.note) == (
        "reap",
        "expired",
        "reaped: budget-exceeded, supervisor-gone",
    )


def test_reused_pid_is_never_signalled_as_a_group() -> None:
    d = decide(
        Facts(doc=doc(), holder_same=False, holder_exists=True, unproven=""),
        host=HOST,
        boot=BOOT,
        now=NOW,
        hold_off=7.0,
    )
    assert (d.action, d.why, d.signal_group) == ("reap", "pid-reused", False)
    assert rule(Facts(doc=doc(), unproven=""))[:2] == ("reap", "child-gone")
    assert rule(Facts(doc=doc(holder_pid=0)))[:2] == ("end", "never-attached")
    # Its supervisor died before recording the child, but its proof names it.
    attached_by_proof = Facts(doc=doc(holder_pid=0), holder_same=True, unproven="")
    assert rule(attached_by_proof)[:2] == ("reap", "supervisor-gone")


def test_without_a_proof_nothing_is_signalled_whatever_the_document_says() -> None:
    for facts in (
        Facts(doc=doc(), holder_same=True, holder_exists=True),
        Facts(doc=doc(), holder_same=True, unproven="proof token differs"),
        Facts(doc=doc(deadline_unix=NOW - 1), holder_same=True, unproven="no proof"),
    ):
        d = decide(facts, host=HOST, boot=BOOT, now=NOW, hold_off=7.0)
        assert (d.action, d.why, d.signal_group) == ("end", "unproven", False)
        assert d.note.endswith(f"unproven: {facts.unproven}")


def test_a_present_supervisor_gets_its_hold_off_then_is_overruled() -> None:
    facts = Facts(doc=doc(), holder_same=True, supervisor_present=True, unproven="")
    lapse = doc().lapse_unix
    assert rule(facts, now=lapse + 6.9) == ("skip", "supervisor-acting", None)
    assert rule(facts, now=lapse + 7.1)[:2] == ("reap", "supervisor-stuck")


def test_other_hosts() -> None:
    lost = Facts(doc=doc(host="elsewhere"), host_reaper_live=False, holder_same=True)
    d = decide(lost, host=HOST, boot=BOOT, now=NOW, hold_off=7.0)
    assert (d.action, d.status, d.note, d.signal_group) == (
        "end",
        "killed",
        "reaped: host-lost",
        False,
    )
    watched = Facts(doc=doc(host="elsewhere"), host_reaper_live=True)
    assert rule(watched) == ("skip", "host-has-reaper", None)


def test_a_lease_from_before_a_reboot_is_ended_without_signals() -> None:
    d = decide(Facts(doc=doc(boot_id="old-boot")), host=HOST, boot=BOOT, now=NOW, hold_off=7.0)
    assert (d.action, d.why, d.status) == ("end", "host-rebooted", "killed")


# --- passes on fakeredis (leases of other hosts only: no process is ever looked at) ---------


@pytest.fixture
def leases(fake: fakeredis.FakeRedis) -> Leases:
    return Leases(fake, Keys("unit"))


def lapsed_on(leases: Leases, host: str, *, budget: float = 60.0) -> LeaseDoc:
    d = leases.acquire(budget_sec=budget, gap_sec=0.01)
    leases.client.hset(leases.keys.lease(d.lease_id), "host", host)
    return d


def test_pass_ends_host_lost_and_leaves_watched_hosts_alone(leases: Leases) -> None:
    keys = leases.keys
    lost = lapsed_on(leases, "dead-host")
    watched = lapsed_on(leases, "busy-host")
    live = leases.acquire(budget_sec=60, gap_sec=60)
    leases.client.set(keys.reaper_host("busy-host"), "1", px=30_000)
    time.sleep(0.05)
    report = reap_once(leases.client, keys, grace=0.1, host=HOST)
    assert (report.lapsed, report.ended, report.skipped) == (2, 1, 1)
    ended = leases.get(lost.lease_id)
    assert ended is not None and (ended.status, ended.note) == ("killed", "reaped: host-lost")
    assert leases.get(watched.lease_id).status == "running"  # type: ignore[union-attr]
    assert leases.get(live.lease_id).status == "running"  # type: ignore[union-attr]
    kinds = [rc.kind for rc in read(leases.client, keys) if rc.lease_id == lost.lease_id]
    assert kinds == ["lease_acquired", RECEIPT_KIND]
    again = reap_once(leases.client, keys, grace=0.1, host=HOST)
    assert (again.lapsed, again.ended) == (1, 0)


def test_pass_renews_its_host_key(leases: Leases) -> None:
    reap_once(leases.client, leases.keys, host=HOST, host_ttl=30.0)
    ttl = leases.client.pttl(leases.keys.reaper_host(HOST))
    assert 25_000 < ttl <= 30_000


def test_stale_index_entries_are_pruned_but_running_leases_never(leases: Leases) -> None:
    keys = leases.keys
    gone = lapsed_on(leases, "dead-host")
    leases.client.delete(keys.lease(gone.lease_id))
    time.sleep(0.05)
    report = reap_once(leases.client, keys, host=HOST)
    assert report.pruned == 1
    assert leases.client.zscore(keys.lease_expiry, gone.lease_id) is None


def test_pass_pages_through_more_lapsed_leases_than_one_page(leases: Leases) -> None:
    keys = leases.keys
    leases.client.set(keys.reaper_host("busy-host"), "1", px=30_000)
    for _ in range(7):
        lapsed_on(leases, "busy-host")
    lost = [lapsed_on(leases, "dead-host") for _ in range(3)]
    time.sleep(0.05)
    report = reap_once(leases.client, keys, host=HOST, page=2)
    assert (report.lapsed, report.skipped, report.ended) == (10, 7, 3)
    assert all(leases.get(d.lease_id).status == "killed" for d in lost)  # type: ignore[union-attr]


def test_unreadable_document_is_left_alone(leases: Leases) -> None:
    keys = leases.keys
    bad = lapsed_on(leases, "dead-host")
    leases.client.hset(keys.lease(bad.lease_id), "token", "not-a-number")
    time.sleep(0.05)
    report = reap_once(leases.client, keys, host=HOST)
    assert (report.skipped, report.ended) == (1, 0)


def test_tag_reader_finds_only_the_exact_variable() -> None:
    env = {"PATH": os.environ.get("PATH", ""), f"X{TAG_VAR}": "decoy", TAG_VAR: "mine"}
    with subprocess.Popen(["sleep", "30"], env=env) as child:
        try:
            assert wait_for(lambda: lease_tag(child.pid), timeout=5) == "mine"
        finally:
            child.kill()
    untagged = subprocess.Popen(["sleep", "30"], env={f"X{TAG_VAR}": "decoy"})
    try:
        wait_for(lambda: procs.start_ticks(untagged.pid) and _comm(untagged.pid) == "sleep")
        assert lease_tag(untagged.pid) is None
    finally:
        untagged.kill()
        untagged.wait()
    assert lease_tag(2**22 + 12345) is None


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as fh:
        return fh.read().strip()


def test_run_keeps_going_after_a_failed_pass(
    monkeypatch: pytest.MonkeyPatch, fake: fakeredis.FakeRedis
) -> None:
    import redis

    from overnight.worker.reaper import reaper

    stop = threading.Event()
    calls: list[int] = []

    def flaky(*_a: object, **_k: object) -> reaper.PassReport:
        calls.append(1)
        if len(calls) == 1:
            raise redis.ConnectionError("down")
        if len(calls) == 2:
            raise RuntimeError("a bug")
        stop.set()
        return reaper.PassReport(host=HOST)

    monkeypatch.setattr(reaper, "reap_once", flaky)
    reaper.run(fake, Keys("unit"), interval=0.01, grace=0.1, host_ttl=1.0, stop=stop)
    assert len(calls) == 3
    with pytest.raises(RuntimeError):
        calls.clear()
        calls.append(1)
        reaper.run(
            fake,
            Keys("unit"),
            interval=0.01,
            grace=0.1,
            host_ttl=1.0,
            stop=threading.Event(),
            once=True,
        )
