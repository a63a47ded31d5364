"""Benchmark: one recovery pass with 10,000 queued tasks (target <= 50 ms).

``python -m bench.recovery [--tasks 10000] [--passes 20]`` starts a private redis-server,
submits N tasks (their RQ jobs enqueued, as ``overnight submit`` does) and times recovery
passes: the steady pass (nothing lapsed, nothing due: what every recovery interval costs)
and, for scale, a pass right after every queued task became due a check of its RQ job (one
batch of them is checked per pass). The pass reads the recovery index, so the steady figure
does not grow with the queue.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

TARGET_MS = 50.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery")
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--passes", type=int, default=20)
    args = parser.parse_args(argv)

    import redis

    from overnight.config.keys import Keys
    from overnight.config.settings import load_settings
    from overnight.coordinator.dispatch.enqueue import enqueue
    from overnight.coordinator.dispatch.recovery import recover
    from overnight.coordinator.night.embedded_redis import EmbeddedRedis
    from overnight.coordinator.tasks.store import TaskStore
    from overnight.coordinator.tasks.taskfile import Rule, TaskSpec

    with tempfile.TemporaryDirectory(prefix="overnight-bench-recovery-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis", password=uuid.uuid4().hex)
        server.start()
        try:
            namespace = f"bench-{uuid.uuid4().hex[:6]}"
            settings = load_settings(redis_url=server.url, namespace=namespace)
            client = redis.Redis.from_url(server.url, decode_responses=True)
            rq_conn = redis.Redis.from_url(server.url)
            keys = Keys(namespace)
            spec = TaskSpec(
                assignment="x",
                workdir=tmp,
                agent=["true"],
                max_calls=3,
                verifier=[Rule(name="r", run=["true"])],
            )
            store = TaskStore(client, keys, retention=settings.retention)
            made = 0
            while made < args.tasks:
                batch = min(1000, args.tasks - made)
                recs = store.create([spec] * batch, namespace)
                enqueue(rq_conn, recs, namespace, retention=settings.retention)
                made += batch
            steady = []
            for _ in range(args.passes):
                began = time.perf_counter()
                actions = recover(client, rq_conn, keys, settings)
                steady.append((time.perf_counter() - began) * 1000)
                assert not actions, actions
            # Every queued task due a check now (as if the grace had passed for all).
            client.zadd(keys.task_queued, dict.fromkeys(store.ids(), 0), xx=True)
            began = time.perf_counter()
            recover(client, rq_conn, keys, settings)
            due_ms = (time.perf_counter() - began) * 1000
            best, median = min(steady), statistics.median(steady)
            print(
                f"recovery pass, {args.tasks} queued tasks: best {best:.2f} ms, "
                f"median {median:.2f} ms over {args.passes} passes (target <= "
                f"{TARGET_MS:.0f} ms)"
            )
            print(
                f"recovery pass with every queued task due a job check: {due_ms:.1f} ms "
                "(one batch of 500 checked per pass)"
            )
        finally:
            server.stop(kill=True)
    if median > TARGET_MS:
        print(f"MISSED: median {median:.2f} ms > {TARGET_MS:.0f} ms")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
