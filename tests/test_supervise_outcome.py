"""How a step ends, row by row of contract section 2's table, and when the supervisor's own
clock ends it whatever Redis says: pure, no Redis, no processes."""

from __future__ import annotations

import dataclasses
import signal
from typing import Any

import pytest

from overnight.worker import outcome
from overnight.worker.keeper import Keeper
from overnight.worker.lease import LeaseDoc, LeaseRefused


@pytest.mark.parametrize(
    ("exited", "status", "row"),
    [
        (True, 0, ("done", "worker-complete", 0)),
        (True, 3, ("killed", "worker-exit-3", 3)),
        (False, 9, ("killed", "worker-signal-9", 137)),
    ],
)
def test_child_endings(exited: bool, status: int, row: tuple[str, str, int]) -> None:
    o = outcome.child_ended(exited, status)
    assert (o.status, o.note, o.exit_code) == row and o.write and not o.lost


def test_supervisor_signal_is_forwarded_first_and_exits_128_plus_s() -> None:
    o = outcome.by_signal(signal.SIGINT)
    assert (o.status, o.note, o.exit_code, o.first_signal) == (
        "killed", "supervisor-signal-2", 130, signal.SIGINT)  # fmt: skip


def test_lapses_expire_or_kill() -> None:
    budget = outcome.lapsed("budget-exceeded")
    gap = outcome.lapsed("heartbeat-gap-1.0s")
    assert (budget.status, budget.exit_code) == ("expired", 2)
    assert (gap.status, gap.note, gap.exit_code) == ("killed", "heartbeat-gap-1.0s", 3)
    assert budget.receipt_kind == gap.receipt_kind == "subprocess_lease_expired"


def test_lost_elsewhere_and_unstartable() -> None:
    assert (outcome.lost().note, outcome.lost().exit_code, outcome.lost().lost) == (
        "lease-lost", 4, True)  # fmt: skip
    elsewhere = outcome.ended_elsewhere("expired")
    assert not elsewhere.write and elsewhere.note == "ended-elsewhere:expired"
    assert outcome.not_started(FileNotFoundError()).exit_code == 127
    assert outcome.not_started(PermissionError()).note == "worker-exit-126"
    assert outcome.aborted(RuntimeError()).note == "supervisor-error:RuntimeError"


# --- the keeper's own clock: Redis can end a step sooner, never later -----------------------

T0 = 1_000_000.0  # server time at acquire; local monotonic time starts at 0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeLeases:
    """The lease scripts' arithmetic on a fake server clock (``T0`` + local time).

    ``pushed``: the child holds the token and keeps ``deadline_unix`` an hour ahead and the
    liveness key alive for an hour (HSET + PEXPIRE). ``child_beats``: server times at which
    the child beats through Redis itself. ``cut_at``: the key is deleted then (Redis ends
    the step sooner).
    """

    def __init__(
        self,
        clock: Clock,
        gap: float,
        deadline: float,
        *,
        pushed: bool = False,
        child_beats: tuple[float, ...] = (),
        cut_at: float | None = None,
    ) -> None:
        self.clock, self.gap, self.pushed = clock, gap, pushed
        self.child_beats, self.cut_at = list(child_beats), cut_at
        self.doc = LeaseDoc("L1", 7, deadline, T0, T0 + deadline, T0, gap, "running")
        self.alive_until = T0 + min(gap, deadline)

    def _now(self) -> float:
        now = T0 + self.clock.t
        while self.child_beats and T0 + self.child_beats[0] <= now:
            at = T0 + self.child_beats.pop(0)
            self.doc.heartbeat_unix = at
            self.alive_until = max(self.alive_until, min(at + self.gap, self.doc.deadline_unix))
        if self.pushed:
            self.doc.deadline_unix = now + 3600
            self.alive_until = now + 3600
        if self.cut_at is not None and now >= T0 + self.cut_at:
            self.alive_until = min(self.alive_until, T0 + self.cut_at)
        return now

    def beat(self, lease_id: str, token: int) -> float:
        now = self._now()
        if now >= self.alive_until:
            raise LeaseRefused(lease_id, "lapsed")
        lapse = min(now + self.gap, self.doc.deadline_unix)
        self.alive_until = max(lapse, self.alive_until) if self.pushed else lapse
        self.doc.heartbeat_unix = now
        return lapse - now

    def probe(self, lease_id: str) -> tuple[int, LeaseDoc, float]:
        now = self._now()
        pttl = -2 if now >= self.alive_until else int((self.alive_until - now) * 1000)
        return pttl, dataclasses.replace(self.doc), now

    def attach(self, *args: object, **kwargs: object) -> None:
        pass


def drive(
    fake: FakeLeases,
    clock: Clock,
    *,
    output_every: float | None,
    beat_while_alive: bool = False,
    limit: float = 100.0,
) -> tuple[outcome.Outcome, float]:
    """The supervisor's poll loop without processes: output lines every ``output_every``
    seconds, else wake when the keeper asks; the outcome and when it came."""
    keeper = Keeper(
        fake,  # type: ignore[arg-type]
        dataclasses.replace(fake.doc),
        gap=fake.gap,
        deadline=fake.doc.budget_sec,
        beat_while_alive=beat_while_alive,
        host="h",
        now=0.0,
        clock=clock,
    )
    next_line = output_every
    while clock.t < limit:
        wake = keeper.next_wake()
        if next_line is not None and output_every is not None and next_line <= wake:
            clock.t = max(clock.t, next_line)
            keeper.beat_pending = True
            next_line += output_every
        else:
            clock.t = max(clock.t, wake)
        ended = keeper.tick(clock.t)
        if ended is not None:
            return ended, clock.t
    raise AssertionError(f"still running at {limit}s")


@pytest.mark.parametrize(
    ("case", "gap", "deadline", "kw", "drive_kw", "row", "at"),
    [
        ("chatty, deadline pushed", 1.0, 3.0, {"pushed": True}, {"output_every": 0.1},
         ("expired", "budget-exceeded", 2), 3.0),
        ("silent, key pushed", 1.0, 30.0, {"pushed": True}, {"output_every": None},
         ("killed", "heartbeat-gap-1.0s", 3), 1.0),
        ("alive counts, deadline pushed", 1.0, 2.5, {"pushed": True},
         {"output_every": None, "beat_while_alive": True}, ("expired", "budget-exceeded", 2), 2.5),
        ("chatty, nothing pushed", 1.0, 2.0, {}, {"output_every": 0.1},
         ("expired", "budget-exceeded", 2), 2.0),
        ("chatty, Redis cuts it short", 1.0, 30.0, {"cut_at": 1.2}, {"output_every": 0.1},
         ("killed", "heartbeat-gap-1.0s", 3), 1.2),
        ("beats written to Redis are not progress", 1.0, 30.0, {"child_beats": (0.5, 1.2, 1.9)},
         {"output_every": None}, ("killed", "heartbeat-gap-1.0s", 3), 1.0),
    ],
)  # fmt: skip
def test_keeper_limits_run_on_its_own_clock(
    case: str,
    gap: float,
    deadline: float,
    kw: dict[str, Any],
    drive_kw: dict[str, Any],
    row: tuple[str, str, int],
    at: float,
) -> None:
    clock = Clock()
    fake = FakeLeases(clock, gap, deadline, **kw)
    ended, when = drive(fake, clock, **drive_kw)
    assert (ended.status, ended.note, ended.exit_code) == row, case
    assert when == pytest.approx(at, abs=0.3), case


@pytest.mark.parametrize(
    ("now", "last_seen", "alive", "reason"),
    [
        (0.5, 0.0, False, None),
        (1.0, 0.0, False, "heartbeat-gap-1.0s"),
        (1.0, 0.5, False, None),
        (9.0, 0.0, True, None),
        (10.0, 9.9, False, "budget-exceeded"),
        (10.0, 0.0, True, "budget-exceeded"),
    ],
)
def test_local_lapse(now: float, last_seen: float, alive: bool, reason: str | None) -> None:
    clock = Clock()
    fake = FakeLeases(clock, 1.0, 10.0)
    keeper = Keeper(fake, fake.doc, gap=1.0, deadline=10.0, beat_while_alive=alive,  # type: ignore[arg-type]
                    host="h", now=0.0, clock=clock)  # fmt: skip
    keeper.last_seen = last_seen
    assert keeper.local_lapse(now) == reason
