"""A Sentinel failover in the middle of a night on three hosts (tests/hosts.py).

The primary, its two replicas and three sentinels all run in the cluster's Redis namespace
(one namespace for the six: each host's one link then reaches every one of them, and
killing the primary's process is the failover; see ``Cluster.start_sentinels``). Each of
three hosts runs ``overnight worker --with-reaper`` and one more worker, all knowing only
the ``redis+sentinel://`` URL; 100 short tasks, and the primary is SIGKILLed once about a
third are verified. Every task ends verified, no two runs of one task were ever alive at
once, and the books balance: the envelope consumed exactly the tasks' calls, none past the
budget (every spend waited for a replica: WAIT 1)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from tests.helpers import lacking, task_file, wait_for
from tests.hosts import (
    REDIS_PORT,
    Cluster,
    cluster,
    namespaces_refused,
    overlaps,
    runs,
    write_agent,
)

REFUSED = namespaces_refused()
TASKS = 100
BUDGET = 4 * TASKS


def fields(c: Cluster, ids: list[str], name: str) -> dict[str, str]:
    """One field of every task's record, from the primary the sentinels name ({} while
    the primary cannot be read: mid-failover)."""
    keys = Keys(c.namespace)
    try:
        pipe = c.client.pipeline(transaction=False)
        for t in ids:
            pipe.hget(keys.task(t), name)
        return dict(zip(ids, pipe.execute(), strict=True))
    except (redis.RedisError, OSError):
        return {}


def verified(c: Cluster, ids: list[str]) -> int:
    return list(fields(c, ids, "state").values()).count("finished_verified")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_night_on_three_hosts_survives_a_sentinel_failover(tmp_path: Path) -> None:
    if REFUSED:
        lacking(REFUSED)
    # The witness of "never two runs of a task at once" is one trace every run of every
    # task appends to, with its host's name: exactly the cross-task channel a sandbox
    # closes (its proof is in tests/worker/sandbox), so these steps run unsandboxed.
    with cluster(tmp_path, 3, {"OVERNIGHT_SANDBOX": "off"}) as c:
        began = time.monotonic()
        c.start_sentinels()
        reset = c.coordinator("envelope", "reset", str(BUDGET))
        assert reset.returncode == 0, reset.stderr
        trace = tmp_path / "trace.txt"
        agent = [sys.executable, str(write_agent(tmp_path)), str(trace)]
        ids = [f"n{i:03d}" for i in range(TASKS)]
        files = [
            task_file(
                tmp_path,
                t,
                [*agent, t, "0.1"],
                [["test", "-f", "ok.txt"]],
                on_unknown="retry",
                heartbeat_gap=10,  # a lease outlives the failover (2 to 4 s)
            )
            for t in ids
        ]
        for host in c.hosts:
            c.start_worker(host, reaper=True)
            c.start_worker(host, reaper=False)
        wait_for(lambda: all(c.reaper_up(h) for h in c.hosts), timeout=30)
        submitted = c.coordinator("submit", *map(str, files), timeout=60)
        assert submitted.returncode == 0, submitted.stderr

        wait_for(lambda: verified(c, ids) >= TASKS // 3, timeout=90, interval=0.1)
        before = verified(c, ids)
        killed_at = c.kill_primary()
        promoted = wait_for(
            lambda: (c.primary_port() or REDIS_PORT) != REDIS_PORT, timeout=30, interval=0.1
        )
        promoted_at = time.time()
        assert promoted and before < TASKS, "every task ended before the failover"

        def all_verified() -> bool:
            return verified(c, ids) == TASKS

        try:
            wait_for(all_verified, timeout=120, interval=0.25)
        except AssertionError:
            left = {t: s for t, s in fields(c, ids, "state").items() if s != "finished_verified"}
            tails = "\n".join(h.log_text()[-2000:] for h in c.hosts)
            raise AssertionError(f"not verified after the failover: {left}\n{tails}") from None
        ended_at = time.time()

        all_runs = runs(trace)
        assert not overlaps(all_runs), overlaps(all_runs)
        used = sum(int(v or 0) for v in fields(c, ids, "calls_used").values())
        shown = c.coordinator("envelope", "status")
        assert shown.returncode == 0, shown.stderr
        env = json.loads(shown.stdout)
        consumed = int(env["consumed_model"]) + int(env["consumed_tool"])
        alive = [p.poll() for h in c.hosts for p in h.procs]
        print(
            f"\nsentinel figure: 3 hosts x 2 workers, {TASKS} tasks, primary SIGKILLed with "
            f"{before} verified; the sentinels named a replica {promoted_at - killed_at:.1f}s "
            f"after, every task verified {ended_at - killed_at:.1f}s after the kill; "
            f"{len(all_runs)} runs ({len(all_runs) - TASKS} again), 0 at once; envelope "
            f"{BUDGET}: consumed {consumed}, tasks' calls_used {used}, remaining "
            f"{env['remaining']}; {time.monotonic() - began:.0f}s in all"
        )
        assert consumed == used >= TASKS
        assert env["remaining"] == BUDGET - consumed
        assert alive == [None] * len(alive), f"a worker exited: {alive}"
