"""``overnight reaper``: the host-local process that ends what dead supervisors left behind."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType

import click

from overnight.config.exits import EXIT_REDIS_DOWN, CommandError


@click.command("reaper")
@click.option("--once", is_flag=True, help="Make one pass and exit 0 (for cron and tests).")
@click.option(
    "--interval",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SEC",
    help="Seconds between passes (default OVERNIGHT_REAPER_INTERVAL, 2).",
)
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SEC",
    help="Seconds between SIGTERM and SIGKILL (default OVERNIGHT_GRACE, 5).",
)
@click.option("-v", "--verbose", is_flag=True, help="Also log a summary of every pass.")
@click.pass_context
def reaper_command(
    ctx: click.Context, once: bool, interval: float | None, grace: float | None, verbose: bool
) -> None:
    """Kill the trees of this host's leases whose liveness key lapsed, and end those leases.

    Each pass signals a lease's processes only if its supervisor's local proof is there and
    matches the lease (pid, start time, token, boot id), kills the whole tree (group,
    session and tagged descendants), then ends the lease `expired` (past its deadline) or
    `killed` with a note starting `reaped:`. A lease without a matching proof is ended
    with `unproven:` in its note and nothing is signalled. Leases of hosts with no live
    reaper are ended `killed` / `reaped: host-lost`. SIGTERM or Ctrl-C finishes the current
    pass and exits 0.
    """
    import redis

    from overnight.config.connection import describe
    from overnight.config.context import redis_client, settings
    from overnight.config.keys import Keys
    from overnight.config.settings import mask_url
    from overnight.worker.reaper import reaper
    from overnight.worker.redisio.clients import STARTUP_WAIT, retry_transient
    from overnight.worker.supervise import procs

    cfg = settings()
    if not once:  # a long-running reaper names its Redis first; one pass just answers
        click.echo(f"overnight reaper: {describe(cfg)}", err=True)
    debug = bool((ctx.obj or {}).get("debug"))
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if verbose or debug else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    client = redis_client()
    try:
        # A one-shot pass does not wait; a long-running reaper rides out a Redis restarting.
        if once:
            client.ping()
        else:
            retry_transient(client.ping, "reaper start", reaper.log, patience=STARTUP_WAIT, cap=2.0)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise CommandError(
            f"Redis unreachable at {mask_url(cfg.redis_url)}: {exc}", EXIT_REDIS_DOWN
        ) from None
    every = interval if interval is not None else cfg.reaper_interval
    reaper.log.info(
        "reaper host=%s namespace=%s interval=%.2fs started",
        procs.hostname(),
        cfg.namespace,
        every,
    )
    try:
        reaper.run(
            client,
            Keys(cfg.namespace),
            interval=every,
            grace=cfg.grace if grace is None else grace,
            host_ttl=max(cfg.reaper_host_ttl, 3 * every),
            stop=stop,
            once=once,
        )
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise CommandError(
            f"Redis unreachable at {mask_url(cfg.redis_url)}: {exc}", EXIT_REDIS_DOWN
        ) from None
    reaper.log.info("reaper host=%s stopped", procs.hostname())
