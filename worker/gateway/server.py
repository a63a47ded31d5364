"""``overnight gateway``: the metering HTTP proxy every agent's model calls go through.

A pass-through: request and response bytes and headers are forwarded unchanged (the
upstream's key replaces the step's per-lease token; chat streams are asked for their usage
chunk). Each metered request is reserved before it is forwarded (one model unit and a
token hold, :mod:`worker.gateway.meter`) and committed after from the usage the response
reports (:mod:`worker.gateway.wire`), with a ``model_call`` receipt. While it is in flight
the lease is shown as making progress. Bad input and faults get the wire format's own error
shape and release what was held; the gateway keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from overnight.config import defaults
from overnight.worker.gateway import wire
from overnight.worker.gateway.call import Call
from overnight.worker.gateway.httpio import (
    LEDGER_ERRORS,
    Upstream,
    error_response,
    forward_headers,
    read_body,
    response_headers,
    short_reason,
    token_of,
    upstream_base,
)
from overnight.worker.gateway.meter import Holder, Meter, Refused

if TYPE_CHECKING:
    import redis.asyncio as aioredis

log = logging.getLogger("overnight.gateway")


@dataclass
class Config:
    """What a gateway needs besides Redis."""

    openai: Upstream
    anthropic: Upstream
    model_timeout: float = defaults.MODEL_TIMEOUT
    max_body: int = wire.MAX_BODY
    # The output cap a whole (non-streaming) request that names none is given; 0: refused.
    default_output: int = wire.HOLD_CHUNK
    # Replicas that must acknowledge a request's hold before it goes upstream (WAIT).
    wait_replicas: int = 0
    wait_timeout: float = 1.0


class Gateway:
    """The aiohttp application and its per-request work."""

    def __init__(self, meter: Meter, config: Config) -> None:
        self.meter = meter
        self.config = config
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        """The application (routes are matched by hand so every miss gets a format's error)."""
        app = web.Application(client_max_size=self.config.max_body + 1)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=10.0, sock_read=self.config.model_timeout
        )
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(
            timeout=timeout, connector=connector, auto_decompress=False
        )

    async def _stop(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    # --- dispatch ----------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if request.headers.get("upgrade", "").lower() == "websocket":
            return web.Response(
                status=426,
                text="overnight gateway: WebSocket is not supported; use HTTP (SSE) streaming\n",
            )
        if request.method == "HEAD" and path == "/":
            return web.Response(status=200)
        route = wire.ROUTES.get((request.method, path))
        fam = wire.family(route, path)
        if route is None:
            return error_response(fam, 404, f"no such route: {request.method} {path}")
        token = token_of(request)
        if not token:
            return error_response(fam, 401, "no API key: use the token overnight gave this step")
        try:
            who = await self.meter.holder(token)
        except LEDGER_ERRORS as exc:  # Redis away: fail closed
            log.warning("gateway: token lookup failed: %s", exc)
            return error_response(fam, 503, "the gateway cannot reach its ledger; refused")
        if who is None:
            return error_response(fam, 401, "unknown or ended token: its lease is not running")
        upstream = self.config.anthropic if fam == "anthropic" else self.config.openai
        if upstream.base is None:
            which = "OVERNIGHT_ANTHROPIC_URL" if fam == "anthropic" else "OVERNIGHT_MODEL_URL"
            return error_response(
                fam, 502, f"no upstream configured ({which} is not set)", retry=False
            )
        body = await read_body(request, self.config.max_body)
        if body is None:
            return error_response(fam, 413, f"request body over {self.config.max_body} bytes")
        if route not in wire.METERED:
            if not await self.meter.alive(token):
                return error_response(fam, 401, "unknown or ended token: its lease is not running")
            return await self._plain(request, upstream, body, fam)
        return await self._metered(request, route, upstream, body, who)

    async def _plain(
        self, request: web.Request, upstream: Upstream, body: bytes, fam: wire.Family
    ) -> web.StreamResponse:
        assert self.session is not None
        try:
            async with self.session.request(
                request.method,
                upstream.url(request.path_qs),
                headers=forward_headers(request, upstream, fam),
                data=body or None,
            ) as resp:
                data = await resp.read()
                return web.Response(status=resp.status, body=data, headers=response_headers(resp))
        except (TimeoutError, aiohttp.ClientError) as exc:
            return error_response(fam, 502, f"upstream unreachable: {short_reason(exc)}")

    # --- a metered request ---------------------------------------------------------------
    async def _metered(
        self,
        request: web.Request,
        route: wire.Route,
        upstream: Upstream,
        body: bytes,
        who: Holder,
    ) -> web.StreamResponse:
        fam = wire.family(route, request.path)
        try:
            parsed = json.loads(body)
            ask = wire.read_ask(route, parsed)
            forward = wire.ask_for_usage(route, parsed, ask) or parsed
            bounded = wire.bound_output(route, forward, ask, self.config.default_output)
            if bounded is not None:
                forward, ask = bounded
            if forward is not parsed:
                body = json.dumps(forward).encode()
            tokens = wire.hold_for(len(body), ask)
        except ValueError as exc:
            log.info(
                "gateway: lease=%s task=%s: refused a bad request: %s",
                who.lease_id,
                who.task_id,
                exc,
            )
            return error_response(fam, 400, f"malformed request: {str(exc).splitlines()[0]}")
        try:
            hold = await self.meter.reserve(who, tokens, route)
        except Refused as exc:
            log.info(
                "gateway: lease=%s task=%s: refused (%s): %s",
                who.lease_id,
                who.task_id,
                exc.reason,
                exc.detail,
            )
            return error_response(fam, exc.status, exc.detail)
        except LEDGER_ERRORS as exc:
            log.warning("gateway: lease=%s: reserve failed: %s", who.lease_id, exc)
            return error_response(fam, 503, "the gateway cannot reach its ledger; refused")
        call = Call(self, request, route, upstream, body, who, ask, hold)
        done = asyncio.Event()
        beats = asyncio.create_task(self._beat(who, done))
        try:
            return await call.run()
        finally:
            # Not cancel(): a cancellation can be swallowed inside a Redis call.
            done.set()
            await call.settle()
            await beats

    async def _beat(self, who: Holder, done: asyncio.Event) -> None:
        # The reserve and the commit record progress themselves: beat only while the
        # model takes longer than a third of the gap.
        every = max(0.05, min(who.gap / 3, 5.0))
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), every)
            if done.is_set():
                return
            try:
                await self.meter.progress(who)
            except LEDGER_ERRORS as exc:
                log.warning("gateway: lease=%s: progress not recorded: %s", who.lease_id, exc)


# While another process holds the TCP port, the gateway serves its Unix socket alone and
# tries the port again this often.
RETRY_TCP = 1.0


async def serve(
    client: aioredis.Redis,
    namespace: str,
    host_id: str,
    config: Config,
    *,
    host: str,
    port: int,
    ready: Callable[[str], Awaitable[None] | None] | None = None,
    socket_path: Path | None = None,
) -> None:
    """Serve until cancelled (SIGTERM/SIGINT in the CLI): on ``socket_path`` (made 0666 in
    a folder only this user writes, see :func:`config.runtime.gateway_socket`) and on
    ``host:port`` for clients that cannot speak to a Unix socket. With a socket, a TCP port
    another process holds is logged and taken when it frees up; without one it is fatal."""
    meter = Meter(
        client,
        namespace,
        host_id,
        replicas=config.wait_replicas,
        wait_ms=max(1, int(config.wait_timeout * 1000)),
    )
    gateway = Gateway(meter, config)
    runner = web.AppRunner(
        gateway.app(), access_log=None, handle_signals=False, shutdown_timeout=2.0
    )
    retry: asyncio.Task[None] | None = None
    held = _hold(socket_path) if socket_path is not None else None
    ours: Path | None = None  # the socket this gateway made, removed when it stops
    try:
        await runner.setup()
        # The port first: once the socket answers (what a worker waits for), the port is
        # served too, unless another process holds it.
        taken = await _tcp_site(runner, host, port)
        if taken is not None and socket_path is None:
            raise taken
        if socket_path is not None:
            await _unix_site(runner, socket_path)
            ours = socket_path
        if taken is not None:
            log.warning(
                "gateway: %s:%d is held by another process (%s): serving %s only until it "
                "is free; steps are not sent a token for that port meanwhile",
                host,
                port,
                taken.strerror or taken,
                socket_path,
            )
            retry = asyncio.create_task(_take_port(runner, host, port))
        bound = port
        for address in runner.addresses:
            if isinstance(address, tuple):
                bound = address[1]
        if ready is not None:
            where = f"http://{host}:{bound}"
            result = ready(where if socket_path is None else f"{where} and unix:{socket_path}")
            if result is not None:
                await result
        await asyncio.Event().wait()
    finally:
        if retry is not None:
            retry.cancel()
        await runner.cleanup()
        if ours is not None:
            with contextlib.suppress(OSError):
                os.unlink(ours)
        if held is not None:
            os.close(held)


def _hold(socket_path: Path) -> int:
    """Lock this namespace's gateway on this host for as long as the descriptor returned
    is open: two gateways started at once (two workers of one host) would otherwise each
    take one of port and socket, and the one that lost the other would leave the port."""
    path = socket_path.with_suffix(".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(
            98, f"another gateway of this namespace runs here (it holds {path})"
        ) from None
    return fd


async def _unix_site(runner: web.AppRunner, path: Path) -> None:
    """Listen on ``path``: a socket left there by a gateway that died is replaced; one that
    still answers is another gateway's (``OSError``)."""
    import socket as socket_lib

    if os.path.lexists(path):
        probe = socket_lib.socket(socket_lib.AF_UNIX, socket_lib.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            os.unlink(path)  # nobody answers: a dead gateway's
        else:
            raise OSError(98, f"another gateway answers on {path}")
        finally:
            probe.close()
    site = web.UnixSite(runner, str(path), backlog=1024)
    await site.start()
    # Steps of other uids connect; only overnight's user can write the folder it is in.
    os.chmod(path, 0o666)


async def _tcp_site(runner: web.AppRunner, host: str, port: int) -> OSError | None:
    """Listen on ``host:port`` too; the error if that port cannot be had now."""
    site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
    try:
        await site.start()
    except OSError as exc:
        await site.stop()  # unregistered from the runner, so a later try starts afresh
        return exc
    return None


async def _take_port(runner: web.AppRunner, host: str, port: int) -> None:
    while await asyncio.sleep(RETRY_TCP, result=True):
        if await _tcp_site(runner, host, port) is None:
            log.warning("gateway: %s:%d is free again and served", host, port)
            return


def config_from(settings: Any) -> Config:
    """The gateway's upstreams and limits from :class:`config.settings.Settings`."""
    from overnight.config.connection import wait_replicas

    def secret(value: Any) -> str | None:
        return value.get_secret_value() if value is not None else None

    return Config(
        openai=Upstream(upstream_base(settings.model_url), secret(settings.model_api_key)),
        anthropic=Upstream(
            upstream_base(settings.anthropic_url), secret(settings.anthropic_api_key)
        ),
        model_timeout=settings.model_timeout,
        default_output=settings.gateway_max_output,
        wait_replicas=wait_replicas(settings),
        wait_timeout=settings.redis_wait_timeout,
    )


__all__ = ["Config", "Gateway", "Upstream", "config_from", "serve", "upstream_base", "wire"]
