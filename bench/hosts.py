"""Many hosts on one Redis: what beats cost, how soon a lost host is ended, one envelope's
throughput across hosts.

``.venv/bin/python -m bench.hosts`` starts its own private redis-server. Hosts are
simulated: host ids spread over a small process pool (this machine has 2 cores), each host
holding its share of the running leases and running its reaper's pass (heartbeat key plus
the expiry index) every reaper interval; every call is one round trip, as a real
supervisor's is. Every step is chatty (a line always seen since the last renewal: the most
renewals the keeper ever writes). Redis's CPU is measured in three windows of one run:

- today: the real :class:`worker.supervise.keeper.Keeper` drives each lease on its own, a
  renewal (one script call, one round trip) every renew interval (gap/3);
- reapers only: no renewals, the reapers' passes and Redis's own housekeeping;
- batched: the same keepers, each host's sharing its batch folder
  (:mod:`worker.beat.batch`): a host renews all its due leases in one call a renew interval.

Targets: beats cost <= 5% of one Redis core; a lost host (its beats and reaper
stop at once) ended ``reaped: host-lost`` within 2x its TTL; envelope throughput across
hosts >= 0.85x a single host's (the two alternated, five runs each, medians compared).
``--part beats`` or ``--part envelope`` runs one half.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import heapq
import multiprocessing as mp
import queue
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from overnight.config.keys import Keys
from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.beat.batch import HostBatch, Seat
from overnight.worker.envelope.envelope import CallEnvelope, EnvelopeEmpty
from overnight.worker.lease.store import LeaseDoc, Leases
from overnight.worker.reaper.reaper import reap_once
from overnight.worker.supervise import procs
from overnight.worker.supervise.keeper import Keeper

NS = "bench-hosts"


def _as_host(host_id: str) -> None:
    # procs.hostname() is read where a lease or envelope is made: one process plays many hosts.
    procs.hostname = lambda: host_id  # type: ignore[assignment]


@dataclass(frozen=True)
class Plan:
    """Wall-clock times every process switches at (set once all leases exist)."""

    quiet_at: float  # stop the baseline's beats: reapers only
    after_at: float  # the keepers take over
    dead_at: float  # the lost host stops
    until: float


def host_group(
    url: str,
    hosts: list[str],
    per_host: int,
    gap: float,
    ttl: float,
    interval: float,
    dead: str,
    plans: Any,
    ready: Any,
    folders: str,
) -> None:
    """Play ``hosts``: acquire their leases, keep them as planned, run their reapers."""
    client = redis.Redis.from_url(url, decode_responses=True)
    keys = Keys(NS)
    kept: list[tuple[Keeper, str]] = []
    for host in hosts:
        _as_host(host)
        leases = Leases(client, keys)
        # Each host's own monotonic clock (its boot time): the hosts' grid points differ.
        offset = random.uniform(0, 3600)
        clock = functools.partial(_shifted, offset)
        for _ in range(per_host):
            doc = leases.acquire(budget_sec=3600, gap_sec=gap, note="bench")
            k = Keeper(
                leases,
                doc,
                gap=gap,
                deadline=3600,
                beat_while_alive=False,
                host=host,
                now=clock(),
                clock=clock,
                batch=False,
            )
            k.beat_pending = True
            kept.append((k, host))
        reap_once(client, keys, grace=0.5, host=host, host_ttl=ttl)
    ready.put(len(kept))
    plan: Plan | None = None
    started = time.monotonic()
    lapsed = 0
    batched = False
    # A chatty step: a line comes just after every tick, so a renewal is always owed.
    wakes = [(_here(k, k.next_wake()), i) for i, (k, _h) in enumerate(kept)]
    heapq.heapify(wakes)
    next_pass = {h: started + random.uniform(0, interval) for h in hosts}
    while plan is None or time.time() < plan.until:
        if plan is None:
            with contextlib.suppress(queue.Empty):
                plan = plans.get_nowait()
        wall, now = time.time(), time.monotonic()
        is_dead = plan is not None and wall >= plan.dead_at
        quiet = plan is not None and plan.quiet_at <= wall < plan.after_at
        if plan is not None and wall >= plan.after_at and not batched:
            batched = True  # from here every host's keepers share its batch folder
            for k, host in kept:
                batch = HostBatch(k.leases, Path(folders) / "beats" / host, k.clock)
                k.seat = Seat(batch, k.lease_id, k.token, k.renew_interval)
        while not quiet and wakes and wakes[0][0] <= now:
            _due, i = heapq.heappop(wakes)
            keeper, host = kept[i]
            if is_dead and host == dead:
                continue
            for _line in range(2):  # the tick that was due, then one for the next line
                keeper.beat_pending = True
                ended = keeper.tick(keeper.clock())
                if ended is not None:  # the run is not valid: this machine was too busy
                    lapsed += 1
                    if lapsed in (1, 10, 100, 1000):
                        print(
                            f"  {lapsed} lease(s) ended under the keeper, the last: {ended.note}",
                            file=sys.stderr,
                        )
                    break
            else:
                heapq.heappush(wakes, (_here(keeper, keeper.next_wake()), i))
        for host, due in next_pass.items():
            if due <= now and not (is_dead and host == dead):
                reap_once(client, keys, grace=0.5, host=host, host_ttl=ttl, hold_off=0.0)
                next_pass[host] = due + interval
        soon = [*next_pass.values(), now + 0.05]
        if wakes and not quiet:
            soon.append(wakes[0][0])
        time.sleep(max(0.0, min(soon) - time.monotonic()))
    client.close()


def _shifted(offset: float) -> float:
    return time.monotonic() + offset


def _here(keeper: Keeper, at: float) -> float:
    # A time on the keeper's host clock, on this process's monotonic clock.
    return at - (keeper.clock() - time.monotonic())


def _cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


@dataclass(frozen=True)
class Window:
    share: float  # of one core
    beats: float  # script calls a second
    renewals: float  # leases renewed a second (a PEXPIRE each)
    commands: float  # every command a second (inner script calls included)


def measure(client: redis.Redis, start: float, seconds: float) -> Window:
    """Redis's CPU from wall time ``start`` for ``seconds``."""
    time.sleep(max(0.0, start - time.time()))
    client.config_resetstat()
    cpu0, t0 = _cpu(client), time.monotonic()
    time.sleep(seconds)
    used, took = _cpu(client) - cpu0, time.monotonic() - t0
    stats = client.info("commandstats")
    calls = sum(int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_evalsha"))
    renewed = int(stats.get("cmdstat_pexpire", {}).get("calls", 0))
    everything = sum(int(v["calls"]) for v in stats.values())
    return Window(used / took, calls / took, renewed / took, everything / took)


def beats_and_loss(url: str, args: argparse.Namespace) -> tuple[Window, Window, Window, float]:
    """(today, reapers only, batched, seconds until the lost host's leases were all ended
    host-lost)."""
    hosts = [f"sim-{i:03d}" for i in range(args.hosts)]
    per_host = args.leases // args.hosts
    client = redis.Redis.from_url(url, decode_responses=True)
    keys = Keys(NS)
    ctx = mp.get_context("fork")
    ready: Any = ctx.Queue()
    folders = tempfile.mkdtemp(prefix="bench-hosts-beats-")  # each host's batch folder below
    groups = [hosts[i :: args.procs] for i in range(args.procs)]
    dead = hosts[0]
    plans = [ctx.Queue() for _ in groups]
    workers = [
        ctx.Process(
            target=host_group,
            args=(
                url,
                g,
                per_host,
                args.gap,
                args.ttl,
                args.interval,
                dead,
                plans[j],
                ready,
                folders,
            ),
        )
        for j, g in enumerate(groups)
    ]
    for w in workers:
        w.start()
    total = sum(ready.get(timeout=300) for _ in workers)
    m, settle = args.measure, 2.0
    t = time.time()
    # The quiet window is short: the renewals left every key at least 2/3 of the gap.
    quiet = min(5.0, args.gap / 6)
    plan = Plan(
        quiet_at=t + settle + m,
        after_at=t + settle + m + quiet,
        dead_at=t + 2 * settle + 2 * m + quiet,
        until=t + 2 * settle + 2 * m + quiet + 2 * args.ttl + args.gap + 60,
    )
    for q in plans:
        q.put(plan)
    renew = Keeper(
        Leases(client, keys),
        LeaseDoc("x", 1, 1, 0, 1, 0, args.gap, "running"),
        gap=args.gap,
        deadline=3600,
        beat_while_alive=False,
        host="x",
        now=0,
    ).renew_interval
    print(
        f"  {total:,} running leases on {len(hosts)} hosts ({args.procs} processes); gap "
        f"{args.gap}s, reaper every {args.interval}s, host TTL {args.ttl}s; "
        f"{m:.0f} s windows"
    )
    before = measure(client, t + settle, m)
    print(
        f"  today (each lease renewed alone every {renew:g}s): Redis "
        f"{before.share * 100:.2f}% of one core, {before.beats:,.0f} script calls/s, "
        f"{before.renewals:,.0f} renewals/s, {before.commands:,.0f} commands/s"
    )
    edge = min(1.0, quiet / 4)  # the last renewals of one mode and the first of the next
    reapers = measure(client, plan.quiet_at + edge, quiet - 2 * edge)
    print(
        f"  reapers only (no beats): Redis {reapers.share * 100:.2f}% of one core, "
        f"{reapers.commands:,.0f} commands/s"
    )
    after = measure(client, plan.after_at + settle, m)
    print(
        f"  batched (each host's due leases in one call every {renew:g}s): Redis "
        f"{after.share * 100:.2f}% of one core, {after.beats:,.0f} script calls/s, "
        f"{after.renewals:,.0f} renewals/s, {after.commands:,.0f} commands/s"
    )
    lost_at = plan.dead_at  # the lost host's last beat is no later than this
    theirs = [
        str(i)
        for i in client.zrange(keys.leases, 0, -1)
        if client.hget(keys.lease(str(i)), "host") == dead
    ]
    ended_in = float("nan")
    deadline = time.monotonic() + (plan.dead_at - time.time()) + 2 * args.ttl + args.gap + 30
    while time.monotonic() < deadline:
        notes = [client.hget(keys.lease(i), "note") for i in theirs]
        if theirs and all(n == "reaped: host-lost" for n in notes):
            ends = [float(client.hget(keys.lease(i), "ended_unix") or 0) for i in theirs]
            ended_in = max(ends) - lost_at
            break
        time.sleep(0.1)
    for w in workers:
        w.terminate()
        w.join(10)
    client.close()
    shutil.rmtree(folders, ignore_errors=True)
    return before, reapers, after, ended_in


def _drain(url: str, host_ids: list[str], n: int, out: Any) -> None:
    client = redis.Redis.from_url(url, decode_responses=True)
    envelopes = []
    for host in host_ids:
        _as_host(host)
        envelopes.append(CallEnvelope(client, "shared", NS, request_ttl=3600))
    done = 0
    began = time.perf_counter()
    for i in range(n):
        try:
            envelopes[i % len(envelopes)].try_consume("model")
        except EnvelopeEmpty:
            break
        done += 1
    out.put((done, time.perf_counter() - began))
    client.close()


def throughput(url: str, procs_n: int, host_ids: list[list[str]], calls: int) -> float:
    """Consumes per second of ``procs_n`` processes draining one envelope of ``calls``."""
    client = redis.Redis.from_url(url, decode_responses=True)
    CallEnvelope(client, "shared", NS).reset(calls)
    ctx = mp.get_context("fork")
    out: Any = ctx.Queue()
    per = calls // procs_n
    workers = [
        ctx.Process(target=_drain, args=(url, host_ids[i], per, out)) for i in range(procs_n)
    ]
    began = time.perf_counter()
    for w in workers:
        w.start()
    results = [out.get(timeout=300) for _ in workers]
    elapsed = time.perf_counter() - began
    for w in workers:
        w.join(10)
    state = CallEnvelope(client, "shared", NS).snapshot()
    used = state.consumed_model + state.consumed_tool
    assert used == sum(r[0] for r in results) == per * procs_n, (used, results)
    client.close()
    return used / elapsed


def _beats(url: str, args: argparse.Namespace) -> bool:
    print("beats and a lost host:")
    before, reapers, after, ended_in = beats_and_loss(url, args)
    for label, w in (("today", before), ("batched", after)):
        if w.renewals:
            print(
                f"  {label}: {(w.share - reapers.share) / w.renewals * 1e6:.0f} us of "
                f"Redis CPU a renewal"
            )
    cheap = after.share <= 0.05
    print(
        f"beats cost: batched {after.share * 100:.2f}% of one Redis core with the "
        f"reapers' passes ({(after.share - reapers.share) * 100:.2f}% the renewals "
        f"alone), today {before.share * 100:.2f}%: {after.share / before.share:.2f}x "
        f"(target <= 5%) {'OK' if cheap else 'MISSED'}"
    )
    soon = ended_in <= 2 * args.ttl
    print(
        f"lost host: its leases ended host-lost {ended_in:.1f}s after its last beat "
        f"(TTL {args.ttl}s, target <= {2 * args.ttl:.0f}s) {'OK' if soon else 'MISSED'}"
    )
    return cheap and soon


def _envelope(url: str, args: argparse.Namespace) -> bool:
    print("envelope throughput (4 processes draining one envelope; the two alternated):")
    shapes = {
        "one host": [["solo"]] * 4,
        f"{args.hosts} hosts": [
            [f"sim-{i:03d}" for i in range(j, args.hosts, 4)] for j in range(4)
        ],
    }
    runs: dict[str, list[float]] = {label: [] for label in shapes}
    for _ in range(5):
        for label, ids in shapes.items():
            runs[label].append(throughput(url, 4, ids, args.calls))
    rates = []
    for label, rated in runs.items():
        rates.append(statistics.median(rated))
        spread = f"{min(rated):,.0f}-{max(rated):,.0f}"
        print(f"  {label}: median {rates[-1]:,.0f} consumes/s ({spread}; consumed == calls)")
    ratio = rates[1] / rates[0]
    fine = ratio >= 0.85
    print(
        f"envelope across hosts: {ratio:.2f}x a single host's (target >= 0.85x) "
        f"{'OK' if fine else 'MISSED'}"
    )
    return fine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hosts", type=int, default=100)
    parser.add_argument("--leases", type=int, default=10_000)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--gap", type=float, default=30.0)
    parser.add_argument("--ttl", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--measure", type=float, default=20.0)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--part", choices=("all", "beats", "envelope"), default="all")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-hosts-"))
    ok = True
    try:
        with EmbeddedRedis(work / "redis", password=uuid.uuid4().hex) as server:
            if args.part in ("all", "beats"):
                ok &= _beats(server.url, args)
            if args.part in ("all", "envelope"):
                ok &= _envelope(server.url, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
