"""What the gateway reads off the wire, as pure functions: routes, error shapes and token holds
per format (OpenAI chat completions, OpenAI Responses, Anthropic Messages); the usage a
response reports is read in :mod:`worker.gateway.usage`, whose names are exported here too.

No sockets, no Redis, no clock: the gateway hands these bytes and parsed JSON, and they are
tested as tables. Nothing here changes what is forwarded, except :func:`ask_for_usage`
(chat streams are asked for their usage chunk) and :func:`is_unasked_usage_chunk` (that chunk
is then not shown to a client that did not ask for it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from overnight.worker.gateway.usage import (
    BYTES_PER_TOKEN,
    CHARS_PER_TOKEN,
    Usage,
    estimate,
    event_data,
    feed_event,
    is_last_event,
    is_unasked_usage_chunk,
    split_events,
    streamed_tokens,
    usage_of_body,
)

Route = Literal["chat", "responses", "messages", "count_tokens", "models"]
Family = Literal["openai", "anthropic"]

ROUTES: dict[tuple[str, str], Route] = {
    ("POST", "/v1/chat/completions"): "chat",
    ("POST", "/v1/responses"): "responses",
    ("POST", "/v1/messages"): "messages",
    ("POST", "/v1/messages/count_tokens"): "count_tokens",
    ("GET", "/v1/models"): "models",
}
METERED: frozenset[Route] = frozenset({"chat", "responses", "messages"})
# A request body larger than this is refused (413) before anything is charged.
MAX_BODY = 32 * 1024 * 1024
# Output tokens held per request before it is forwarded when it streams, and added per chunk
# while the stream runs past what is held. A whole (non-streaming) answer arrives at once, so
# its request holds everything the upstream may bill for it.
HOLD_CHUNK = 8192


def family(route: Route | None, path: str) -> Family:
    """Which error shape a request gets: Anthropic's for /v1/messages*, else OpenAI's."""
    if route in ("messages", "count_tokens") or path.startswith("/v1/messages"):
        return "anthropic"
    return "openai"


_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "insufficient_quota",
    502: "api_error",
    504: "api_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    502: "api_error",
    504: "timeout_error",
}


def error_body(fam: Family, status: int, message: str) -> bytes:
    """The wire format's own error body for ``status`` with a one-line ``message``."""
    line = " ".join(message.split())
    if fam == "anthropic":
        kind = _ANTHROPIC_TYPES.get(status, "api_error")
        return json.dumps({"type": "error", "error": {"type": kind, "message": line}}).encode()
    kind = _OPENAI_TYPES.get(status, "api_error")
    code = "overnight_" + kind
    return json.dumps(
        {"error": {"message": line, "type": kind, "param": None, "code": code}}
    ).encode()


def stream_error_event(route: Route, status: int, message: str) -> bytes:
    """The format's error event, for a refusal or failure after a stream has begun."""
    line = " ".join(message.split())
    if route == "messages":
        body = json.loads(error_body("anthropic", status, line))
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    if route == "responses":
        kind = _OPENAI_TYPES.get(status, "api_error")
        body = {"type": "error", "code": kind, "message": line, "param": None}
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    return b"data: " + error_body("openai", status, line) + b"\n\n"


# A request may ask for at most this many choices (``n``, ``best_of``): each is billed.
MAX_CHOICES = 8

_OUTPUT_FIELDS: dict[Route, tuple[str, ...]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "responses": ("max_output_tokens",),
    "messages": ("max_tokens",),
}
# The field a default output cap is written into, per format (chat: the one every
# OpenAI-compatible server knows; a server that refuses it answers 400, which is not charged).
_CAP_FIELD: dict[Route, str] = {
    "chat": "max_tokens",
    "responses": "max_output_tokens",
    "messages": "max_tokens",
}


@dataclass(frozen=True)
class Ask:
    """What a request asks for: its model, whether it streams, its output cap per choice
    and how many choices are billed (``n``, ``best_of``)."""

    model: str
    stream: bool
    max_output: int | None
    # chat only: the client asked for the usage chunk itself (stream_options.include_usage)
    wants_usage: bool = False
    choices: int = 1

    @property
    def worst_output(self) -> int | None:
        """The most output tokens the upstream can bill for the request (None: unbounded)."""
        return None if self.max_output is None else self.max_output * self.choices


def _count(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a whole number of at least 1, not {str(value)[:40]!r}")
    return value


def read_ask(route: Route, body: Any) -> Ask:
    """The facts of a metered request body; ``ValueError`` (one line) if it is not usable:
    no model, or an output cap or choice count that is not a whole number >= 1, or more
    than :data:`MAX_CHOICES` choices."""
    if not isinstance(body, dict):
        raise ValueError("the request body is not a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError("the request names no model")
    stream = body.get("stream") is True
    caps = [c for c in (_count(body, name) for name in _OUTPUT_FIELDS.get(route, ())) if c]
    choices = max([1] + [c for c in (_count(body, "n"), _count(body, "best_of")) if c])
    if choices > MAX_CHOICES:
        raise ValueError(
            f"{choices} choices (n, best_of) is above the gateway's limit of {MAX_CHOICES}"
        )
    options = body.get("stream_options")
    wants = isinstance(options, dict) and options.get("include_usage") is True
    return Ask(model, stream, max(caps) if caps else None, wants, choices)


def bound_output(
    route: Route, body: dict[str, Any], ask: Ask, default_cap: int
) -> tuple[dict[str, Any], Ask] | None:
    """A whole (non-streaming) request that names no output cap, given ``default_cap`` (the
    body to forward and its ask), or None if it needs no change. ``ValueError`` when it
    needs one and ``default_cap`` is 0: its worst case cannot be bounded."""
    if ask.stream or ask.max_output is not None or route not in _CAP_FIELD:
        return None
    if default_cap <= 0:
        names = " or ".join(_OUTPUT_FIELDS[route])
        raise ValueError(
            f"a request that does not stream must name {names}: "
            "without it the gateway cannot hold what it may cost"
        )
    capped = {**body, _CAP_FIELD[route]: default_cap}
    return capped, Ask(ask.model, ask.stream, default_cap, ask.wants_usage, ask.choices)


def hold_for(body_bytes: int, ask: Ask) -> int:
    """Tokens held before forwarding: the input estimated from the body's size, plus the
    output: all of ``worst_output`` for a whole answer, at most :data:`HOLD_CHUNK` for a
    stream (which takes more in chunks as it runs). ``ValueError`` for a whole answer with
    no bound (see :func:`bound_output`)."""
    worst = ask.worst_output
    if ask.stream:
        output = min(worst or HOLD_CHUNK, HOLD_CHUNK)
    elif worst is None:
        raise ValueError("a request that does not stream must name its output cap")
    else:
        output = worst
    return body_bytes // BYTES_PER_TOKEN + output + 1


def ask_for_usage(route: Route, body: dict[str, Any], ask: Ask) -> dict[str, Any] | None:
    """A chat stream's body with ``stream_options.include_usage`` set, or None if it needs
    no change (not a chat stream, or the client asked already)."""
    if route != "chat" or not ask.stream or ask.wants_usage:
        return None
    options = body.get("stream_options")
    merged = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return {**body, "stream_options": merged}


__all__ = [
    "BYTES_PER_TOKEN",
    "CHARS_PER_TOKEN",
    "HOLD_CHUNK",
    "MAX_BODY",
    "MAX_CHOICES",
    "METERED",
    "ROUTES",
    "Ask",
    "Family",
    "Route",
    "Usage",
    "ask_for_usage",
    "bound_output",
    "error_body",
    "estimate",
    "event_data",
    "family",
    "feed_event",
    "hold_for",
    "is_last_event",
    "is_unasked_usage_chunk",
    "read_ask",
    "split_events",
    "stream_error_event",
    "streamed_tokens",
    "usage_of_body",
]
