"""``worker.pulse``: beat() and the pulse thread, against the real private Redis."""

from __future__ import annotations

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker import pulse
from overnight.worker.lease import LeaseDoc, LeaseRefused, Leases
from tests.helpers import wait_for


@pytest.fixture
def leases(r: redis.Redis, namespace: str) -> Leases:
    return Leases(r, Keys(namespace))


def _enter(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], doc: LeaseDoc) -> None:
    """Make this process look like a supervised child of ``doc``."""
    monkeypatch.setenv("OVERNIGHT_LEASE_ID", doc.lease_id)
    monkeypatch.setenv("OVERNIGHT_LEASE_TOKEN", str(doc.token))


def test_beat_outside_a_lease_raises(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OVERNIGHT_LEASE_ID", raising=False)
    with pytest.raises(pulse.NoLease):
        pulse.beat()
    monkeypatch.setenv("OVERNIGHT_LEASE_ID", "x")
    monkeypatch.setenv("OVERNIGHT_LEASE_TOKEN", "not-a-number")
    with pytest.raises(pulse.NoLease):
        pulse.beat()


def test_beat_renews_and_notes(
    env: dict[str, str], leases: Leases, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = leases.acquire(budget_sec=60, gap_sec=2)
    _enter(monkeypatch, env, doc)
    assert 1.5 < pulse.beat(note="halfway") <= 2.0
    after = leases.get(doc.lease_id)
    assert after is not None and after.note == "halfway"
    assert after.heartbeat_unix > doc.heartbeat_unix


def test_beat_with_a_stale_token_is_refused(
    env: dict[str, str], leases: Leases, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = leases.acquire(budget_sec=60, gap_sec=2)
    monkeypatch.setenv("OVERNIGHT_LEASE_ID", doc.lease_id)
    monkeypatch.setenv("OVERNIGHT_LEASE_TOKEN", str(doc.token + 1))
    with pytest.raises(LeaseRefused) as err:
        pulse.beat()
    assert err.value.reason == "stale-token"


def test_pulse_keeps_the_lease_alive_past_the_gap(
    env: dict[str, str], leases: Leases, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = leases.acquire(budget_sec=60, gap_sec=0.6)
    _enter(monkeypatch, env, doc)
    with pulse.pulse() as p:
        assert p.interval == pytest.approx(0.2)
        wait_for(lambda: p.beats >= 6, timeout=10)
        assert leases.is_alive(doc.lease_id)
    assert not p.alive and p.refused is None
    # Once the block is left nothing beats any more: the lease lapses.
    wait_for(lambda: not leases.is_alive(doc.lease_id), timeout=5)


def test_pulse_stops_for_good_once_refused(
    env: dict[str, str], leases: Leases, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = leases.acquire(budget_sec=60, gap_sec=1)
    _enter(monkeypatch, env, doc)
    with pulse.pulse(interval=0.05) as p:
        leases.end(doc.lease_id, doc.token, "killed", "reaped: test")
        wait_for(lambda: not p.alive, timeout=5)
        assert p.refused is not None and p.refused.reason == "not-running:killed"


def test_pulse_on_a_dead_lease_raises_at_once(
    env: dict[str, str], leases: Leases, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = leases.acquire(budget_sec=60, gap_sec=1)
    leases.end(doc.lease_id, doc.token, "done", "worker-complete")
    _enter(monkeypatch, env, doc)
    with pytest.raises(LeaseRefused), pulse.pulse():
        pytest.fail("the block must not run")
