"""`up` restarts a member that dies, a bounded number of times, saying so each time."""

from __future__ import annotations

import os
from pathlib import Path

from overnight.coordinator.night.stack import MAX_RESTARTS, Stack
from tests.helpers import wait_for


def test_a_dead_member_is_restarted_then_given_up_on(tmp_path: Path) -> None:
    stack = Stack(env=dict(os.environ), state_dir=tmp_path, grace=0.5)
    first = stack.spawn("worker-1", ["sh", "-c", "exit 3"])
    stayer = stack.spawn("reaper", ["sleep", "60"])
    try:
        lines: list[str] = []
        pids = {first.pid}
        for _ in range(MAX_RESTARTS + 1):
            wait_for(
                lambda: (
                    stack.procs[[n for n, _ in stack.procs].index("worker-1")][1].poll() is not None
                ),
                timeout=10,
            )
            got = stack.restart_dead()
            assert len(got) == 1, got
            lines += got
            pids |= {p.pid for n, p in stack.procs if n == "worker-1"}
        assert all(
            "worker-1 exited (code 3); restarted as pid" in line for line in lines[:MAX_RESTARTS]
        )
        assert "not restarted again" in lines[-1]
        assert len(pids) == MAX_RESTARTS + 1
        assert stack.restart_dead() == []  # given up: said once
        assert stayer.poll() is None  # a live member is left alone
        assert [n for n, _ in stack.procs].count("worker-1") == 1
    finally:
        stack.stop()
