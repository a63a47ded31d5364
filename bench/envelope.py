"""Envelope throughput against bare INCR and a WATCH/MULTI check-and-decrement.

Run: ``.venv/bin/python -m bench.envelope`` (about 30 s). It starts its own private
redis-server; 8 client processes hammer one key (or one envelope) per mode, the modes
interleaved over rounds so background load hits them alike.
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


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the three rates and the ratios; exit 1 if a target is missed
    and ``--check`` was given."""
    parser = argparse.ArgumentParser(prog="python -m bench.envelope", description=__doc__)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0, help="per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args(argv)

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
