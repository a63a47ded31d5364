"""Usage per wire format, read as the response passes: whole bodies, stream events, and an
estimate from sizes when the upstream reported none. Pure: no sockets, no Redis, no clock."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from overnight.worker.gateway.wire import Route

# Request and response bytes per token when a size is all there is to go by.
BYTES_PER_TOKEN = 4


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
