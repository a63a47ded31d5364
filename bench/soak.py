"""Soak: SIGKILL at every point, then prove nothing was lost, doubled or left running.

``.venv/bin/python -m bench.soak [--seconds N] [--workers N] [--seed N]`` starts its own
redis-server, several ``overnight worker`` processes and an ``overnight reaper`` on one
shared envelope, keeps tasks coming (agents that take random short times, some that hang
silently until their gap kills them), and for ``--seconds`` SIGKILLs random work horses
(the in-process supervisors of the steps), workers and the reaper, restarting what it
killed. A third of the way in it holds Redis at ``maxmemory`` (noeviction: every write
refused with OOM) for a while, and two thirds in it restarts Redis (its AOF keeps the
data); every worker and the reaper must live through both. Then it lets the system settle
and checks every invariant:

- envelope arithmetic: budget == remaining + consumed_model + consumed_tool; every
  consumed unit has exactly one request id with an allowed answer (none lost or doubled),
  and every such request id is charged to its task's own ``calls_used``;
- every task is terminal or paused, with a ``task_state`` receipt for that state;
- every lease is ended, with exactly one terminal receipt;
- no process tagged with any lease of the run is alive (orphans);
- every worker and the reaper alive before the Redis stall and the Redis restart is alive
  after them.

Exit 0 if every invariant holds, else 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import redis

from overnight.config.keys import Keys
from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.coordinator.tasks.states import PAUSED, QUEUED, RUNNING, TERMINAL
from overnight.worker.envelope.envelope import CallEnvelope, EnvelopeEmpty
from overnight.worker.reaper.reaper import lease_tag
from overnight.worker.supervise import tree

# Who steps run as (contract §1): kept from the caller's environment.
STEP_VARS = ("OVERNIGHT_STEP_USER", "OVERNIGHT_ALLOW_ROOT_STEPS")


OVERNIGHT = str(Path(sys.executable).with_name("overnight"))
PY = sys.executable
ENVELOPE = "soak"
END_KINDS = ("lease_ended", "subprocess_lease_expired")
# An agent step: a random short run that may fix the work dir; now and then a silent hang.
AGENT = (
    "import os, random, sys, time\n"
    "r = random.Random()\n"
    "if r.random() < {hang}:\n"
    "    time.sleep(600)\n"
    "for _ in range(r.randint(1, 6)):\n"
    "    print('working', flush=True); time.sleep(r.uniform(0.02, 0.12))\n"
    "if r.random() < 0.5:\n"
    "    open('ok.txt', 'w').close()\n"
    "print(r.random(), flush=True)\n"
)


@dataclass
class SoakResult:
    """What one soak run did and found; ``problems`` is empty when every invariant held."""

    seconds: float
    workers: int
    tasks: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    leases: int = 0
    leases_ended: int = 0
    budget: int = 0
    remaining: int = 0
    consumed_model: int = 0
    consumed_tool: int = 0
    calls_used: int = 0
    states: Counter[str] = field(default_factory=Counter)
    orphans: int = 0
    lost_units: int = 0
    doubled_units: int = 0
    settle_seconds: float = 0.0
    redis_events: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def consumed(self) -> int:
        return self.consumed_model + self.consumed_tool

    def lines(self) -> list[str]:
        kills = ", ".join(f"{k} {n}" for k, n in sorted(self.kills.items())) or "none"
        states = ", ".join(f"{n} {s}" for s, n in sorted(self.states.items()))
        return [
            f"soak: {self.seconds:g}s of kills, settled in {self.settle_seconds:.1f}s",
            f"workers: {self.workers} (+1 reaper)",
            f"tasks: {self.tasks} ({states})",
            f"kills injected: {sum(self.kills.values())} ({kills})",
            f"leases: {self.leases}, ended: {self.leases_ended}",
            f"envelope: budget {self.budget} = remaining {self.remaining} + consumed "
            f"{self.consumed} (model {self.consumed_model}, tool {self.consumed_tool}); "
            f"tasks' calls_used {self.calls_used}",
            f"Redis events: {'; '.join(self.redis_events) or 'none'}",
            f"orphans found: {self.orphans}",
            f"lost units: {self.lost_units}, doubled units: {self.doubled_units}",
            "invariants: " + ("all hold" if not self.problems else "; ".join(self.problems)),
        ]


class Soak:
    """One soak run in ``work`` against ``server``."""

    def __init__(self, server: EmbeddedRedis, work: Path, workers: int, seed: int) -> None:
        self.server = server
        self.work = work
        self.n_workers = workers
        self.rng = random.Random(seed)
        self.namespace = f"soak-{uuid.uuid4().hex[:8]}"
        self.keys = Keys(self.namespace)
        self.client = redis.Redis.from_url(server.url, decode_responses=True)
        self.env = {
            **{
                k: v
                for k, v in os.environ.items()
                if not k.startswith("OVERNIGHT_") or k in STEP_VARS
            },
            "OVERNIGHT_REDIS_URL": server.url,
            "OVERNIGHT_NAMESPACE": self.namespace,
            "OVERNIGHT_QUEUE": self.namespace,
            "OVERNIGHT_TASK_CLAIM_TTL": "1",
            "OVERNIGHT_RECOVERY_INTERVAL": "0.5",
            "OVERNIGHT_GRACE": "0.3",
            "OVERNIGHT_REAPER_INTERVAL": "0.3",
            "OVERNIGHT_REAPER_HOST_TTL": "3",
            "PYTHONUNBUFFERED": "1",
        }
        self.workers: list[subprocess.Popen[bytes]] = []
        self.reaper: subprocess.Popen[bytes] | None = None
        self.logs: list[TextIO] = []
        self.submitted: list[str] = []

    # --- processes ------------------------------------------------------------------------
    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen[bytes]:
        log = (self.work / f"{name}.log").open("a")
        self.logs.append(log)
        return subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=log, stdin=subprocess.DEVNULL
        )

    def start_worker(self) -> None:
        n = len(self.workers)
        self.workers.append(
            self._spawn([OVERNIGHT, "worker", "--name", f"w{n}-{self.namespace}"], f"worker-{n}")
        )

    def start_reaper(self) -> None:
        self.reaper = self._spawn([OVERNIGHT, "reaper"], "reaper")

    def live_workers(self) -> list[subprocess.Popen[bytes]]:
        return [w for w in self.workers if w.poll() is None]

    def horses(self) -> list[int]:
        """Work horses: forked children of the workers (each runs a step's supervisor)."""
        parents = {w.pid for w in self.live_workers()}
        return [p.pid for p in tree.scan().values() if p.ppid in parents and not p.dead]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [OVERNIGHT, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    # --- tasks ----------------------------------------------------------------------------
    def submit(self, count: int) -> None:
        paths = []
        for _ in range(count):
            task_id = f"s{len(self.submitted) + len(paths):03d}"
            workdir = self.work / task_id
            workdir.mkdir()
            hang = 0.15 if self.rng.random() < 0.5 else 0.0
            spec = {
                "id": task_id,
                "assignment": "Create ok.txt in the work directory.",
                "workdir": task_id,
                "agent": [PY, "-c", AGENT.format(hang=hang)],
                "max_calls": self.rng.randint(2, 8),
                "heartbeat_gap": 1.0,
                "lease_seconds": 6.0,
                "envelope": ENVELOPE,
                "on_unknown": "retry" if self.rng.random() < 0.7 else "pause",
                "verifier": [{"name": "ok", "run": ["test", "-f", "ok.txt"]}],
            }
            path = self.work / f"{task_id}.json"
            path.write_text(json.dumps(spec))
            paths.append(path)
        proc = self.cli("submit", *map(str, paths))
        if proc.returncode != 0:
            raise RuntimeError(f"submit failed: {proc.stderr.strip()}")
        self.submitted += proc.stdout.split()

    def task_states(self) -> dict[str, str]:
        pipe = self.client.pipeline(transaction=False)
        for task_id in self.submitted:
            pipe.hget(self.keys.task(task_id), "state")
        return dict(zip(self.submitted, pipe.execute(), strict=True))

    # --- the run ----------------------------------------------------------------------------
    def run(self, seconds: float, budget: int) -> SoakResult:
        result = SoakResult(seconds=seconds, workers=self.n_workers, budget=budget)
        if self.cli("envelope", "reset", str(budget), "--name", ENVELOPE).returncode != 0:
            raise RuntimeError("envelope reset failed")
        self.start_reaper()
        for _ in range(self.n_workers):
            self.start_worker()
        self.submit(2 * self.n_workers)
        began = time.monotonic()
        end = began + seconds
        events = [(began + seconds / 3, self._stall), (began + 2 * seconds / 3, self._restart)]
        next_wave = time.monotonic() + 1.0
        try:
            while time.monotonic() < end:
                time.sleep(self.rng.uniform(0.2, 0.6))
                if events and time.monotonic() >= events[0][0]:
                    self._survived(result, events.pop(0)[1])
                self._inject(result)
                if time.monotonic() >= next_wave:
                    states = self.task_states().values()
                    if sum(s in (QUEUED, RUNNING) for s in states) < 3 * self.n_workers:
                        self.submit(self.n_workers)
                    next_wave = time.monotonic() + 1.0
            self._heal()
            result.settle_seconds = self._settle()
        finally:
            self._stop_all()
        self._check(result)
        return result

    def _inject(self, result: SoakResult) -> None:
        what = self.rng.choices(["horse", "worker", "reaper"], weights=[6, 2, 1])[0]
        if what == "horse":
            horses = self.horses()
            if horses:
                _kill(self.rng.choice(horses))
                result.kills["horse"] += 1
        elif what == "worker":
            live = self.live_workers()
            if live:
                victim = self.rng.choice(live)
                _kill(victim.pid)
                victim.wait(10)
                result.kills["worker"] += 1
        elif self.reaper is not None and self.reaper.poll() is None:
            _kill(self.reaper.pid)
            self.reaper.wait(10)
            result.kills["reaper"] += 1
        self._heal()

    # --- Redis trouble: nobody may die of it ---------------------------------------------------
    def _survived(self, result: SoakResult, event: Callable[[], str]) -> None:
        """Run a Redis event; every worker and the reaper alive before it must be after."""
        before = [*self.live_workers(), *([self.reaper] if self.reaper else [])]
        before = [p for p in before if p.poll() is None]
        what = event()
        time.sleep(0.5)  # what would die of it has had time to
        dead = [p.pid for p in before if p.poll() is not None]
        result.redis_events.append(
            f"{what}, {len(before) - len(dead)}/{len(before)} processes alive after it"
        )
        if dead:
            result.problems.append(f"{what}: processes died: {dead}")

    def _stall(self, hold: float = 1.5) -> str:
        """Hold Redis at maxmemory (noeviction) for ``hold`` seconds: writes refused (OOM)."""
        used = int(self.client.info("memory")["used_memory"])
        self.client.config_set("maxmemory-policy", "noeviction")
        self.client.config_set("maxmemory", str(used // 2))
        refused = 0
        until = time.monotonic() + hold
        while time.monotonic() < until:
            try:
                self.client.set("soak-probe", "x")
            except redis.exceptions.OutOfMemoryError:
                refused += 1
            time.sleep(0.05)
        self.client.config_set("maxmemory", "0")
        return f"maxmemory stall {hold:g}s ({refused} probe writes refused)"

    def _restart(self) -> str:
        """Stop Redis (SIGTERM; the AOF is written on every write) and start it again."""
        began = time.monotonic()
        self.server.stop()
        self.server.start()
        return f"Redis restart ({time.monotonic() - began:.1f}s down)"

    def _heal(self) -> None:
        while len(self.live_workers()) < self.n_workers:
            self.start_worker()
        if self.reaper is None or self.reaper.poll() is not None:
            self.start_reaper()

    def _settle(self, timeout: float = 120.0) -> float:
        """Wait until every task is terminal or paused and every lease has ended."""
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            self._heal()
            states = self.task_states().values()
            if all(s in TERMINAL or s == PAUSED for s in states) and not self._running_leases():
                return time.monotonic() - began
            time.sleep(0.25)
        return time.monotonic() - began

    def _running_leases(self) -> list[str]:
        ids = self.client.zrange(self.keys.leases, 0, -1)
        pipe = self.client.pipeline(transaction=False)
        for lease_id in ids:
            pipe.hget(self.keys.lease(lease_id), "status")
        return [i for i, s in zip(ids, pipe.execute(), strict=True) if s == "running"]

    def _stop_all(self) -> None:
        procs = [*self.workers, *([self.reaper] if self.reaper else [])]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                _kill(proc.pid)
                proc.wait(5)
        for log in self.logs:
            log.close()

    # --- the invariants ---------------------------------------------------------------------
    def _check(self, result: SoakResult) -> None:
        problems = result.problems
        k = self.keys
        env = self.client.hgetall(k.envelope(ENVELOPE))
        result.remaining = int(env.get("remaining", 0))
        result.consumed_model = int(env.get("consumed_model", 0))
        result.consumed_tool = int(env.get("consumed_tool", 0))
        reserved = int(env.get("reserved_model", 0)) + int(env.get("reserved_tool", 0))
        if result.remaining + result.consumed + reserved != result.budget or reserved:
            problems.append(f"envelope arithmetic off: {env}")

        # Every allowed envelope answer is one request id; each unit must have exactly one.
        allowed: set[str] = set()
        prefix = k.envelope_request(ENVELOPE, "")
        envelope = CallEnvelope(self.client, ENVELOPE, self.namespace)
        for key in self.client.scan_iter(match=prefix + "*", count=1000):
            rid = key[len(prefix) :]
            try:  # a repeated request id is answered with its first answer, charging nothing
                replay = envelope.try_consume("model", request_id=rid)
            except EnvelopeEmpty:
                continue
            if replay.replayed:
                allowed.add(rid)
        result.doubled_units = max(0, result.consumed - len(allowed))
        lost = max(0, len(allowed) - result.consumed)

        result.tasks = len(self.submitted)
        states = self.task_states()
        result.states = Counter(str(s) for s in states.values())
        charged_all: set[str] = set()
        for task_id, state in states.items():
            charged = set(self.client.smembers(k.task_charged(task_id)))
            used = int(self.client.hget(k.task(task_id), "calls_used") or 0)
            result.calls_used += used
            charged_all |= charged
            if used != len(charged):
                problems.append(f"task {task_id}: calls_used {used} != {len(charged)} charged")
            spent = {rid for rid in allowed if rid.startswith(f"{task_id}:")}
            # A task charges its own ceiling just before the envelope; a death in between
            # leaves one charged step the envelope never saw, and only a paused task keeps it.
            unspent = charged - spent
            if unspent and not (state == PAUSED and len(unspent) == 1):
                problems.append(f"task {task_id} ({state}): charged, never spent: {unspent}")
            if state not in TERMINAL and state != PAUSED:
                problems.append(f"task {task_id} not settled: {state}")
        lost += len(allowed - charged_all)  # spent by the envelope, charged to no task
        result.lost_units = lost
        if result.lost_units or result.doubled_units:
            problems.append(f"lost {result.lost_units}, doubled {result.doubled_units} units")

        # Receipts: one terminal receipt per lease, a task_state receipt per task end.
        ends: Counter[str] = Counter()
        acquired: set[str] = set()
        task_states: dict[str, set[str]] = {}
        for _id, fields in self.client.xrange(k.receipts):
            data = json.loads(fields["data"])
            if fields["kind"] == "lease_acquired":
                acquired.add(data["lease_id"])
            elif fields["kind"] in END_KINDS:
                ends[data["lease_id"]] += 1
            elif fields["kind"] == "task_state" and data.get("task_id"):
                task_states.setdefault(data["task_id"], set()).add(data["data"].get("state"))
        lease_ids = set(self.client.zrange(k.leases, 0, -1))
        result.leases = len(lease_ids)
        result.leases_ended = sum(1 for i in lease_ids if ends[i] == 1)
        if acquired != lease_ids:
            problems.append(f"{len(acquired ^ lease_ids)} leases without an acquire receipt")
        twice = sorted(i for i in lease_ids if ends[i] != 1)
        if twice:
            problems.append(f"{len(twice)} leases not ended exactly once: {twice[:5]}")
        running = self._running_leases()
        if running:
            problems.append(f"{len(running)} leases still running: {running[:5]}")
        for task_id, state in states.items():
            if state not in task_states.get(task_id, set()):
                problems.append(f"task {task_id}: no task_state receipt for {state}")

        orphans = [
            p.pid for p in tree.scan().values() if not p.dead and lease_tag(p.pid) in lease_ids
        ]
        result.orphans = len(orphans)
        if orphans:
            problems.append(f"orphans alive: {orphans[:10]}")
            for pid in orphans:
                _kill(pid)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def run_soak(
    seconds: float = 45.0, workers: int = 3, seed: int | None = None, keep: bool = False
) -> SoakResult:
    """Run one soak on a private redis-server in a temporary directory."""
    work = Path(tempfile.mkdtemp(prefix="overnight-soak-"))
    seed = random.randrange(2**32) if seed is None else seed
    server = EmbeddedRedis(work / "redis", appendonly=True, password=uuid.uuid4().hex)
    server.start()
    try:
        soak = Soak(server, work, workers, seed)
        result = soak.run(seconds, budget=max(40, int(seconds * 6)))
    finally:
        server.stop()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    if result.problems:
        result.problems.append(f"seed {seed}" + (f", logs in {work}" if keep else ""))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seconds", type=float, default=45.0, help="how long to inject kills")
    parser.add_argument("--workers", type=int, default=3, help="overnight worker processes")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir and its logs")
    args = parser.parse_args(argv)
    result = run_soak(args.seconds, args.workers, args.seed, args.keep)
    for line in result.lines():
        print(line)
    return 1 if result.problems else 0


if __name__ == "__main__":
    sys.exit(main())
