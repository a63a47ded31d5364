"""``overnight worker``: an RQ worker for tasks (and, with ``--with-reaper``, this host's
reaper as its child). Parsing only; the worker is :mod:`coordinator.dispatch.worker`."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import click

from overnight.config.spawn import overnight_argv


@click.command("worker")
@click.option("--burst", is_flag=True, help="Run queued jobs, then exit (instead of waiting).")
@click.option(
    "--queues", "-q", multiple=True, metavar="Q[,Q…]", help="Queues to serve [OVERNIGHT_QUEUE]."
)
@click.option("--name", metavar="NAME", help="Worker name (default: random).")
@click.option("--max-jobs", type=click.IntRange(min=1), help="Exit after this many jobs.")
@click.option(
    "--with-reaper",
    is_flag=True,
    help="Also run this host's reaper as a child process (one command per container, "
    "as docker-compose.yml does); it stops with the worker.",
)
def worker_command(
    burst: bool, queues: tuple[str, ...], name: str | None, max_jobs: int | None, with_reaper: bool
) -> None:
    """Run an RQ worker that runs overnight tasks (an rq.Worker subclass).

    Equivalent to `rq worker -w overnight.coordinator.dispatch.OvernightWorker QUEUE`. Each job
    runs one task's loop in the work horse, every step under a lease. At start and every
    OVERNIGHT_RECOVERY_INTERVAL seconds while idle it recovers tasks whose worker died:
    re-queued from their checkpoint, or paused when a step's outcome is unknown.
    """
    import contextlib
    import logging
    from functools import partial

    import redis

    from overnight.config.connection import describe, require_password
    from overnight.config.context import rq_connection, settings
    from overnight.config.settings import NAME_RE
    from overnight.coordinator.dispatch.gateway_watch import GatewayWatch
    from overnight.coordinator.dispatch.worker import OvernightWorker
    from overnight.coordinator.report.metrics import serve_from_settings as serve_metrics
    from overnight.coordinator.workspace.hostdirs import prepare_host
    from overnight.worker.redisio.clients import STARTUP_WAIT, retry_transient, transient
    from overnight.worker.sandbox import launch
    from overnight.worker.sandbox.stepuser import configured, steps_line

    user = configured()  # who steps run as: a setting that cannot be honoured is exit 78 now
    sandboxed = launch.configured(user)  # likewise a sandbox asked for that cannot start
    prepare_host(settings(), user)  # likewise a folder it cannot use, before any task
    click.echo(f"overnight worker: {describe(settings())}", err=True)
    click.echo(f"overnight worker: {steps_line(user, os.geteuid())}", err=True)
    if not sandboxed:
        click.echo(
            f"overnight worker: steps run WITHOUT a sandbox ({launch.SANDBOX_VAR}=off)", err=True
        )
    names = [q for item in queues for q in item.split(",") if q] or [settings().queue]
    for q in names:
        if not NAME_RE.match(q):
            raise click.BadParameter(f"bad queue name {q!r}", param_hint="--queues")
    conn = rq_connection()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # Both talk to the primary: a worker started while a failover runs waits for the new one.
    for call in (conn.ping, partial(require_password, conn, settings(), "overnight worker")):
        retry_transient(
            call,
            "worker start",
            logging.getLogger("overnight.worker"),
            patience=STARTUP_WAIT,
            cap=2.0,
        )
    worker = OvernightWorker(names, connection=conn, name=name)
    serve_metrics(worker.name)  # OVERNIGHT_METRICS_PORT: this worker's /metrics
    reaper = _start_reaper() if with_reaper else None
    gateway = GatewayWatch.start_for(settings())  # restarted whenever it exits
    try:
        while True:
            try:
                worker.work(burst=burst, logging_level="INFO", max_jobs=max_jobs)
                break
            except redis.RedisError as exc:
                # RQ rides out a lost connection while it waits for jobs, not while it starts
                # up or reports a job: start over once Redis is back (as RQ would have); so
                # too for a write refused (maxmemory, a replica, loading) that no override
                # of ours caught.
                if not transient(exc):
                    raise
                logging.getLogger("overnight.worker").warning(
                    "Redis unavailable (%s: %s); starting the worker again in 1s",
                    type(exc).__name__,
                    exc,
                )
                with contextlib.suppress(Exception):
                    worker.unsubscribe()
                    worker.register_death()  # type: ignore[no-untyped-call]
                time.sleep(1.0)
                worker = OvernightWorker(names, connection=conn, name=name)
    finally:
        if reaper is not None:
            reaper.terminate()
            reaper.wait(30)
        if gateway is not None:
            gateway.stop()


def _start_reaper() -> subprocess.Popen[bytes]:
    """``overnight reaper`` as a child that gets SIGTERM if this worker dies."""

    from overnight.worker.supervise.procs import set_pdeathsig

    return subprocess.Popen(
        overnight_argv("reaper"),
        stdin=subprocess.DEVNULL,
        preexec_fn=lambda: set_pdeathsig(signal.SIGTERM),
    )
