"""Benchmark: overnight tasks against plain RQ jobs doing the same two subprocesses.

``python -m bench.tasks [--tasks 200] [--workers 2]`` starts a private redis-server, then
in the same run (a) enqueues N plain RQ jobs that each run ``true`` twice and drains them
with W ``rq worker --burst`` processes (stock RQ but for the listener stop of
:class:`PlainWorker`), and (b) submits N overnight tasks whose
agent and single rule are ``true`` and drains them with W ``overnight worker --burst``
processes (every step under a lease, envelope-charged, checkpointed, with receipts).
It prints both rates and the ratio (overhead factor; target <= 1.5, exit status 1 when
missed).

A third shape is the sandboxed baseline: plain RQ jobs that run the same two commands, each
in the sandbox a step gets (the argv :func:`worker.sandbox.launch.prepare` builds, as one
uid of the step range when run as root) and nothing else of overnight. Its ratio to
overnight is what overnight's own bookkeeping costs once both pay for the sandbox; its
ratio to plain RQ is what bubblewrap itself costs. With ``OVERNIGHT_SANDBOX=off`` in the
environment overnight's steps run unsandboxed and the baseline is skipped.

It alternates the shapes for ``--rounds`` and reports the best run of each, since the
machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from overnight.worker.sandbox.stepuser import StepUser

# Who steps run as (contract §1): kept from the caller's environment.
STEP_VARS = ("OVERNIGHT_STEP_USER", "OVERNIGHT_ALLOW_ROOT_STEPS")


ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.5  # overnight's time over plain RQ's; the exit status is 1 when it is missed
BIN = Path(sys.executable).parent


def plain_job() -> int:
    """The plain-RQ baseline: the same two subprocesses a task runs (agent, then rule)."""
    subprocess.run(["true"], stdin=subprocess.DEVNULL, check=True)
    subprocess.run(["true"], stdin=subprocess.DEVNULL, check=True)
    return 0


def _sandbox_user() -> StepUser | None:
    from overnight.config.defaults import STEP_UIDS
    from overnight.worker.sandbox.stepuser import pooled

    return pooled(int(STEP_UIDS.split("-")[0])) if os.geteuid() == 0 else None


def sandboxed_job(workdir: str) -> int:
    """The sandboxed baseline: the same two commands, each in a step's sandbox."""
    from overnight.worker.sandbox import launch

    user = _sandbox_user()
    for _ in range(2):
        ready = launch.prepare(
            ["true"], cwd=workdir, worktree=workdir, user=user, env={"PATH": launch.SYSTEM_PATH}
        )
        try:
            subprocess.run(
                ready.argv,
                env=ready.env,
                pass_fds=ready.pass_fds,
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                check=True,
            )
        finally:
            ready.close()
    return 0


def _plain_worker_class() -> type:
    from rq import Worker

    from overnight.coordinator.dispatch.listener import stop_listening

    class PlainWorker(Worker):  # type: ignore[misc]
        """Stock RQ but for its listener's stop: with redis-py 6+ an idle burst worker's own
        waits up to 60 s for a subscription as it exits (overnight's worker has the same fix)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # As overnight's worker does at its start: one sandbox started, which leaves
            # what every launch looks up (the system folders, /etc's unreadable files)
            # cached for the work horses it forks.
            from overnight.worker.sandbox import launch

            launch.probe(_sandbox_user())

        def unsubscribe(self) -> None:
            stop_listening(self)

    return PlainWorker


PlainWorker = _plain_worker_class()


def _drain(argv: list[str], workers: int, env: dict[str, str], logs: Path) -> float:
    """Start the workers together and wait for all of them; their logs go to files (a
    pipe nobody reads would stall a worker once it filled)."""
    files = [open(logs / f"worker-{i}.log", "wb") for i in range(workers)]  # noqa: SIM115
    start = time.perf_counter()
    try:
        procs = [
            subprocess.Popen(argv, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
            for fh in files
        ]
        for proc in procs:
            proc.wait(timeout=600)
        elapsed = time.perf_counter() - start
    finally:
        for fh in files:
            fh.close()
    for i, proc in enumerate(procs):
        if proc.returncode != 0:
            tail = (logs / f"worker-{i}.log").read_text(errors="replace")[-2000:]
            raise SystemExit(f"worker failed ({proc.returncode}): {tail}")
    return elapsed


def run_plain(
    url: str, n: int, workers: int, env: dict[str, str], workdir: Path | None = None
) -> float:
    """Drain N plain RQ jobs: :func:`plain_job`, or with ``workdir`` :func:`sandboxed_job`."""
    import redis
    from rq import Queue

    conn = redis.Redis.from_url(url)
    queue = Queue(f"bench-plain-{uuid.uuid4().hex[:6]}", connection=conn)
    func, args = (
        ("bench.tasks.plain_job", ())
        if workdir is None
        else ("bench.tasks.sandboxed_job", (str(workdir),))
    )
    datas = [Queue.prepare_data(func, args=args, result_ttl=600) for _ in range(n)]
    with conn.pipeline() as pipe:
        queue.enqueue_many(datas, pipeline=pipe)
        pipe.execute()
    argv = [str(BIN / "rq"), "worker", "--burst", "-w", "bench.tasks.PlainWorker", "--url", url]
    argv.append(queue.name)
    elapsed = _drain(argv, workers, env, Path(env["BENCH_LOGS"]))
    if queue.finished_job_registry.count != n:
        raise SystemExit(f"plain RQ finished {queue.finished_job_registry.count} of {n} jobs")
    return elapsed


def run_overnight(url: str, n: int, workers: int, env: dict[str, str], workdir: Path) -> float:
    import redis

    from overnight.config.keys import Keys
    from overnight.coordinator.dispatch.enqueue import enqueue
    from overnight.coordinator.tasks.store import TaskStore
    from overnight.coordinator.tasks.taskfile import Rule, TaskSpec
    from overnight.worker.envelope.envelope import CallEnvelope

    namespace = env["OVERNIGHT_NAMESPACE"]
    client = redis.Redis.from_url(url, decode_responses=True)
    CallEnvelope(client, "default", namespace).reset(4 * n)
    spec = TaskSpec(
        assignment="benchmark",
        workdir=str(workdir),
        agent=["true"],
        max_calls=4,
        verifier=[Rule(name="true", run=["true"])],
    )
    store = TaskStore(client, Keys(namespace))
    records = store.create([spec] * n, env["OVERNIGHT_QUEUE"])
    enqueue(redis.Redis.from_url(url), records, namespace)
    argv = [str(BIN / "overnight"), "worker", "--burst"]
    elapsed = _drain(argv, workers, env, Path(env["BENCH_LOGS"]))
    states = [rec.state for rec in store.all()]
    if states.count("finished_verified") != n:
        other = next(rec for rec in store.all() if rec.state != "finished_verified")
        raise SystemExit(
            f"overnight verified {states.count('finished_verified')} of {n} tasks; "
            f"one of the others: {other.model_dump_json()}"
        )
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternate runs; best of each")
    args = parser.parse_args(argv)

    from overnight.coordinator.night.embedded_redis import EmbeddedRedis

    with (
        tempfile.TemporaryDirectory(prefix="overnight-bench-") as tmp,
        EmbeddedRedis(Path(tmp) / "redis", password=uuid.uuid4().hex) as server,
    ):
        env = {
            k: v for k, v in os.environ.items() if not k.startswith("OVERNIGHT_") or k in STEP_VARS
        }
        env.update(
            OVERNIGHT_REDIS_URL=server.url,
            OVERNIGHT_NAMESPACE=f"bench-{uuid.uuid4().hex[:6]}",
            OVERNIGHT_QUEUE=f"bench-tasks-{uuid.uuid4().hex[:6]}",
            BENCH_LOGS=tmp,
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(
                os.pathsep
            ),
        )
        # An in-place workdir every task's step may write: as root each task's step runs
        # as a uid of its own, which a private temporary folder would shut out.
        work = Path(tmp) / "work"
        work.mkdir()
        work.chmod(0o1777)
        Path(tmp).chmod(0o755)
        sandboxed = os.environ.get("OVERNIGHT_SANDBOX", "bwrap").strip().lower() != "off"
        plains: list[float] = []
        boxes: list[float] = []
        ourses: list[float] = []
        for i in range(args.rounds):
            plains.append(run_plain(server.url, args.tasks, args.workers, env))
            if sandboxed:
                boxes.append(run_plain(server.url, args.tasks, args.workers, env, work))
            ours_env = {**env, "OVERNIGHT_NAMESPACE": f"{env['OVERNIGHT_NAMESPACE']}-{i}"}
            ourses.append(run_overnight(server.url, args.tasks, args.workers, ours_env, work))
    plain, ours, n = min(plains), min(ourses), args.tasks
    print(
        f"tasks={n} workers={args.workers} rounds={args.rounds} (best of each; "
        "each task: agent `true` + one rule `true`)"
    )
    print(f"plain RQ jobs      : {n / plain:8.1f} tasks/s  ({plain:.2f}s)")
    if boxes:
        box = min(boxes)
        print(f"sandboxed RQ jobs  : {n / box:8.1f} tasks/s  ({box:.2f}s)")
    print(f"overnight tasks    : {n / ours:8.1f} tasks/s  ({ours:.2f}s)")
    met = ours / plain <= TARGET
    verdict = "PASS" if met else "MISS"
    print(f"overhead ratio     : {ours / plain:8.2f}x  (target <= {TARGET:.2f}x)  {verdict}")
    if boxes:
        print(f"  over sandboxed RQ: {ours / box:8.2f}x  (overnight's own part)")
        print(f"  sandboxed / plain: {box / plain:8.2f}x  (bubblewrap's part)")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
