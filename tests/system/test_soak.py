"""SIGKILL at every point, in CI: the bench.soak harness for a short run, every invariant held,
with a Redis maxmemory stall and a Redis restart in the middle that every process lives through."""

from __future__ import annotations

import pytest

from bench.soak import run_soak


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_soak_kills_lose_double_and_orphan_nothing() -> None:
    result = run_soak(seconds=20, workers=3, seed=7)
    assert not result.problems, "\n".join(result.lines())
    assert sum(result.kills.values()) >= 5 and result.kills["horse"] >= 1
    assert result.tasks >= 6 and result.leases == result.leases_ended > 0
    assert result.budget == result.remaining + result.consumed
    assert result.orphans == 0 and result.lost_units == 0 and result.doubled_units == 0
    assert len(result.redis_events) == 2, result.redis_events
