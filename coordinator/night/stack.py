"""The processes ``overnight up`` runs on one machine, started in order and stopped in reverse.

Every process the stack starts carries ``OVERNIGHT_UP_ID`` in its environment, and so does
everything they start (workers, work horses, supervised steps). Stopping sends SIGTERM to
the workers first (idle ones exit; a busy one's horse ends its step through the lease and
re-queues the task, ``up`` forcing the stop if it takes longer than the grace), then stops
the reaper, then
sweeps the process table for anything still tagged, and last stops the embedded Redis.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from overnight.config import defaults
from overnight.config.folders import make_folders
from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.supervise import procs
from overnight.worker.supervise.procs import Proc
from overnight.worker.supervise.tree import Tree, end_tree

log = logging.getLogger("overnight.up")
UP_TAG = "OVERNIGHT_UP_ID"
# A member that dies is started again, at most this many times in this many seconds.
MAX_RESTARTS = 5
RESTART_WINDOW = 300.0


class _Tagged(Tree):
    """Every live process carrying ``OVERNIGHT_UP_ID=<up_id>``: what one ``up`` started."""

    def __init__(self, up_id: str) -> None:
        super().__init__(root=0, root_start=None)
        self.up_id = up_id

    def members(self, table: dict[int, Proc] | None = None) -> dict[int, Proc]:
        return procs.tagged(UP_TAG, self.up_id, table)


def _stop_with_up() -> None:
    """A member is asked to stop (SIGTERM: a worker's warm stop) when ``up`` dies without
    stopping it, as when ``up`` is SIGKILLed: nothing of the night is left running."""
    procs.set_pdeathsig(signal.SIGTERM)


@dataclass
class Stack:
    """Processes of one ``overnight up``: an optional embedded Redis, a reaper, N workers."""

    env: dict[str, str]
    state_dir: Path
    grace: float = defaults.GRACE
    up_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    redis: EmbeddedRedis | None = None
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    member_env: dict[str, dict[str, str]] = field(default_factory=dict)  # kept for restarts
    argvs: dict[str, list[str]] = field(default_factory=dict)
    restarts: dict[str, list[float]] = field(default_factory=dict)
    given_up: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.env = {**self.env, UP_TAG: self.up_id}

    def start_redis(self) -> str:
        """Start a private redis-server under ``state_dir/redis`` that requires a random
        password (a step on this host can reach its port, never the password); returns its
        URL, password included (a secret: print it masked)."""
        self.redis = EmbeddedRedis(
            self.state_dir / "redis", appendonly=True, password=secrets.token_hex(24)
        )
        self.redis.start()
        self.env["OVERNIGHT_REDIS_URL"] = self.redis.url
        return self.redis.url

    def spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start one member process (``env`` added to the stack's); its output goes to
        ``state_dir/logs/<name>.log``."""
        env = self.member_env.get(name, {}) if env is None else env  # a restart: as before
        self.member_env[name] = env
        logs = self.state_dir / "logs"
        make_folders(logs, 0o700)
        with open(logs / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(
                argv,
                env={**self.env, **env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_stop_with_up,
            )
        self.procs = [(n, p) for n, p in self.procs if n != name]
        self.procs.append((name, proc))
        self.argvs[name] = argv
        log.info("started %s (pid %d)", name, proc.pid)
        return proc

    def restart_dead(self) -> list[str]:
        """Start again each member that exited on its own (at most ``MAX_RESTARTS`` times in
        ``RESTART_WINDOW`` seconds each); returns one line per member restarted or given up."""
        lines = []
        now = time.monotonic()
        for name, proc in list(self.procs):
            code = proc.poll()
            if code is None or name in self.given_up:
                continue
            recent = [t for t in self.restarts.get(name, []) if now - t < RESTART_WINDOW]
            log_file = self.state_dir / "logs" / f"{name}.log"
            if len(recent) >= MAX_RESTARTS:
                self.given_up.add(name)
                why = f"{len(recent)} times in {RESTART_WINDOW:.0f}s; not restarted again"
                lines.append(f"{name} exited (code {code}) {why}; see {log_file}")
                continue
            self.restarts[name] = [*recent, now]
            new = self.spawn(name, self.argvs[name])
            lines.append(
                f"{name} exited (code {code}); restarted as pid {new.pid} "
                f"({len(recent) + 1}/{MAX_RESTARTS}); see {log_file}"
            )
        return lines

    def reap_orphans(self) -> None:
        """Collect exited orphans re-parented to us (``up`` is a subreaper), never a member:
        their exit statuses belong to their Popen objects."""
        members = {proc.pid for _, proc in self.procs}
        if self.redis is not None and self.redis.proc is not None:
            members.add(self.redis.proc.pid)
        for pid in (procs.own_children() or set()) - members:
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
                proc.send_signal(signal.SIGTERM)  # our unreaped child: its pid is not reused
        deadline = time.monotonic() + wait
        for name, proc in members:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not stop in %.0fs; killing it", name, proc.pid, wait)
                proc.kill()
                proc.wait()

    def _sweep(self) -> list[int]:
        """SIGKILL whatever still carries this ``up``'s tag, through the same start-time
        check and pidfd as the supervisor's tree kill; returns the PIDs it signalled."""
        report = end_tree(_Tagged(self.up_id), 0.0, first_signal=signal.SIGKILL)
        self.reap_orphans()
        return sorted(report.signalled | report.killed)
