"""The processes ``overnight up`` runs on one machine, started in order and stopped in reverse.

Every process the stack starts carries ``OVERNIGHT_UP_ID`` in its environment, and so does
everything they start (workers, work horses, supervised steps). Stopping sends SIGTERM to
the workers first (idle ones exit; a busy one is SIGKILLed after the grace, its horse dies
with it and the step's lease is left to lapse and be reaped), then stops the reaper, then
sweeps the process table for anything still tagged, and last stops the embedded Redis.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from overnight.coordinator.embedded_redis import EmbeddedRedis

log = logging.getLogger("overnight.up")
UP_TAG = "OVERNIGHT_UP_ID"


def tagged_pids(var: str, value: str) -> list[int]:
    """PIDs of live processes whose environment holds ``var=value`` (this process excluded)."""
    needle = f"{var}={value}".encode()
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry))
    return found


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _children() -> set[int]:
    """PIDs of this process's children, adopted orphans included."""
    pids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/children") as fh:
            pids.update(int(p) for p in fh.read().split())
    return pids


@dataclass
class Stack:
    """Processes of one ``overnight up``: an optional embedded Redis, a reaper, N workers."""

    env: dict[str, str]
    state_dir: Path
    grace: float = 5.0
    up_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    redis: EmbeddedRedis | None = None
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.env = {**self.env, UP_TAG: self.up_id}

    def start_redis(self) -> str:
        """Start a private redis-server under ``state_dir/redis``; returns its URL."""
        self.redis = EmbeddedRedis(self.state_dir / "redis", appendonly=True)
        self.redis.start()
        self.env["OVERNIGHT_REDIS_URL"] = self.redis.url
        return self.redis.url

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        """Start one member process; its output goes to ``state_dir/logs/<name>.log``."""
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(
                argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append((name, proc))
        log.info("started %s (pid %d)", name, proc.pid)
        return proc

    def reap_orphans(self) -> None:
        """Collect exited orphans re-parented to us (``up`` is a subreaper), never a member:
        their exit statuses belong to their Popen objects."""
        members = {proc.pid for _, proc in self.procs}
        if self.redis is not None and self.redis.proc is not None:
            members.add(self.redis.proc.pid)
        for pid in _children() - members:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)

    def dead_members(self) -> list[str]:
        """Names of member processes that exited on their own."""
        return [name for name, proc in self.procs if proc.poll() is not None]

    def stop(self) -> list[int]:
        """Stop everything; returns PIDs that had to be SIGKILLed by the final sweep."""
        workers = [(n, p) for n, p in self.procs if n.startswith("worker")]
        others = [(n, p) for n, p in self.procs if not n.startswith("worker")]
        self._stop_group(workers, self.grace + 5.0)
        self._stop_group(others, 5.0)
        leftovers = self._sweep()
        if self.redis is not None:
            self.redis.stop()
        return leftovers

    def _stop_group(self, members: list[tuple[str, subprocess.Popen[bytes]]], wait: float) -> None:
        for _name, proc in members:
            if proc.poll() is None:
                _signal(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + wait
        for name, proc in members:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not stop in %.0fs; killing it", name, proc.pid, wait)
                _signal(proc.pid, signal.SIGKILL)
                proc.wait()

    def _sweep(self) -> list[int]:
        killed = []
        for _ in range(3):
            pids = tagged_pids(UP_TAG, self.up_id)
            if not pids:
                break
            for pid in pids:
                _signal(pid, signal.SIGKILL)
            killed.extend(pids)
            time.sleep(0.05)
            self.reap_orphans()
        return sorted(set(killed))
