"""The gateway's wire rules as tables: no sockets, no Redis."""

from __future__ import annotations

import json
from typing import Any

import pytest

from overnight.worker.gateway.server import upstream_base, wire


@pytest.mark.parametrize(
    ("route", "body", "want"),
    [
        (
            "chat",
            {
                "usage": {
                    "prompt_tokens": 10,
                    "completion_tokens": 4,
                    "prompt_tokens_details": {"cached_tokens": 6},
                },
                "choices": [{"message": {"tool_calls": [{}, {}]}}],
            },
            (4, 4, 6, 0, 2, True),
        ),
        ("chat", {"choices": [{"message": {"content": "x"}}]}, (0, 0, 0, 0, 0, False)),
        (
            "responses",
            {
                "usage": {"input_tokens": 9, "output_tokens": 3},
                "output": [
                    {"type": "message"},
                    {"type": "function_call"},
                    {"type": "custom_tool_call"},
                ],
            },
            (9, 3, 0, 0, 2, True),
        ),
        (
            "messages",
            {
                "usage": {
                    "input_tokens": 5,
                    "output_tokens": 2,
                    "cache_read_input_tokens": 7,
                    "cache_creation_input_tokens": 1,
                },
                "content": [{"type": "text"}, {"type": "tool_use"}],
            },
            (5, 2, 7, 1, 1, True),
        ),
        ("messages", ["not", "an", "object"], (0, 0, 0, 0, 0, False)),
    ],
)
def test_usage_of_a_whole_body(route: wire.Route, body: Any, want: tuple[Any, ...]) -> None:
    u = wire.usage_of_body(route, body)
    assert (u.input, u.output, u.cache_read, u.cache_write, u.tools, u.found) == want


def _events(route: wire.Route, events: list[Any]) -> wire.Usage:
    out = wire.Usage()
    for data in events:
        wire.feed_event(route, data, out)
    return out


def test_usage_of_streams() -> None:
    chat = _events(
        "chat",
        [
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "a"}]}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "b"}]}}]},
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
        ],
    )
    assert (chat.input, chat.output, chat.tools, chat.found) == (3, 2, 2, True)
    responses = _events(
        "responses",
        [
            {"type": "response.created", "response": {}},
            {
                "type": "response.incomplete",
                "response": {
                    "usage": {"input_tokens": 4, "output_tokens": 1},
                    "output": [{"type": "function_call"}],
                },
            },
        ],
    )
    assert (responses.input, responses.output, responses.tools) == (4, 1, 1)
    messages = _events(
        "messages",
        [
            {
                "type": "message_start",
                "message": {
                    "usage": {"input_tokens": 8, "output_tokens": 1, "cache_read_input_tokens": 2}
                },
            },
            {"type": "content_block_start", "content_block": {"type": "tool_use"}},
            {"type": "message_delta", "usage": {"output_tokens": 5}},
            {"type": "message_delta", "usage": {"output_tokens": 9}},  # cumulative: the last wins
        ],
    )
    assert (messages.input, messages.output, messages.cache_read, messages.tools) == (8, 9, 2, 1)
    assert messages.tokens == 8 + 9 + 2


def test_split_events_keeps_a_partial_event() -> None:
    buffer = bytearray(b"data: 1\n\nevent: x\ndata: 2\r\n\r\ndata: 3")
    assert wire.split_events(buffer) == [b"data: 1\n\n", b"event: x\ndata: 2\r\n\r\n"]
    assert bytes(buffer) == b"data: 3"
    assert wire.event_data(b"data: [DONE]\n\n") is None
    assert wire.event_data(b'event: e\ndata: {"a": 1}\n\n') == {"a": 1}
    assert wire.is_last_event(b"data: [DONE]\n\n", None)
    assert wire.is_last_event(b"", {"type": "message_stop"})
    assert not wire.is_last_event(b"", {"type": "message_delta"})


@pytest.mark.parametrize(
    ("route", "body", "want"),
    [
        ("chat", {"model": "m", "stream": True, "max_tokens": 5}, ("m", True, 5, False)),
        (
            "chat",
            {
                "model": "m",
                "max_completion_tokens": 7,
                "max_tokens": 5,
                "stream_options": {"include_usage": True},
            },
            ("m", False, 7, True),
        ),
        ("responses", {"model": "m", "max_output_tokens": 64000}, ("m", False, 64000, False)),
        ("messages", {"model": "m", "max_tokens": None}, ("m", False, None, False)),
    ],
)
def test_read_ask(route: wire.Route, body: dict[str, Any], want: tuple[Any, ...]) -> None:
    ask = wire.read_ask(route, body)
    assert (ask.model, ask.stream, ask.max_output, ask.wants_usage) == want


@pytest.mark.parametrize(
    ("route", "extra", "want"),
    [
        # (output cap per choice, choices billed, worst output)
        ("chat", {"max_tokens": 8000, "n": 8}, (8000, 8, 64000)),
        ("chat", {"max_tokens": 10, "best_of": 3, "n": 2}, (10, 3, 30)),
        ("chat", {"max_completion_tokens": 5, "max_tokens": 9}, (9, 1, 9)),
        ("chat", {"n": 4}, (None, 4, None)),
        ("chat", {"max_output_tokens": 99}, (None, 1, None)),  # not chat's field
        ("responses", {"max_output_tokens": 300, "n": 2}, (300, 2, 600)),
        ("responses", {"max_tokens": 300}, (None, 1, None)),
        ("messages", {"max_tokens": 4096}, (4096, 1, 4096)),
        ("messages", {"max_tokens": 4096, "n": 1, "best_of": None}, (4096, 1, 4096)),
    ],
)
def test_the_worst_case_output_per_format(
    route: wire.Route, extra: dict[str, Any], want: tuple[Any, ...]
) -> None:
    ask = wire.read_ask(route, {"model": "m", **extra})
    assert (ask.max_output, ask.choices, ask.worst_output) == want


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("chat", []),
        ("chat", {"stream": True}),
        ("chat", {"model": ""}),
        ("chat", {"model": 3}),
        ("chat", {"model": "m", "n": 50, "max_tokens": 8000}),  # above MAX_CHOICES
        ("chat", {"model": "m", "best_of": wire.MAX_CHOICES + 1}),
        ("chat", {"model": "m", "n": 0}),
        ("chat", {"model": "m", "n": -2}),
        ("chat", {"model": "m", "n": 2.5}),
        ("chat", {"model": "m", "n": "8"}),
        ("chat", {"model": "m", "n": True}),
        ("chat", {"model": "m", "max_tokens": -1}),
        ("chat", {"model": "m", "max_tokens": 0}),
        ("chat", {"model": "m", "max_completion_tokens": 1e9}),
        ("chat", {"model": "m", "max_tokens": "8000"}),
        ("responses", {"model": "m", "max_output_tokens": 12.0}),
        ("messages", {"model": "m", "max_tokens": True}),
        ("messages", {"model": "m", "max_tokens": [8000]}),
    ],
)
def test_read_ask_refuses_what_cannot_be_bounded(route: wire.Route, body: Any) -> None:
    with pytest.raises(ValueError):
        wire.read_ask(route, body)


@pytest.mark.parametrize(
    ("max_output", "want"),
    [(None, 100 + wire.HOLD_CHUNK + 1), (64000, 100 + wire.HOLD_CHUNK + 1), (10, 100 + 11)],
)
def test_a_stream_holds_at_most_one_chunk_of_output(max_output: int | None, want: int) -> None:
    assert wire.hold_for(400, wire.Ask("m", True, max_output)) == want


@pytest.mark.parametrize(
    ("max_output", "choices", "want"),
    [
        (8000, 50, 100 + 400_000 + 1),
        (64000, 1, 100 + 64000 + 1),
        (10, 3, 100 + 30 + 1),
        (1, 1, 100 + 1 + 1),
    ],
)
def test_a_whole_answer_holds_its_worst_case(max_output: int, choices: int, want: int) -> None:
    assert wire.hold_for(400, wire.Ask("m", False, max_output, choices=choices)) == want


def test_a_whole_answer_with_no_cap_cannot_be_held() -> None:
    with pytest.raises(ValueError):
        wire.hold_for(400, wire.Ask("m", False, None))


@pytest.mark.parametrize(
    ("route", "body", "cap", "want"),
    [
        # (the field written, the worst output then held); None: forwarded unchanged
        ("chat", {"model": "m"}, 8192, ("max_tokens", 8192)),
        ("chat", {"model": "m", "n": 3}, 100, ("max_tokens", 300)),
        ("responses", {"model": "m"}, 50, ("max_output_tokens", 50)),
        ("messages", {"model": "m"}, 50, ("max_tokens", 50)),
        ("chat", {"model": "m", "max_completion_tokens": 7}, 8192, None),
        ("chat", {"model": "m", "stream": True}, 8192, None),  # a stream is held in chunks
        ("chat", {"model": "m", "stream": True}, 0, None),
    ],
)
def test_a_whole_request_with_no_cap_is_given_the_default(
    route: wire.Route, body: dict[str, Any], cap: int, want: tuple[str, int] | None
) -> None:
    bounded = wire.bound_output(route, body, wire.read_ask(route, body), cap)
    if want is None:
        assert bounded is None
        return
    assert bounded is not None
    forward, ask = bounded
    name, worst = want
    assert forward == {**body, name: cap}
    assert ask.worst_output == worst
    assert wire.hold_for(0, ask) == worst + 1


@pytest.mark.parametrize("route", ["chat", "responses", "messages"])
def test_no_default_cap_refuses_a_whole_request_that_names_none(route: wire.Route) -> None:
    body = {"model": "m"}
    with pytest.raises(ValueError, match="must name"):
        wire.bound_output(route, body, wire.read_ask(route, body), 0)


def test_a_chat_stream_is_asked_for_its_usage_once() -> None:
    body = {"model": "m", "stream": True, "stream_options": {"other": 1}}
    asked = wire.ask_for_usage("chat", body, wire.read_ask("chat", body))
    assert asked is not None and asked["stream_options"] == {"other": 1, "include_usage": True}
    mine = {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    assert wire.ask_for_usage("chat", mine, wire.read_ask("chat", mine)) is None
    assert wire.ask_for_usage("responses", body, wire.read_ask("responses", body)) is None
    assert wire.is_unasked_usage_chunk({"choices": [], "usage": {"prompt_tokens": 1}})
    assert not wire.is_unasked_usage_chunk({"choices": [{}], "usage": None})


def test_error_shapes() -> None:
    openai_body = json.loads(wire.error_body("openai", 429, "envelope default: empty\nx"))
    assert openai_body["error"]["message"] == "envelope default: empty x"
    assert openai_body["error"]["type"] == "insufficient_quota"
    anthropic_body = json.loads(wire.error_body("anthropic", 401, "no"))
    assert anthropic_body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "no"},
    }
    assert wire.stream_error_event("messages", 429, "x").startswith(b"event: error\ndata: ")
    assert wire.stream_error_event("chat", 429, "x").startswith(b'data: {"error"')
    assert wire.family(None, "/v1/messages/nothing") == "anthropic"
    assert wire.family(None, "/v2/x") == "openai"


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("https://api.example.com/v1", "https://api.example.com"),
        ("http://h:1/v1/chat/completions", "http://h:1"),
        ("http://h:1/", "http://h:1"),
        (None, None),
    ],
)
def test_upstream_base(url: str | None, want: str | None) -> None:
    assert upstream_base(url) == want
