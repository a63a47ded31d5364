"""Reaper benchmark: orphan latency after a supervisor is SIGKILLed, and pass cost at scale.

``.venv/bin/python -m bench.reaper`` starts its own private redis-server. Targets:
orphan latency (tree dead - supervisor SIGKILL, real supervisors with their
proofs) <= gap + 0.25 s, whatever the interval; a pass over
100,000 live leases of which 100 lapsed <= 50 ms and within 2x of the 100-lease pass.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import redis

from overnight.config.keys import Keys
from overnight.config.runtime import proof_dir
from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.lease import proof
from overnight.worker.reaper.reaper import reap_once
from overnight.worker.supervise import procs

OVERNIGHT = str(Path(sys.executable).with_name("overnight"))
# A chatty child that outlives its supervisor's pipe (SIGPIPE ignored) and a setsid'd grandchild.
CHILD = "trap '' PIPE; setsid sleep 300 & echo $! > {pids}; while :; do echo tick; sleep 0.1; done"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _wait(predicate: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


def _child_pids(supervisor: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(supervisor)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def orphan_latency(
    server: EmbeddedRedis, runs: int, gap: float, interval: float, work: Path
) -> list[float]:
    """Seconds from SIGKILL of a supervisor to the death of its whole tree, per run."""
    ns = f"bench-orphan-{os.getpid()}"
    env = {**os.environ, "OVERNIGHT_REDIS_URL": server.url, "OVERNIGHT_NAMESPACE": ns}
    if os.geteuid() == 0:  # the child writes its pid file into this bench's (root's) folder
        env["OVERNIGHT_ALLOW_ROOT_STEPS"] = "1"
    print(
        f"orphan latency: overnight supervise, gap {gap}s, reaper interval {interval}s, {runs} runs"
    )
    reaper = subprocess.Popen(
        [OVERNIGHT, "reaper", "--interval", str(interval), "--grace", "1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis.from_url(server.url)
    _wait(lambda: client.exists(Keys(ns).reaper_host(procs.hostname())), 10)
    results: list[float] = []
    try:
        for i in range(runs):
            pids = work / f"pids-{i}"
            script = CHILD.format(pids=pids)
            cmd = [
                OVERNIGHT,
                "supervise",
                "--quiet",
                "--gap",
                str(gap),
                "--grace",
                "1",
                "--",
                "sh",
                "-c",
                script,
            ]
            sup = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
            if not _wait(lambda: pids.exists() and pids.read_text().strip(), 10):  # noqa: B023
                raise RuntimeError("the supervised child did not start")
            grandchild = int(pids.read_text())
            tree = [*_child_pids(sup.pid), grandchild]
            # Let a few beats land; the random part keeps runs from phase-locking to the
            # reaper's passes, which would hide the interval's share of the latency.
            time.sleep(0.3 + random.uniform(0, interval))
            killed = time.monotonic()
            sup.send_signal(signal.SIGKILL)
            sup.wait()
            if not _wait(lambda: not any(_alive(p) for p in tree), 30):  # noqa: B023
                raise RuntimeError(f"tree {tree} still alive 30 s after SIGKILL")
            results.append(time.monotonic() - killed)
            print(f"  run {i + 1}: {results[-1]:.3f}s")
    finally:
        reaper.send_signal(signal.SIGTERM)
        reaper.wait(15)
        client.close()
    return results


def _populate(client: redis.Redis, keys: Keys, live: int, lapsed: int, now_ms: int) -> None:
    """``live`` running leases far from lapsing plus ``lapsed`` whose key is gone: half on a
    host whose reaper is alive (left alone), half on this host naming pids that do not exist,
    each with its supervisor's proof (reaped: proof checked, tree scanned for, ended)."""
    host = procs.hostname()
    boot = procs.boot_id()
    client.set(keys.reaper_host("bench-busy-host"), "1", px=600_000)
    pipe = client.pipeline(transaction=False)
    for i in range(live + lapsed):
        lease_id = f"b{i}"
        is_lapsed = i >= live
        on_host = host if not is_lapsed or i % 2 else "bench-busy-host"
        now = now_ms / 1000
        pipe.hset(
            keys.lease(lease_id),
            mapping={
                "lease_id": lease_id,
                "token": str(i + 1),
                "holder_pid": str(2**22 + 100 + i),
                "pgid": str(2**22 + 100 + i),
                "host": on_host,
                "budget_sec": "600",
                "started_unix": f"{now - 60:.6f}",
                "deadline_unix": f"{now + 540:.6f}",
                "heartbeat_unix": f"{now - (5 if is_lapsed else 0):.6f}",
                "heartbeat_max_gap_sec": "3",
                "status": "running",
                "note": "bench",
                "exit_code": "",
                "ended_unix": "",
                "supervisor_pid": "0",
                "child_start_ticks": "12345",
                "boot_id": boot,
                "task_id": "",
            },
        )
        if is_lapsed:
            pipe.zadd(keys.lease_expiry, {lease_id: now_ms - 2000})
            if on_host == host:
                pid = 2**22 + 100 + i
                proof.store(
                    keys.namespace,
                    proof.Proof(lease_id, i + 1, pid, pid, 12345, boot, os.getpid(), 1),
                )
        else:
            pipe.set(keys.lease_alive(lease_id), str(i + 1), px=600_000)
            pipe.zadd(keys.lease_expiry, {lease_id: now_ms + 600_000})
        if len(pipe) >= 5000:
            pipe.execute()
    pipe.execute()


def pass_cost(
    server: EmbeddedRedis, sizes: list[int], lapsed: int, repeats: int
) -> dict[int, float]:
    """Median seconds of one pass, per total number of leases."""
    client = redis.Redis.from_url(server.url, decode_responses=True)
    out: dict[int, float] = {}
    try:
        for size in sizes:
            times: list[float] = []
            for rep in range(repeats):
                client.flushdb()
                keys = Keys(f"bench-scale-{size}-{rep}")
                secs, micros = client.time()
                _populate(
                    client, keys, size - lapsed, lapsed, int(secs) * 1000 + int(micros) // 1000
                )
                began = time.perf_counter()
                report = reap_once(client, keys, grace=1.0, hold_off=0.0)
                times.append(time.perf_counter() - began)
                assert report.lapsed == lapsed, report.summary()
                assert report.ended == lapsed // 2 and report.signalled == 0, report.summary()
                shutil.rmtree(proof_dir(keys.namespace).parent, ignore_errors=True)
            out[size] = statistics.median(times)
            print(
                f"  {size:>7,} leases ({lapsed} lapsed): median pass {out[size] * 1000:.1f} ms "
                f"(best {min(times) * 1000:.1f}, worst {max(times) * 1000:.1f})"
            )
        client.flushdb()
    finally:
        client.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--gap", type=float, default=1.0)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-latency", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-reaper-"))
    ok = True
    try:
        with EmbeddedRedis(work / "redis", password=uuid.uuid4().hex) as server:
            if not args.skip_latency:
                lat = orphan_latency(server, args.runs, args.gap, args.interval, work)
                # The reaper hears the liveness key lapse (keyspace events): no interval.
                target = args.gap + 0.25
                med, worst = statistics.median(lat), max(lat)
                ok &= worst <= target
                verdict = "OK" if worst <= target else "MISSED"
                print(
                    f"orphan latency: median {med:.3f}s, worst {worst:.3f}s "
                    f"(target <= {target:.1f}s) {verdict}"
                )
            print("pass cost:")
            cost = pass_cost(server, [100, 10_000, 100_000], 100, args.repeats)
            big, small = cost[100_000], cost[100]
            fine = big <= 0.050 and big <= 2 * small
            ok &= fine
            mid = cost[10_000]
            print(
                f"pass cost: 100 -> {small * 1000:.1f} ms, 10,000 -> {mid * 1000:.1f} ms, "
                f"100,000 -> {big * 1000:.1f} ms (target <= 50 ms and <= 2x the 100-lease "
                f"pass) {'OK' if fine else 'MISSED'}"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
