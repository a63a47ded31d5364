"""What the gateway reads off the wire, as pure functions: routes, error shapes, token holds
and usage per format (OpenAI chat completions, OpenAI Responses, Anthropic Messages).

No sockets, no Redis, no clock: the gateway hands these bytes and parsed JSON, and they are
tested as tables. Nothing here changes what is forwarded, except :func:`ask_for_usage`
(chat streams are asked for their usage chunk) and :func:`is_unasked_usage_chunk` (that chunk
is then not shown to a client that did not ask for it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

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
BYTES_PER_TOKEN = 4


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


@dataclass
class Usage:
    """Tokens and tool calls of one response, as the upstream reported them."""

    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0
    tools: int = 0
    found: bool = False
    # Characters of text and tool arguments streamed so far: what the running hold is
    # measured against (:func:`streamed_tokens`).
    chars: int = 0
    # chat stream tool calls seen: (choice index, tool call index)
    _calls: set[tuple[int, int]] = field(default_factory=set, repr=False)

    @property
    def tokens(self) -> int:
        """What a token cap counts: input (cache reads and writes too) plus output."""
        return self.input + self.cache_read + self.cache_write + self.output


def _len(value: Any) -> int:
    return len(value) if isinstance(value, str) else 0


# A running stream's output is measured as characters / 3: above the real token count for
# text and code (about 4 characters a token), so the running hold stays ahead of it.
CHARS_PER_TOKEN = 3


def streamed_tokens(usage: Usage) -> int:
    """Output tokens a stream has sent so far, estimated from its text on the high side."""
    return usage.chars // CHARS_PER_TOKEN + 1


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _openai_usage(usage: Any, out: Usage, *, chat: bool) -> None:
    if not isinstance(usage, dict):
        return
    out.found = True
    details = usage.get("prompt_tokens_details" if chat else "input_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
    total_in = _int(usage.get("prompt_tokens" if chat else "input_tokens"))
    # OpenAI counts cached tokens inside the input total: keep them apart, never twice.
    out.input, out.cache_read = max(0, total_in - cached), min(cached, total_in)
    out.output = _int(usage.get("completion_tokens" if chat else "output_tokens"))


def _anthropic_usage(usage: Any, out: Usage) -> None:
    if not isinstance(usage, dict):
        return
    out.found = True
    # message_delta's usage is cumulative: later values replace earlier ones.
    if "input_tokens" in usage:
        out.input = _int(usage.get("input_tokens"))
    if "cache_read_input_tokens" in usage:
        out.cache_read = _int(usage.get("cache_read_input_tokens"))
    if "cache_creation_input_tokens" in usage:
        out.cache_write = _int(usage.get("cache_creation_input_tokens"))
    if "output_tokens" in usage:
        out.output = _int(usage.get("output_tokens"))


_RESPONSE_TOOL_ITEMS = frozenset({"function_call", "custom_tool_call"})


def _response_tools(output: Any) -> int:
    if not isinstance(output, list):
        return 0
    return sum(
        1 for item in output if isinstance(item, dict) and item.get("type") in _RESPONSE_TOOL_ITEMS
    )


def usage_of_body(route: Route, body: Any) -> Usage:
    """Usage and tool calls of a whole (non-streaming) JSON response."""
    out = Usage()
    if not isinstance(body, dict):
        return out
    if route == "chat":
        _openai_usage(body.get("usage"), out, chat=True)
        for choice in body.get("choices") or []:
            message = choice.get("message") if isinstance(choice, dict) else None
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            out.tools += len(calls) if isinstance(calls, list) else 0
    elif route == "responses":
        _openai_usage(body.get("usage"), out, chat=False)
        out.tools = _response_tools(body.get("output"))
    elif route == "messages":
        _anthropic_usage(body.get("usage"), out)
        content = body.get("content")
        if isinstance(content, list):
            out.tools = sum(
                1
                for block in content
                if isinstance(block, dict) and block.get("type") == "tool_use"
            )
    return out


def feed_event(route: Route, data: Any, out: Usage) -> None:
    """Add one streamed event's JSON ``data`` to ``out``."""
    if not isinstance(data, dict):
        return
    if route == "chat":
        if data.get("usage") is not None:
            _openai_usage(data.get("usage"), out, chat=True)
        for choice in data.get("choices") or []:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict):
                continue
            out.chars += _len(delta.get("content")) + _len(delta.get("reasoning_content"))
            calls = delta.get("tool_calls")
            for call in calls if isinstance(calls, list) else []:
                if isinstance(call, dict):
                    out._calls.add((_int(choice.get("index")), _int(call.get("index"))))
                    function = call.get("function")
                    if isinstance(function, dict):
                        out.chars += _len(function.get("arguments"))
        out.tools = len(out._calls)
    elif route == "responses":
        kind = data.get("type")
        if isinstance(kind, str) and kind.endswith(".delta"):
            out.chars += _len(data.get("delta"))
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            response = data.get("response")
            if isinstance(response, dict):
                _openai_usage(response.get("usage"), out, chat=False)
                out.tools = _response_tools(response.get("output"))
    elif route == "messages":
        kind = data.get("type")
        if kind == "message_start":
            message = data.get("message")
            if isinstance(message, dict):
                _anthropic_usage(message.get("usage"), out)
        elif kind == "message_delta":
            _anthropic_usage(data.get("usage"), out)
        elif kind == "content_block_delta":
            delta = data.get("delta")
            if isinstance(delta, dict):
                out.chars += sum(
                    _len(delta.get(key)) for key in ("text", "partial_json", "thinking")
                )
        elif kind == "content_block_start":
            block = data.get("content_block")
            if isinstance(block, dict) and block.get("type") == "tool_use":
                out.tools += 1


def event_data(event: bytes) -> Any:
    """The JSON of an SSE event's ``data:`` lines, or None (``[DONE]``, a comment, junk)."""
    lines = [line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    raw = b"\n".join(lines)
    if raw == b"[DONE]":
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


_LAST_TYPES = frozenset(
    {"message_stop", "response.completed", "response.incomplete", "response.failed"}
)


def is_last_event(event: bytes, data: Any) -> bool:
    """A stream's closing event (``[DONE]``, ``message_stop``, ``response.completed``…)."""
    if isinstance(data, dict):
        return data.get("type") in _LAST_TYPES
    return b"[DONE]" in event


def is_unasked_usage_chunk(data: Any) -> bool:
    """A chat stream's usage-only chunk (no choices): hidden from a client that did not ask."""
    return isinstance(data, dict) and data.get("usage") is not None and not data.get("choices")


def split_events(buffer: bytearray) -> list[bytes]:
    """Take the complete SSE events (each with its blank-line end) off the front of
    ``buffer``; what is left is an event still arriving."""
    events: list[bytes] = []
    start = 0
    while True:
        cut = _event_end(buffer, start)
        if cut < 0:
            break
        events.append(bytes(buffer[start:cut]))
        start = cut
    del buffer[:start]
    return events


def _event_end(buffer: bytearray, start: int) -> int:
    ends = [(buffer.find(sep, start), len(sep)) for sep in (b"\n\n", b"\r\n\r\n")]
    found = [(at, n) for at, n in ends if at >= 0]
    if not found:
        return -1
    at, n = min(found)
    return at + n


def estimate(body_bytes: int, response_bytes: int) -> Usage:
    """Usage guessed from sizes when the upstream reported none (ledger row ``estimated``)."""
    return Usage(
        input=body_bytes // BYTES_PER_TOKEN + 1, output=response_bytes // BYTES_PER_TOKEN + 1
    )
