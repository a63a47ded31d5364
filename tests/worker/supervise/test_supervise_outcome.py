"""How a step ends, row by row of contract section 2's table, and when the supervisor's own
clock ends it whatever Redis says: pure, no Redis, no processes."""

from __future__ import annotations

import dataclasses
import itertools
import random
import signal
from typing import Any

import pytest
import redis

from overnight.worker.lease.store import LeaseDoc, LeaseRefused
from overnight.worker.supervise import outcome
from overnight.worker.supervise.keeper import Keeper


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
        "killed",
        "supervisor-signal-2",
        130,
        signal.SIGINT,
    )


def test_lapses_expire_or_kill() -> None:
    budget = outcome.lapsed("budget-exceeded")
    gap = outcome.lapsed("heartbeat-gap-1.0s")
    assert (budget.status, budget.exit_code) == ("expired", 2)
    assert (gap.status, gap.note, gap.exit_code) == ("killed", "heartbeat-gap-1.0s", 3)
    assert budget.receipt_kind == gap.receipt_kind == "subprocess_lease_expired"


def test_lost_elsewhere_and_unstartable() -> None:
    assert (outcome.lost().note, outcome.lost().exit_code, outcome.lost().lost) == (
        "lease-lost",
        4,
        True,
    )
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
        self.renewed: list[float] = []  # local times of the renewals written
        self.fail_at: set[int] = set()  # renewals (by number, from 0) that fail as an outage
        self.calls = 0

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
        self.calls += 1
        if self.calls - 1 in self.fail_at:
            raise redis.ConnectionError("down")
        if now >= self.alive_until:
            raise LeaseRefused(lease_id, "lapsed")
        lapse = min(now + self.gap, self.doc.deadline_unix)
        self.alive_until = max(lapse, self.alive_until) if self.pushed else lapse
        self.doc.heartbeat_unix = now
        self.renewed.append(self.clock.t)
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
        (
            "chatty, deadline pushed",
            1.0,
            3.0,
            {"pushed": True},
            {"output_every": 0.1},
            ("expired", "budget-exceeded", 2),
            3.0,
        ),
        (
            "silent, key pushed",
            1.0,
            30.0,
            {"pushed": True},
            {"output_every": None},
            ("killed", "heartbeat-gap-1.0s", 3),
            1.0,
        ),
        (
            "alive counts, deadline pushed",
            1.0,
            2.5,
            {"pushed": True},
            {"output_every": None, "beat_while_alive": True},
            ("expired", "budget-exceeded", 2),
            2.5,
        ),
        (
            "chatty, nothing pushed",
            1.0,
            2.0,
            {},
            {"output_every": 0.1},
            ("expired", "budget-exceeded", 2),
            2.0,
        ),
        (
            "chatty, Redis cuts it short",
            1.0,
            30.0,
            {"cut_at": 1.2},
            {"output_every": 0.1},
            ("killed", "heartbeat-gap-1.0s", 3),
            1.2,
        ),
        (
            "beats written to Redis are not progress",
            1.0,
            30.0,
            {"child_beats": (0.5, 1.2, 1.9)},
            {"output_every": None},
            ("killed", "heartbeat-gap-1.0s", 3),
            1.0,
        ),
    ],
)
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
    keeper = Keeper(
        fake,
        fake.doc,
        gap=1.0,
        deadline=10.0,
        beat_while_alive=alive,  # type: ignore[arg-type]
        host="h",
        now=0.0,
        clock=clock,
    )
    keeper.last_seen = last_seen
    assert keeper.local_lapse(now) == reason


# --- renewals: every gap/3 while there is progress, the gap still judged on every line ------


def run_lines(
    fake: FakeLeases,
    clock: Clock,
    lines: list[float],
    *,
    alive: bool = False,
    limit: float = 100.0,
) -> tuple[outcome.Outcome, float, Keeper]:
    """The poll loop with output lines at the given local times; after each step, the
    liveness key must still exist while the keeper lets the step run."""
    keeper = Keeper(
        fake,
        dataclasses.replace(fake.doc),
        gap=fake.gap,  # type: ignore[arg-type]
        deadline=fake.doc.budget_sec,
        beat_while_alive=alive,
        host="h",
        now=0.0,
        clock=clock,
    )
    todo = sorted(lines)
    while clock.t < limit:
        wake = keeper.next_wake()
        if todo and todo[0] <= wake:
            clock.t = max(clock.t, todo.pop(0))
            keeper.beat_pending = True
        else:
            clock.t = max(clock.t, wake)
        ended = keeper.tick(clock.t)
        if ended is not None:
            return ended, clock.t, keeper
        assert T0 + clock.t < fake.alive_until, f"key lapsed under a running step at {clock.t}"
    raise AssertionError(f"still running at {limit}s")


def _every(step: float, until: float, start: float = 0.0) -> list[float]:
    return [round(start + i * step, 6) for i in range(1, int((until - start) / step) + 1)]


@pytest.mark.parametrize(
    ("case", "gap", "deadline", "lines", "alive", "fail_at", "row", "at", "renewed"),
    [
        # A line every 0.5 s: renewed every gap/3 (was every 0.25 s), ended by the deadline.
        (
            "chatty",
            30.0,
            60.0,
            _every(0.5, 100),
            False,
            (),
            ("expired", "budget-exceeded", 2),
            60.0,
            [10.0, 20.0, 30.0, 40.0, 50.0],
        ),
        # The gap is still judged from the last line, to the line: 20.5 + 30.
        (
            "chatty, then silent",
            30.0,
            300.0,
            _every(0.5, 20.5),
            False,
            (),
            ("killed", "heartbeat-gap-30.0s", 3),
            50.5,
            [10.0, 20.0, 30.0],
        ),
        # Silent for most of the gap, then one line: renewed at that line, at once.
        (
            "a late line",
            30.0,
            300.0,
            [29.0],
            False,
            (),
            ("killed", "heartbeat-gap-30.0s", 3),
            59.0,
            [29.0],
        ),
        # Lines rarer than gap/3: each renewed as it comes.
        (
            "sparse lines",
            30.0,
            300.0,
            [15.0, 35.0, 55.0],
            False,
            (),
            ("killed", "heartbeat-gap-30.0s", 3),
            85.0,
            [15.0, 35.0, 55.0],
        ),
        # A renewal lost to an outage is retried within retry_interval, long before the lapse.
        (
            "a failed renewal",
            30.0,
            60.0,
            _every(0.5, 100),
            False,
            (1,),
            ("expired", "budget-exceeded", 2),
            60.0,
            [10.0, 20.1, 30.1, 40.1, 50.1],
        ),
        # --beat-while-alive: renewed every gap/3 with no line at all.
        (
            "alive counts",
            30.0,
            45.0,
            [],
            True,
            (),
            ("expired", "budget-exceeded", 2),
            45.0,
            [10.0, 20.0, 30.0, 40.0],
        ),
        # A short gap: renewed so that a failed renewal still leaves (gap - io budget)/2
        # before the cut-off: gap 3 s, io budget 2.25 s, every 0.375 s.
        (
            "short gap",
            3.0,
            1.0,
            _every(0.05, 10),
            False,
            (),
            ("expired", "budget-exceeded", 2),
            1.0,
            [0.375, 0.75],
        ),
        (
            "short gap, a failed renewal",
            3.0,
            3.0,
            _every(0.05, 10),
            False,
            (0,),
            ("expired", "budget-exceeded", 2),
            3.0,
            _every(0.375, 2.8, start=0.1),
        ),
    ],
)
def test_keeper_renews_every_third_of_the_gap(
    case: str,
    gap: float,
    deadline: float,
    lines: list[float],
    alive: bool,
    fail_at: tuple[int, ...],
    row: tuple[str, str, int],
    at: float,
    renewed: list[float],
) -> None:
    clock = Clock()
    fake = FakeLeases(clock, gap, deadline)
    fake.fail_at = set(fail_at)
    ended, when, _keeper = run_lines(fake, clock, lines, alive=alive)
    assert (ended.status, ended.note, ended.exit_code) == row, case
    assert when == pytest.approx(at, abs=1e-6), case
    assert fake.renewed == pytest.approx(renewed, abs=0.051), case


@pytest.mark.parametrize("seed", range(20))
def test_keeper_never_lets_the_key_lapse_under_progress(seed: int) -> None:
    """Random line patterns (gaps between lines up to 1.2x the gap): the key exists at every
    step while the keeper lets the step run (checked in run_lines), the gap ends the step
    exactly one gap after its last line, and renewals are never closer than the interval."""
    rng = random.Random(seed)
    gap = rng.choice((1.0, 3.0, 30.0))
    t, lines = 0.0, []
    while t < 10 * gap:
        t += rng.choice((0.01, 0.1, 0.3, 0.9, 1.2)) * gap * rng.random()
        lines.append(round(t, 6))
    clock = Clock()
    fake = FakeLeases(clock, gap, 1e6)
    ended, when, keeper = run_lines(fake, clock, lines, limit=1e6)
    seen = [x for x in lines if x <= when]
    silent = [b - a for a, b in itertools.pairwise([0.0, *seen])]
    assert ended.note.startswith("heartbeat-gap-")
    assert all(s < gap for s in silent)
    assert when == pytest.approx(keeper.last_seen + gap, abs=1e-9)
    assert keeper.last_seen == pytest.approx(seen[-1] if seen else 0.0, abs=1e-9)
    steps = [b - a for a, b in itertools.pairwise([0.0, *fake.renewed])]
    assert keeper.renew_interval <= gap / 3
    assert all(s >= keeper.renew_interval - 1e-9 for s in steps)
