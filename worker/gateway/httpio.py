"""The proxy's HTTP edges: which headers pass each way, the upstreams, the step's token, and
the error response in the request's wire format."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from aiohttp import web
from redis.exceptions import RedisError

from overnight.worker.gateway import wire

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


def token_of(request: web.Request) -> str | None:
    """The step's per-lease token, from ``Authorization: Bearer`` or ``x-api-key``."""
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("x-api-key", "").strip() or None


async def read_body(request: web.Request, limit: int) -> bytes | None:
    """The request's body, or None if it is over ``limit`` bytes."""
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


def forward_headers(request: web.Request, upstream: Upstream, fam: wire.Family) -> dict[str, str]:
    """The request\'s headers as the upstream gets them: the step\'s token out, its key in."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in DROP_REQUEST}
    headers["Accept-Encoding"] = "identity"
    if upstream.key:
        if fam == "anthropic":
            headers["x-api-key"] = upstream.key
        else:
            headers["Authorization"] = f"Bearer {upstream.key}"
    return headers


def response_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    """The upstream's response headers as the step gets them."""
    return {k: v for k, v in resp.headers.items() if k.lower() not in DROP_RESPONSE}


def error_response(
    fam: wire.Family, status: int, message: str, retry: bool | None = None
) -> web.Response:
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


def short_reason(exc: BaseException) -> str:
    """An exception as one short line."""
    return " ".join(str(exc).split())[:200] or type(exc).__name__
