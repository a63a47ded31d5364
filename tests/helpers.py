"""Small helpers for tests: polling with a deadline, process checks."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {predicate}")
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` names a live process (zombies count as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def kill_quietly(pid: int, sig: int = 9) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
