"""Envelope throughput against bare INCR and a WATCH/MULTI check-and-decrement.

Run: ``.venv/bin/python -m bench.envelope`` (about 30 s). It starts its own private
redis-server; 8 client processes hammer one key (or one envelope) per mode, the modes
interleaved over rounds so background load hits them alike.

``--wait`` measures instead what acknowledging each spend by a replica costs
(``OVERNIGHT_REDIS_WAIT_REPLICAS=1``): one client's try_consume latency, p50 and p99, with
and without ``WAIT 1``, against a private primary and its replica, in the same run, the two
interleaved in batches.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
import uuid
from collections.abc import Callable
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import redis

from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.envelope.envelope import CallEnvelope

MODES = ("envelope", "incr", "watch")
NAMESPACE = "bench"
BIG = 10**12
TARGETS = {"incr": 0.8, "watch": 3.0}


def _watch_decrement(client: redis.Redis, key: str, spent: str) -> Callable[[], bool]:
    def op() -> bool:
        with client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)  # type: ignore[no-untyped-call]
                    remaining = int(pipe.get(key) or 0)
                    if remaining <= 0:
                        pipe.unwatch()
                        return False
                    pipe.multi()
                    pipe.decr(key)
                    pipe.incr(spent)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    return op


def _operation(mode: str, client: redis.Redis) -> Callable[[], Any]:
    if mode == "envelope":
        env = CallEnvelope(client, "bench", NAMESPACE)
        return lambda: env.try_consume("model")
    if mode == "incr":
        return lambda: client.incr("{bench}:incr")
    return _watch_decrement(client, "{bench}:watch", "{bench}:watch-spent")


def _client_process(
    mode: str, url: str, seconds: float, barrier: Barrier, results: mp.Queue[int]
) -> None:
    client = redis.Redis.from_url(url, decode_responses=True)
    op = _operation(mode, client)
    op()
    barrier.wait()
    done = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        op()
        done += 1
    results.put(done)


def run_mode(mode: str, url: str, procs: int, seconds: float) -> float:
    """Operations per second of ``procs`` processes doing ``mode`` for ``seconds``."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(procs)
    results: mp.Queue[int] = ctx.Queue()
    workers = [
        ctx.Process(target=_client_process, args=(mode, url, seconds, barrier, results))
        for _ in range(procs)
    ]
    for proc in workers:
        proc.start()
    total = sum(results.get(timeout=seconds + 30) for _ in workers)
    for proc in workers:
        proc.join(timeout=10)
    return total / seconds


def _server_cpu(client: redis.Redis) -> float:
    info: dict[str, float] = client.info("cpu")
    return info["used_cpu_user"] + info["used_cpu_sys"]


def _prepare(url: str) -> None:
    client = redis.Redis.from_url(url, decode_responses=True)
    client.flushdb()
    CallEnvelope(client, "bench", NAMESPACE).reset(BIG)
    client.set("{bench}:watch", BIG)
    client.close()


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def wait_cost(calls: int, batch: int = 500) -> dict[int, list[float]]:
    """Seconds per try_consume, by replicas waited for (0 and 1), ``calls`` of each, against
    a private primary and its replica."""
    password = uuid.uuid4().hex
    auth = ["--masterauth", password]
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis(Path(tmp) / "primary", password=password, extra_args=auth) as primary,
    ):
        follow = [*auth, "--replicaof", "127.0.0.1", str(primary.port)]
        with EmbeddedRedis(Path(tmp) / "replica", password=password, extra_args=follow) as rep:
            probe = redis.Redis.from_url(rep.url, decode_responses=True)
            deadline = time.monotonic() + 30
            while probe.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise RuntimeError("the replica never synced")
                time.sleep(0.05)
            probe.close()
            client = redis.Redis.from_url(primary.url, decode_responses=True)
            envelopes = {
                n: CallEnvelope(client, "bench", NAMESPACE, replicas=n, replica_timeout=1.0)
                for n in (0, 1)
            }
            envelopes[0].reset(BIG)
            seconds: dict[int, list[float]] = {0: [], 1: []}
            while len(seconds[1]) < calls:
                for n, env in envelopes.items():
                    for _ in range(batch):
                        began = time.perf_counter()
                        env.try_consume("model")
                        seconds[n].append(time.perf_counter() - began)
            client.close()
    return seconds


def main_wait(calls: int) -> int:
    seconds = wait_cost(calls)
    print(f"try_consume latency, one client, {len(seconds[0]):,} calls each, primary + replica")
    for n, label in ((0, "no WAIT"), (1, "WAIT 1 (a replica acknowledges)")):
        p50, p99 = _percentile(seconds[n], 50) * 1e6, _percentile(seconds[n], 99) * 1e6
        print(f"  {label:<32} p50 {p50:7.0f} us   p99 {p99:7.0f} us")
    extra50 = (_percentile(seconds[1], 50) - _percentile(seconds[0], 50)) * 1e6
    extra99 = (_percentile(seconds[1], 99) - _percentile(seconds[0], 99)) * 1e6
    print(f"  cost of WAIT: +{extra50:.0f} us at p50, +{extra99:.0f} us at p99 per spend")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the three rates and the ratios; exit 1 if a target is missed
    and ``--check`` was given."""
    parser = argparse.ArgumentParser(prog="python -m bench.envelope", description=__doc__)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0, help="per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    parser.add_argument(
        "--wait", action="store_true", help="measure the latency a replica's WAIT adds instead"
    )
    parser.add_argument("--calls", type=int, default=5000, help="with --wait: calls per mode")
    args = parser.parse_args(argv)
    if args.wait:
        return main_wait(args.calls)

    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    server_us: dict[str, list[float]] = {mode: [] for mode in MODES}
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis(Path(tmp), password=uuid.uuid4().hex) as server,
    ):
        _prepare(server.url)
        probe = redis.Redis.from_url(server.url, decode_responses=True)
        for _ in range(args.rounds):
            for mode in MODES:
                before = _server_cpu(probe)
                rate = run_mode(mode, server.url, args.procs, args.seconds)
                rates[mode].append(rate)
                server_us[mode].append((_server_cpu(probe) - before) / (rate * args.seconds) * 1e6)
        consumed = CallEnvelope(probe, "bench", NAMESPACE).snapshot().consumed_model
        probe.close()

    mean = {mode: sum(values) / len(values) for mode, values in rates.items()}
    print(f"{args.procs} client processes, {args.rounds} rounds x {args.seconds:g} s per mode")
    labels = {
        "envelope": "envelope try_consume (Lua)",
        "incr": "bare INCR",
        "watch": "WATCH/MULTI check-and-decrement",
    }
    for mode in MODES:
        per_round = ", ".join(f"{v:,.0f}" for v in rates[mode])
        cpu = sum(server_us[mode]) / len(server_us[mode])
        print(
            f"  {labels[mode]:<34} {mean[mode]:>10,.0f} ops/s   (rounds: {per_round}; "
            f"server CPU ~{cpu:.0f} us/op)"
        )
    ok = True
    for other, target in TARGETS.items():
        ratio = mean["envelope"] / mean[other]
        met = ratio >= target
        ok &= met
        verdict = "ok" if met else "MISSED"
        print(f"  envelope / {other:<5} = {ratio:5.2f}x   (target >= {target}x: {verdict})")
    print(f"  envelope consumed {consumed:,} units in total")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    raise SystemExit(main())
