"""One metered request, from forwarding it to settling what it cost."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from overnight.worker.gateway import wire
from overnight.worker.gateway.httpio import (
    LEDGER_ERRORS,
    Upstream,
    error_response,
    forward_headers,
    response_headers,
    short_reason,
)
from overnight.worker.gateway.meter import Hold, Holder, Refused

if TYPE_CHECKING:
    from overnight.worker.gateway.server import Gateway

log = logging.getLogger("overnight.gateway")

# After a client went away mid-stream: read on for its usage this long and this much.
DRAIN_SECONDS = 10.0
DRAIN_BYTES = 8 * 1024 * 1024
MAX_RESPONSE = 64 * 1024 * 1024


class Call:
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
        headers = forward_headers(self.request, self.upstream, self.fam)
        try:
            ctx = session.post(
                self.upstream.url(self.request.path_qs), data=self.body, headers=headers
            )
            async with ctx as resp:
                self.status = resp.status
                if resp.status >= 500:
                    text = (await resp.content.read(300)).decode("utf-8", "replace")
                    return error_response(
                        self.fam, 502, f"upstream answered HTTP {resp.status}: {text}"
                    )
                if resp.status >= 300:
                    data = await resp.read()
                    return web.Response(
                        status=resp.status, body=data, headers=response_headers(resp)
                    )
                self.answered = True
                if resp.content_type == "text/event-stream":
                    return await self._stream(resp)
                return await self._whole(resp)
        except TimeoutError:
            self.status = 504
            return error_response(
                self.fam,
                504,
                "upstream stalled past OVERNIGHT_MODEL_TIMEOUT "
                f"({self.gw.config.model_timeout:g}s)",
            )
        except aiohttp.ClientError as exc:
            self.status = 502
            return error_response(self.fam, 502, f"upstream unreachable: {short_reason(exc)}")

    async def _whole(self, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        data = await resp.content.read(MAX_RESPONSE)
        self.response_bytes = len(data)
        with contextlib.suppress(ValueError):
            self.usage = wire.usage_of_body(self.route, json.loads(data))
        self.complete = True
        return web.Response(status=resp.status, body=data, headers=response_headers(resp))

    async def _stream(self, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        out = web.StreamResponse(status=resp.status, headers=response_headers(resp))
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
            await self._tell(out, 502, f"upstream broke off: {short_reason(exc)}")
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
            status, message = 503, f"the gateway cannot reach its ledger: {short_reason(exc)}"
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
