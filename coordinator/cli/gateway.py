"""``overnight gateway``: run the metering model proxy of this host."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any

import click

from overnight.config.exits import EXIT_REDIS_DOWN, EXIT_USAGE, CommandError


@click.command("gateway")
@click.option(
    "--host",
    default=None,
    help="Address to listen on (default OVERNIGHT_GATEWAY_HOST, 127.0.0.1: loopback only).",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Port (default OVERNIGHT_GATEWAY_PORT, 4680; 0 picks a free one).",
)
@click.option("-v", "--verbose", is_flag=True, help="Log every request.")
def gateway_command(host: str | None, port: int | None, verbose: bool) -> None:
    """Proxy agents' model calls to the configured upstreams, metering each one.

    Routes: POST /v1/chat/completions, POST /v1/responses, GET /v1/models (to
    OVERNIGHT_MODEL_URL) and POST /v1/messages, POST /v1/messages/count_tokens (to
    OVERNIGHT_ANTHROPIC_URL), HEAD /. A request needs a step's per-lease token as its API
    key; it is reserved from the task's caps and the shared envelope before it is
    forwarded and committed from the response's usage after. It listens on its Unix socket
    (one per namespace, in a folder only this user writes: workers and sandboxed steps use
    it) and on --host:--port for clients that cannot use a socket. Prints one line with both
    once it listens; SIGTERM or Ctrl-C stops it.
    """
    import redis

    from overnight.config.connection import async_client_from_url
    from overnight.config.context import redis_client, settings
    from overnight.config.folders import usable
    from overnight.config.runtime import gateway_socket
    from overnight.config.settings import mask_url
    from overnight.worker.gateway import server as gateway
    from overnight.worker.supervise import procs

    cfg = settings()
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        redis_client().ping()
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise CommandError(
            f"Redis unreachable at {mask_url(cfg.redis_url)}: {exc}", EXIT_REDIS_DOWN
        ) from None
    # A bounded pool: 200 requests at once share a few dozen connections instead of failing
    # with "Too many connections".
    client = async_client_from_url(cfg.redis_url, timeout=5.0, max_connections=64)
    bind_host = host or cfg.gateway_host
    bind_port = cfg.gateway_port if port is None else port
    socket_path = gateway_socket(cfg.namespace)
    usable(
        socket_path.parent,
        0o755,
        f"remove it or let uid {os.geteuid()} own it (only overnight may write there)",
        own=True,
    )

    def ready(url: str) -> None:
        click.echo(f"overnight gateway: listening on {url}", err=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await gateway.serve(
                client,
                cfg.namespace,
                procs.hostname(),
                gateway.config_from(cfg),
                host=bind_host,
                port=bind_port,
                ready=ready,
                socket_path=socket_path,
            )
        finally:
            await client.aclose()

    try:
        _event_loop_run(main())
    except asyncio.CancelledError:
        pass
    except OSError as exc:
        where = f"{bind_host}:{bind_port} and {socket_path}"
        raise CommandError(f"cannot listen on {where}: {exc}", EXIT_USAGE) from None
    click.echo("overnight gateway: stopped", err=True)


def _event_loop_run(main: Coroutine[Any, Any, None]) -> None:
    # uvloop where it is installed: about a millisecond less per proxied request.
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)
