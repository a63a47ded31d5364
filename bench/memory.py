"""Benchmark: Redis memory per live task, per retained (ended) task, and after retention.

``python -m bench.memory [--tasks 10000] [--retention 60]`` starts a private redis-server
and takes N tasks through what a worker leaves in Redis, with the real scripts: submit (the
task record and its RQ job: *live*), then for each task a claim, two leases (the agent's
step and a rule) acquired and ended with their receipts, the charged call, the terminal
save, and the RQ job finished with its result kept for the retention (*retained*). It prints
``used_memory`` deltas per task, then waits the retention out, runs one recovery pass (which
forgets expired task ids, trims receipts by age and drops expired leases from the list) and
prints what is left: 0 bytes per task is the target.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path


def _used(client: object) -> int:
    import redis

    assert isinstance(client, redis.Redis)
    client.execute_command("MEMORY", "PURGE")  # type: ignore[no-untyped-call]
    return int(client.info("memory")["used_memory"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory")
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--retention", type=int, default=60)
    args = parser.parse_args(argv)
    # Lease documents read their retention from the environment (worker.lease.store).
    os.environ["OVERNIGHT_RETENTION"] = str(args.retention)

    import redis
    from rq import Queue
    from rq.job import Job, JobStatus

    from overnight.config.keys import Keys
    from overnight.config.settings import load_settings
    from overnight.coordinator.dispatch.enqueue import enqueue
    from overnight.coordinator.dispatch.recovery import recover
    from overnight.coordinator.night.embedded_redis import EmbeddedRedis
    from overnight.coordinator.tasks.states import State
    from overnight.coordinator.tasks.store import Checkpoint, Next, Runner, TaskRecord, TaskStore
    from overnight.coordinator.tasks.taskfile import Rule, TaskSpec
    from overnight.worker.lease.store import Leases

    n = args.tasks
    with tempfile.TemporaryDirectory(prefix="overnight-bench-memory-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis", password=uuid.uuid4().hex)
        server.start()
        try:
            namespace = f"bench-{uuid.uuid4().hex[:6]}"
            settings = load_settings(
                redis_url=server.url, namespace=namespace, retention=args.retention
            )
            client = redis.Redis.from_url(server.url, decode_responses=True)
            rq_conn = redis.Redis.from_url(server.url)
            keys = Keys(namespace)
            spec = TaskSpec(
                assignment="Create ok.txt in the work directory.",
                workdir=tmp,
                agent=["true"],
                max_calls=3,
                verifier=[Rule(name="tests", run=["true"])],
            )
            store = TaskStore(client, keys, retention=args.retention)
            leases = Leases(client, keys)
            queue = Queue(namespace, connection=rq_conn)
            base = _used(client)
            records: list[TaskRecord] = []
            while len(records) < n:
                batch = store.create([spec] * min(1000, n - len(records)), namespace)
                enqueue(rq_conn, batch, namespace, retention=args.retention)
                records += batch
            live = _used(client) - base
            began = time.monotonic()
            runner = Runner(host="bench", pid=os.getpid(), worker="bench", job_id="")
            for rec in records:
                token = uuid.uuid4().hex
                claimed = store.claim(rec.id, 1, token, 60.0, runner)
                for step in ("agent", "tests"):
                    doc = leases.acquire(budget_sec=60, gap_sec=30, task_id=rec.id)
                    leases.end(doc.lease_id, doc.token, "done", "worker-complete", exit_code=0)
                    del step
                cp = Checkpoint()
                store.save(claimed, token, Next(cp, State.FINISHED_VERIFIED, "every rule passed"))
                job = Job.fetch(rec.job_id(), connection=rq_conn)
                queue.remove(job)
                job.set_status(JobStatus.FINISHED)
                job.cleanup(ttl=args.retention)
            took = time.monotonic() - began
            retained = _used(client) - base
            print(
                f"{n} tasks: live (queued, RQ job enqueued) {live / n:,.0f} B/task; "
                f"retained after the end {retained / n:,.0f} B/task "
                f"({retained / 1e6:.1f} MB; OVERNIGHT_RETENTION={args.retention}s)"
            )
            if took >= args.retention:
                print(
                    f"note: ending them took {took:.0f}s, longer than the retention; "
                    "the retained figure misses the first ones"
                )
            time.sleep(args.retention + 2)  # the last task ended just now
            keys_before = client.dbsize()
            for _ in range(2 + 2 * n // 1000):  # a pass forgets up to 1,000 ended leases
                recover(client, rq_conn, keys, settings)
            # Expired keys go as Redis samples them; reading each name ends it at once.
            names = [k for k in client.scan_iter(count=1000) if client.exists(k)]
            time.sleep(0.5)
            after = _used(client) - base
            held = sum(int(client.memory_usage(k) or 0) for k in names)
            kinds = sorted({k.split(":")[-1] if k.startswith("{") else k for k in names})
            print(
                f"after the retention and the recovery passes: {len(names)} keys left of "
                f"{keys_before} ({', '.join(kinds)}), holding {held:,} B: {held / n:.2f} "
                f"B/task; used_memory {after:+,} B against the empty server (allocator "
                "pages and script caches)"
            )
        finally:
            server.stop(kill=True)
    return 0 if held < 4096 else 1  # a few per-namespace keys, nothing per task


if __name__ == "__main__":
    sys.exit(main())
