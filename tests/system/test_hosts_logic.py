"""Tables for the multi-host rules: the host id setting, and when a task's step may be
re-run (no lease of it could still be alive on any host)."""

from __future__ import annotations

import threading

import pytest
import redis

from overnight.config import validate
from overnight.config.keys import Keys
from overnight.config.settings import ConfigError, load_settings
from overnight.coordinator.dispatch import rerun
from overnight.worker.lease.store import LeaseDoc
from overnight.worker.reaper.listen import Listener, wanted_flags
from overnight.worker.supervise.keeper import Keeper
from tests.helpers import wait_for


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"OVERNIGHT_HOST_ID": "host-a"}, "host-a"),
        ({"OVERNIGHT_HOST_ID": "node1.rack2_b"}, "node1.rack2_b"),
        ({"OVERNIGHT_HOST_ID": ""}, None),  # empty is unset: the host name
        ({}, None),
        ({"OVERNIGHT_HOST_ID": "a b"}, None),  # invalid: the host name here, exit 78 elsewhere
        ({"OVERNIGHT_HOST_ID": "x:y"}, None),
    ],
)
def test_this_host(environ: dict[str, str], expected: str | None) -> None:
    import socket

    assert validate.this_host(environ) == (expected or socket.gethostname())


@pytest.mark.parametrize("bad", ["a b", "-lead", "x:y", "h" * 254, "{slot}"])
def test_a_bad_host_id_names_the_variable(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERNIGHT_HOST_ID", bad)
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert caught.value.variable == "OVERNIGHT_HOST_ID"
    assert validate.read_fast({"OVERNIGHT_HOST_ID": bad}, dotenv=False) is None


def test_the_host_id_setting_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERNIGHT_HOST_ID", "host-b")
    assert load_settings().host_id == "host-b"


# --- when a lost task's step may run again ---------------------------------------------------


def lease(status: str, note: str, heartbeat: float = 100.0, gap: float = 6.0) -> LeaseDoc:
    return LeaseDoc(
        lease_id="l1",
        token=1,
        budget_sec=600.0,
        started_unix=90.0,
        deadline_unix=690.0,
        heartbeat_unix=heartbeat,
        heartbeat_max_gap_sec=gap,
        status=status,
        note=note,
        host="h1",
        task_id="t",
    )  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("status", "note", "until"),
    [
        ("running", "boot", 106.0 + 2.5),  # may run until its lapse plus grace and margin
        ("killed", "reaped: host-lost", 106.0 + 2.5),  # ended in Redis, not on its host
        ("done", "worker-complete", None),  # its supervisor ended it: the tree is gone
        ("killed", "lease-lost", None),  # its supervisor failed closed, then wrote the end
        ("killed", "reaped: heartbeat-gap", None),  # its host's reaper killed the tree first
        ("expired", "budget-exceeded", None),
    ],
)
def test_alive_until(status: str, note: str, until: float | None) -> None:
    assert rerun.alive_until(lease(status, note), rerun.kill_margin(1.5)) == until


def test_rerun_waits_for_the_latest_lease() -> None:
    docs = [
        lease("done", "worker-complete"),
        lease("running", "x", heartbeat=104.0),
        lease("killed", "reaped: host-lost", heartbeat=101.0),
    ]
    found = rerun.rerun_at(docs, 1.0)
    assert found is not None and found[0] == 111.0 and found[1] is docs[1]
    assert rerun.rerun_at(docs[:1], 1.0) is None
    assert rerun.rerun_at([], 1.0) is None


# --- a supervisor cut off from Redis ends its step before the server could lapse it ---------


class CutLeases:
    """Leases on a server that answers until ``cut`` and never after (every call then
    blocks for ``block`` seconds on the clock before it fails)."""

    def __init__(self, clock: list[float], gap: float, cut: float, block: float) -> None:
        self.clock, self.gap, self.cut, self.block = clock, gap, cut, block
        self.server_lapse = gap  # the liveness key's lapse, on the same clock

    def _reach(self) -> None:
        if self.clock[0] >= self.cut:
            self.clock[0] += self.block
            raise redis.ConnectionError("cut off")

    def beat(self, lease_id: str, token: int) -> float:
        self._reach()
        self.server_lapse = self.clock[0] + self.gap
        return self.gap

    def probe(self, lease_id: str) -> tuple[int, LeaseDoc, float]:
        self._reach()
        return int((self.server_lapse - self.clock[0]) * 1000), lease("running", "x"), 0.0


@pytest.mark.parametrize(
    ("gap", "cut", "block"),
    [(6.0, 3.0, 1.0), (6.0, 0.1, 0.4), (0.5, 0.3, 0.125), (30.0, 10.0, 1.0), (6.0, 5.9, 1.0)],
)
def test_a_cut_off_supervisor_ends_its_step_before_the_lapse(
    gap: float, cut: float, block: float
) -> None:
    clock = [0.0]
    fake = CutLeases(clock, gap, cut, block)
    keeper = Keeper(
        fake,
        lease("running", "boot"),
        gap=gap,
        deadline=600.0,  # type: ignore[arg-type]
        beat_while_alive=True,
        host="h",
        now=0.0,
        clock=lambda: clock[0],
        io_budget=3 * block,
    )
    while clock[0] < 10 * gap:
        clock[0] = max(clock[0] + 0.01, keeper.next_wake())  # a poll loop never stands still
        ended = keeper.tick(clock[0])
        if ended is not None:
            break
    assert ended is not None and (ended.note, ended.exit_code) == ("lease-lost", 4)
    assert clock[0] < fake.server_lapse  # the step is being ended while the key still lives


# --- the reaper hears a liveness key lapse ---------------------------------------------------


@pytest.mark.parametrize(
    ("current", "wanted"),
    [("", "Kx"), ("Ex", "ExK"), ("KEA", None), ("Kx", None), ("K", "Kx"), ("Elg", "ElgKx")],
)
def test_wanted_flags_only_add(current: str, wanted: str | None) -> None:
    assert wanted_flags(current) == wanted


def test_the_listener_wakes_on_a_lapsed_liveness_key(r: redis.Redis, namespace: str) -> None:
    keys = Keys(namespace)
    stop = threading.Event()
    ear = Listener(r, keys, stop).start()
    try:
        wait_for(lambda: ear.enabled is not None, timeout=10)
        assert ear.enabled, "the test server allows CONFIG SET"
        assert "K" in str(r.config_get("notify-keyspace-events")["notify-keyspace-events"])
        r.set(keys.lease_alive("other"), "1")  # no expiry: no event
        # An expiry before the subscription is in place goes unheard: wait for it (this
        # server has no other pattern subscriber), then lapse exactly one key.
        wait_for(lambda: r.pubsub_numpat() >= 1, timeout=10)
        lapsing = keys.lease_alive("lapsing")
        r.set(lapsing, "1", px=20)
        wait_for(lambda: not r.exists(lapsing), timeout=10)  # deleted: its event is out
        wait_for(lambda: ear.heard >= 1, timeout=10)
        assert ear.heard == 1
        assert ear.wait(5.0) is True  # woken, not timed out
        assert ear.wait(0.05) is False  # the one event is spent; no other key can lapse
    finally:
        stop.set()
        ear.thread.join(5)
