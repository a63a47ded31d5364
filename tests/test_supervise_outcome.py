"""How a step ends, row by row of contract section 2's table: pure, no Redis, no processes."""

from __future__ import annotations

import signal

import pytest

from overnight.worker import outcome


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
