"""Many hosts on one Redis: what beats cost, how soon a lost host is ended, one envelope's
throughput across hosts.

``.venv/bin/python -m bench.hosts`` starts its own private redis-server. Hosts are
simulated: host ids spread over a small process pool (this machine has 2 cores), each host
holding its share of the running leases, beating each lease every gap/4 (the keeper's
cadence for ``--beat-while-alive``; a step that prints beats up to every 0.25 s, which
this figure does not cover) and running its reaper's pass (heartbeat key plus the expiry
index) every reaper interval; every call is one round trip, as a real supervisor's is.

Targets (issue 16): beats cost <= 5% of one Redis core; a lost host (its beats and reaper
stop at once) ended ``reaped: host-lost`` within 2x its TTL; envelope throughput across
hosts >= 0.8x a single host's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from overnight.config.keys import Keys
from overnight.coordinator.embedded_redis import EmbeddedRedis
from overnight.worker import procs
from overnight.worker.envelope import CallEnvelope, EnvelopeEmpty
from overnight.worker.lease import LeaseRefused, Leases
from overnight.worker.reaper import reap_once

NS = "bench-hosts"


def _as_host(host_id: str) -> None:
    # procs.hostname() is read where a lease or envelope is made: one process plays many hosts.
    procs.hostname = lambda: host_id  # type: ignore[assignment]


def host_group(
    url: str, hosts: list[str], per_host: int, gap: float, ttl: float, interval: float,
    dead: str | None, dead_after: float, until: float, ready: Any,
) -> None:  # fmt: skip
    """Play ``hosts``: acquire their leases, then beat them and run their reapers."""
    client = redis.Redis.from_url(url, decode_responses=True)
    keys = Keys(NS)
    held: list[tuple[float, str, int, str]] = []  # next beat, lease, token, host
    for host in hosts:
        _as_host(host)
        leases = Leases(client, keys)
        for _ in range(per_host):
            doc = leases.acquire(budget_sec=3600, gap_sec=gap, note="bench")
            held.append((time.monotonic() + random.uniform(0, gap / 4), doc.lease_id,
                         doc.token, host))  # fmt: skip
        reap_once(client, keys, grace=0.5, host=host, host_ttl=ttl)
    ready.put(len(held))
    leases = Leases(client, keys)
    started = time.monotonic()
    next_pass = {h: started + random.uniform(0, interval) for h in hosts}
    held.sort()
    while time.time() < until:
        now = time.monotonic()
        is_dead = now - started >= dead_after
        for i, (due, lease_id, token, host) in enumerate(held):
            if due > now:
                break
            if not (is_dead and host == dead):
                try:
                    leases.beat(lease_id, token)
                except LeaseRefused as exc:  # lapsed while this machine was busy: say so
                    print(f"  beat refused: {exc}", file=sys.stderr)
            held[i] = (due + gap / 4, lease_id, token, host)
        held.sort()
        for host, due in next_pass.items():
            if due <= now and not (is_dead and host == dead):
                reap_once(client, keys, grace=0.5, host=host, host_ttl=ttl, hold_off=0.0)
                next_pass[host] = due + interval
        wake = min([held[0][0], *next_pass.values()]) if held else now + 0.05
        time.sleep(max(0.0, min(0.05, wake - time.monotonic())))
    client.close()


def _cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def beats_and_loss(url: str, args: argparse.Namespace) -> tuple[float, float, int]:
    """(Redis CPU share of one core while every host beats, seconds until the lost host's
    leases were all ended host-lost, leases)."""
    hosts = [f"sim-{i:03d}" for i in range(args.hosts)]
    per_host = args.leases // args.hosts
    client = redis.Redis.from_url(url, decode_responses=True)
    keys = Keys(NS)
    ready: Any = mp.get_context("fork").Queue()
    groups = [hosts[i :: args.procs] for i in range(args.procs)]
    measure = args.measure
    # Everyone starts beating once all leases exist; the lost host stops after the window.
    until = time.time() + 120 + measure + 2 * args.ttl + 10
    dead = hosts[0]
    ctx = mp.get_context("fork")
    workers = [
        ctx.Process(target=host_group, args=(url, g, per_host, args.gap, args.ttl,
                                             args.interval, dead, measure, until, ready))
        for g in groups
    ]  # fmt: skip
    for w in workers:
        w.start()
    total = sum(ready.get(timeout=300) for _ in workers)
    print(f"  {total:,} running leases on {len(hosts)} hosts ({args.procs} processes); "
          f"gap {args.gap}s (a beat per lease every {args.gap / 4}s), reaper every "
          f"{args.interval}s, host TTL {args.ttl}s")  # fmt: skip
    client.config_resetstat()
    cpu0, t0 = _cpu(client), time.monotonic()
    time.sleep(measure)
    share = (_cpu(client) - cpu0) / (time.monotonic() - t0)
    stats = client.info("commandstats")
    scripts = [v for k, v in stats.items() if k.startswith("cmdstat_evalsha")]
    calls = sum(int(v["calls"]) for v in scripts)
    inside = sum(float(v["usec"]) for v in scripts) / 1e6 / measure
    everything = sum(int(v["calls"]) for v in stats.values())
    rate = everything / measure
    print(f"  while beating: Redis used {share * 100:.2f}% of one core for {rate:,.0f} "
          f"commands/s; {calls / measure:,.0f} script calls/s (the beats) took "
          f"{inside * 100:.2f}% inside the scripts, the rest is reading and answering "
          f"each call and the reapers' passes")  # fmt: skip
    lost_at = time.time()  # the lost host's last beat is no later than this
    theirs = [str(i) for i in client.zrange(keys.leases, 0, -1)
              if client.hget(keys.lease(str(i)), "host") == dead]  # fmt: skip
    ended_in = float("nan")
    deadline = time.monotonic() + 2 * args.ttl + args.gap + 30
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
    return share, ended_in, total


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
    workers = [ctx.Process(target=_drain, args=(url, host_ids[i], per, out))
               for i in range(procs_n)]  # fmt: skip
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
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-hosts-"))
    ok = True
    try:
        with EmbeddedRedis(work / "redis") as server:
            print("beats and a lost host:")
            share, ended_in, _total = beats_and_loss(server.url, args)
            fine = share <= 0.05
            ok &= fine
            print(f"beats cost: {share * 100:.2f}% of one Redis core (target <= 5%) "
                  f"{'OK' if fine else 'MISSED'}")  # fmt: skip
            fine = ended_in <= 2 * args.ttl
            ok &= fine
            verdict = "OK" if fine else "MISSED"
            print(f"lost host: its leases ended host-lost {ended_in:.1f}s after its last beat "
                  f"(TTL {args.ttl}s, target <= {2 * args.ttl:.0f}s) {verdict}")  # fmt: skip
            print("envelope throughput (4 processes draining one envelope):")
            rates = []
            for label, ids in (
                ("one host", [["solo"]] * 4),
                (f"{args.hosts} hosts", [[f"sim-{i:03d}" for i in range(j, args.hosts, 4)]
                                         for j in range(4)]),
            ):  # fmt: skip
                runs = [throughput(server.url, 4, ids, args.calls) for _ in range(3)]
                rates.append(statistics.median(runs))
                print(f"  {label}: median {rates[-1]:,.0f} consumes/s (exact: consumed == calls)")
            ratio = rates[1] / rates[0]
            fine = ratio >= 0.8
            ok &= fine
            print(f"envelope across hosts: {ratio:.2f}x a single host's (target >= 0.8x) "
                  f"{'OK' if fine else 'MISSED'}")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
