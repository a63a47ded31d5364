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
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from redis.exceptions import RedisError

from overnight.worker.gateway import wire
from overnight.worker.gateway.meter import Hold, Holder, Meter, Refused

if TYPE_CHECKING:
    import redis.asyncio as aioredis

log = logging.getLogger("overnight.gateway")

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# The step's credential never reaches the upstream; the upstream's key is added instead.
# Responses come back uncompressed so their usage can be read on the side.
DROP_REQUEST = HOP_BY_HOP | {"authorization", "x-api-key", "accept-encoding"}
DROP_RESPONSE = HOP_BY_HOP | {"content-encoding"}
# After a client went away mid-stream: read on for its usage this long and this much.
DRAIN_SECONDS = 10.0
DRAIN_BYTES = 8 * 1024 * 1024
MAX_RESPONSE = 64 * 1024 * 1024
# What a ledger (Redis) call may fail with: the request is refused, never forwarded unmetered.
LEDGER_ERRORS = (RedisError, OSError)


@dataclass(frozen=True)
class Upstream:
    """One upstream: its base URL (without ``/v1``) and key."""

    base: str | None
    key: str | None

    def url(self, path_qs: str) -> str:
        assert self.base is not None
        return self.base + path_qs


def upstream_base(url: str | None) -> str | None:
    """The root an upstream URL names: ``…/v1`` and ``…/v1/chat/completions`` are cut."""
    if not url:
        return None
    url = url.rstrip("/")
    for tail in ("/chat/completions", "/v1"):
        url = url.removesuffix(tail)
    return url.rstrip("/")


@dataclass
class Config:
    """What a gateway needs besides Redis."""

    openai: Upstream
    anthropic: Upstream
    model_timeout: float = 60.0
    max_body: int = wire.MAX_BODY
    # The output cap a whole (non-streaming) request that names none is given; 0: refused.
    default_output: int = wire.HOLD_CHUNK


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
            return _error(fam, 404, f"no such route: {request.method} {path}")
        token = _token(request)
        if not token:
            return _error(fam, 401, "no API key: use the token overnight gave this step")
        try:
            who = await self.meter.holder(token)
        except LEDGER_ERRORS as exc:  # Redis away: fail closed
            log.warning("gateway: token lookup failed: %s", exc)
            return _error(fam, 503, "the gateway cannot reach its ledger; refused")
        if who is None:
            return _error(fam, 401, "unknown or ended token: its lease is not running")
        upstream = self.config.anthropic if fam == "anthropic" else self.config.openai
        if upstream.base is None:
            which = "OVERNIGHT_ANTHROPIC_URL" if fam == "anthropic" else "OVERNIGHT_MODEL_URL"
            return _error(fam, 502, f"no upstream configured ({which} is not set)", retry=False)
        body = await _read_body(request, self.config.max_body)
        if body is None:
            return _error(fam, 413, f"request body over {self.config.max_body} bytes")
        if route not in wire.METERED:
            if not await self.meter.alive(token):
                return _error(fam, 401, "unknown or ended token: its lease is not running")
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
                headers=_forward_headers(request, upstream, fam),
                data=body or None,
            ) as resp:
                data = await resp.read()
                return web.Response(status=resp.status, body=data, headers=_response_headers(resp))
        except (TimeoutError, aiohttp.ClientError) as exc:
            return _error(fam, 502, f"upstream unreachable: {_reason(exc)}")

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
            return _error(fam, 400, f"malformed request: {str(exc).splitlines()[0]}")
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
            return _error(fam, exc.status, exc.detail)
        except LEDGER_ERRORS as exc:
            log.warning("gateway: lease=%s: reserve failed: %s", who.lease_id, exc)
            return _error(fam, 503, "the gateway cannot reach its ledger; refused")
        call = _Call(self, request, route, upstream, body, who, ask, hold)
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


class _Call:
    """One metered request from forward to settle."""

    def __init__(
        self,
        gw: Gateway,
        request: web.Request,
        route: wire.Route,
        upstream: Upstream,
        body: bytes,
        who: Holder,
        ask: wire.Ask,
        hold: Hold,
    ) -> None:
        self.gw, self.request, self.route, self.upstream = gw, request, route, upstream
        self.body, self.who, self.ask, self.hold = body, who, ask, hold
        self.fam = wire.family(route, request.path)
        self.usage = wire.Usage()
        self.started = time.monotonic()
        self.status = 0
        self.answered = False  # the upstream answered 2xx: the request counts
        self.complete = False  # the response was read to its end
        self.disconnected = False
        self.response_bytes = 0
        self.settled = False
        self.cut = False  # a stream cut short because its next chunk of tokens was refused

    async def run(self) -> web.StreamResponse:
        session = self.gw.session
        assert session is not None
        headers = _forward_headers(self.request, self.upstream, self.fam)
        try:
            ctx = session.post(
                self.upstream.url(self.request.path_qs), data=self.body, headers=headers
            )
            async with ctx as resp:
                self.status = resp.status
                if resp.status >= 500:
                    text = (await resp.content.read(300)).decode("utf-8", "replace")
                    return _error(self.fam, 502, f"upstream answered HTTP {resp.status}: {text}")
                if resp.status >= 300:
                    data = await resp.read()
                    return web.Response(
                        status=resp.status, body=data, headers=_response_headers(resp)
                    )
                self.answered = True
                if resp.content_type == "text/event-stream":
                    return await self._stream(resp)
                return await self._whole(resp)
        except TimeoutError:
            self.status = 504
            return _error(
                self.fam,
                504,
                "upstream stalled past OVERNIGHT_MODEL_TIMEOUT "
                f"({self.gw.config.model_timeout:g}s)",
            )
        except aiohttp.ClientError as exc:
            self.status = 502
            return _error(self.fam, 502, f"upstream unreachable: {_reason(exc)}")

    async def _whole(self, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        data = await resp.content.read(MAX_RESPONSE)
        self.response_bytes = len(data)
        with contextlib.suppress(ValueError):
            self.usage = wire.usage_of_body(self.route, json.loads(data))
        self.complete = True
        return web.Response(status=resp.status, body=data, headers=_response_headers(resp))

    async def _stream(self, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        out = web.StreamResponse(status=resp.status, headers=_response_headers(resp))
        hide_usage = self.route == "chat" and not self.ask.wants_usage
        buffer, last = bytearray(), bytearray()
        try:
            await out.prepare(self.request)
        except (ConnectionError, RuntimeError):
            self.disconnected = True
        drain_until = time.monotonic() + DRAIN_SECONDS
        try:
            async for chunk in resp.content.iter_any():
                self.response_bytes += len(chunk)
                buffer += chunk
                send = bytearray()
                for event in wire.split_events(buffer):
                    data = wire.event_data(event)
                    if data is not None:
                        wire.feed_event(self.route, data, self.usage)
                    if hide_usage and wire.is_unasked_usage_chunk(data):
                        continue
                    if wire.is_last_event(event, data):
                        last += event  # sent once settled: a client that saw the end sees it
                    else:
                        send += event
                if not self.disconnected and await self._outgrown(out, send):
                    return out
                if self.disconnected:
                    if time.monotonic() > drain_until or self.response_bytes > DRAIN_BYTES:
                        return out
                    continue
                if send:
                    try:
                        await out.write(bytes(send))
                    except (ConnectionError, RuntimeError):
                        self.disconnected = True
                        drain_until = time.monotonic() + DRAIN_SECONDS
            self.complete = True
            await self.settle()
            if (last or buffer) and not self.disconnected:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await out.write(bytes(last + buffer))
        except TimeoutError:
            self.status = 504
            await self._tell(out, 504, "upstream stalled past OVERNIGHT_MODEL_TIMEOUT")
        except aiohttp.ClientError as exc:
            await self._tell(out, 502, f"upstream broke off: {_reason(exc)}")
        if not self.disconnected:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await out.write_eof()
        return out

    async def _outgrown(self, out: web.StreamResponse, send: bytearray) -> bool:
        """Hold another chunk if the stream's output is about to pass its hold; if that is
        refused, send what came, then the format's error event: True when the stream is cut."""
        held_output = self.hold.tokens - len(self.body) // wire.BYTES_PER_TOKEN - 1
        worst = self.ask.worst_output
        if worst is not None and held_output >= worst:
            return False  # the model cannot write more than was asked, and that is held
        if wire.streamed_tokens(self.usage) < held_output:
            return False
        try:
            self.hold = await self.gw.meter.extend(self.who, self.hold, wire.HOLD_CHUNK, self.route)
            return False
        except Refused as exc:
            status, message = 429, exc.detail
        except LEDGER_ERRORS as exc:  # the ledger is away: fail closed
            status, message = 503, f"the gateway cannot reach its ledger: {_reason(exc)}"
        log.info(
            "gateway: lease=%s task=%s: stream cut: %s",
            self.who.lease_id,
            self.who.task_id,
            message,
        )
        self.cut = True
        with contextlib.suppress(ConnectionError, RuntimeError):
            if send:
                await out.write(bytes(send))
                send.clear()
            await out.write(wire.stream_error_event(self.route, status, message))
            await out.write_eof()
        return True

    async def _tell(self, out: web.StreamResponse, status: int, message: str) -> None:
        if self.disconnected:
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            await out.write(wire.stream_error_event(self.route, status, message))

    async def settle(self) -> None:
        """Commit what was spent: the reported usage; an estimate if none was reported; the
        whole hold if the stream was cut before its usage came (never zero)."""
        if self.settled:
            return
        self.settled = True
        usage, estimated = self.usage, False
        refund = not self.answered
        if refund:
            tokens = 0
        elif usage.found and (self.complete or usage.output > 0 or not self.disconnected):
            tokens = usage.tokens
        elif self.cut or (self.disconnected and not self.complete):
            tokens, estimated = self.hold.tokens, True
        else:
            usage = wire.estimate(len(self.body), self.response_bytes)
            usage.tools = self.usage.tools
            tokens, estimated = usage.tokens, True
        data = {
            "route": self.route,
            "model": self.ask.model,
            "stream": self.ask.stream,
            "status": self.status,
            "input_tokens": usage.input,
            "output_tokens": usage.output,
            "cache_read_tokens": usage.cache_read,
            "cache_write_tokens": usage.cache_write,
            "tokens": tokens,
            "tool_calls": usage.tools,
            "model_units": 0 if refund else 1,
            "prepaid": self.hold.prepaid,
            "hold": self.hold.tokens,
            "duration_ms": round((time.monotonic() - self.started) * 1000, 1),
            "disconnected": self.disconnected,
            "estimated": estimated,
            "cut": self.cut,
            "refunded": refund,
        }
        try:
            await self.gw.meter.commit(
                self.who,
                self.hold,
                tokens=tokens,
                tools=0 if refund else usage.tools,
                refund=refund,
                data=data,
            )
        except LEDGER_ERRORS as exc:  # the hold expires back to the envelope on its own
            log.error(
                "gateway: lease=%s task=%s: commit failed: %s",
                self.who.lease_id,
                self.who.task_id,
                exc,
            )


def _token(request: web.Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("x-api-key", "").strip() or None


async def _read_body(request: web.Request, limit: int) -> bytes | None:
    if request.content_length is not None and request.content_length > limit:
        return None
    parts: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


def _forward_headers(request: web.Request, upstream: Upstream, fam: wire.Family) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in DROP_REQUEST}
    headers["Accept-Encoding"] = "identity"
    if upstream.key:
        if fam == "anthropic":
            headers["x-api-key"] = upstream.key
        else:
            headers["Authorization"] = f"Bearer {upstream.key}"
    return headers


def _response_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in DROP_RESPONSE}


def _error(fam: wire.Family, status: int, message: str, retry: bool | None = None) -> web.Response:
    """The format's error; ``x-should-retry`` (which both official SDKs, and the CLIs built
    on them, obey) says whether asking again can help: by default only for a 5xx (refunded,
    so a retry costs nothing), never for a refusal, a bad request or a bad token."""
    again = status >= 500 if retry is None else retry
    return web.Response(
        status=status,
        body=wire.error_body(fam, status, message),
        content_type="application/json",
        headers={"x-should-retry": "true" if again else "false"},
    )


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


async def serve(
    client: aioredis.Redis,
    namespace: str,
    host_id: str,
    config: Config,
    *,
    host: str,
    port: int,
    ready: Callable[[str], Awaitable[None] | None] | None = None,
) -> None:
    """Serve until cancelled (SIGTERM/SIGINT in the CLI)."""
    gateway = Gateway(Meter(client, namespace, host_id), config)
    runner = web.AppRunner(
        gateway.app(), access_log=None, handle_signals=False, shutdown_timeout=2.0
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
    await site.start()
    try:
        bound = runner.addresses[0][1] if runner.addresses else port
        if ready is not None:
            result = ready(f"http://{host}:{bound}")
            if result is not None:
                await result
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def config_from(settings: Any) -> Config:
    """The gateway's upstreams and limits from :class:`config.settings.Settings`."""

    def secret(value: Any) -> str | None:
        return value.get_secret_value() if value is not None else None

    return Config(
        openai=Upstream(upstream_base(settings.model_url), secret(settings.model_api_key)),
        anthropic=Upstream(
            upstream_base(settings.anthropic_url), secret(settings.anthropic_api_key)
        ),
        model_timeout=settings.model_timeout,
        default_output=settings.gateway_max_output,
    )
