"""A scripted model upstream for the gateway tests and bench: canned OpenAI chat, Responses
and Anthropic Messages answers, JSON and SSE, with known usage.

Run as ``python tests/scripted_upstream.py``: it listens on a free loopback port and prints
``port N``. The model name scripts the answer: a name containing ``tool`` asks for two tool
calls, ``nousage`` reports no usage, ``e500`` answers HTTP 500, ``slow<N>`` waits N seconds
before answering, ``long`` streams 200 chunks 20 ms apart, ``big`` streams 50,000 characters
of chat text. ``GET /_seen`` returns every
request it got (path, query, headers, body).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from typing import Any

from aiohttp import web

INPUT, OUTPUT, CACHE_READ, CACHE_WRITE = 11, 7, 3, 2
SEEN: list[dict[str, Any]] = []


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def chat(model: str, stream: bool, include_usage: bool) -> tuple[Any, list[bytes]]:
    tools = "tool" in model
    usage = None if "nousage" in model else {"prompt_tokens": INPUT, "completion_tokens": OUTPUT,
                                               "total_tokens": INPUT + OUTPUT}  # fmt: skip
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": "run", "arguments": "{}"}} for i in range(2)]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": "hi"}
    if tools:
        message["tool_calls"] = calls
    whole = {"id": "c1", "object": "chat.completion", "created": 1, "model": model,
             "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}  # fmt: skip
    if usage:
        whole["usage"] = usage
    base = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": model}
    events = [_sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                 "content": ""}}]})]  # fmt: skip
    words = ["x" * 1000] * 50 if "big" in model else ["h", "i"]
    for word in words:
        events.append(_sse({**base, "choices": [{"index": 0, "delta": {"content": word}}]}))
    if tools:
        for i in range(2):
            first = {"index": i, "id": f"call_{i}", "type": "function",
                     "function": {"name": "run", "arguments": ""}}  # fmt: skip
            rest = {"index": i, "function": {"arguments": "{}"}}
            for part in (first, rest):
                delta = {"tool_calls": [part]}
                events.append(_sse({**base, "choices": [{"index": 0, "delta": delta}]}))
    events.append(_sse({**base, "choices": [{"index": 0, "delta": {},
                                               "finish_reason": "stop"}]}))  # fmt: skip
    if include_usage and usage:
        events.append(_sse({**base, "choices": [], "usage": usage}))
    events.append(b"data: [DONE]\n\n")
    return whole, events


def responses(model: str) -> tuple[Any, list[bytes]]:
    output: list[dict[str, Any]] = [{"type": "message", "id": "m1", "status": "completed",
                                     "role": "assistant", "content": [
                                         {"type": "output_text", "text": "hi",
                                          "annotations": []}]}]  # fmt: skip
    if "tool" in model:
        output += [{"type": "function_call", "id": f"fc{i}", "call_id": f"call_{i}",
                    "name": "run", "arguments": "{}", "status": "completed"}
                   for i in range(2)]  # fmt: skip
    whole: dict[str, Any] = {"id": "r1", "object": "response", "created_at": 1,
                             "status": "completed", "model": model, "output": output,
                             "parallel_tool_calls": True, "tool_choice": "auto",
                             "tools": []}  # fmt: skip
    if "nousage" not in model:
        whole["usage"] = {"input_tokens": INPUT, "output_tokens": OUTPUT,
                          "total_tokens": INPUT + OUTPUT,
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
    created = {**whole, "status": "in_progress", "output": []}
    created.pop("usage", None)
    events = [
        _sse({"type": "response.created", "response": created, "sequence_number": 0},
             "response.created"),
        _sse({"type": "response.output_text.delta", "item_id": "m1", "output_index": 0,
              "content_index": 0, "delta": "hi", "sequence_number": 1},
             "response.output_text.delta"),
        _sse({"type": "response.completed", "response": whole, "sequence_number": 2},
             "response.completed"),
    ]  # fmt: skip
    return whole, events


def messages(model: str) -> tuple[Any, list[bytes]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "hi"}]
    if "tool" in model:
        content += [{"type": "tool_use", "id": f"tu{i}", "name": "run", "input": {}}
                    for i in range(2)]  # fmt: skip
    usage = {"input_tokens": INPUT, "output_tokens": OUTPUT, "cache_read_input_tokens": CACHE_READ,
             "cache_creation_input_tokens": CACHE_WRITE}  # fmt: skip
    whole: dict[str, Any] = {"id": "msg_1", "type": "message", "role": "assistant",
                             "model": model, "content": content, "stop_reason": "end_turn",
                             "stop_sequence": None}  # fmt: skip
    if "nousage" not in model:
        whole["usage"] = usage
    start = {**whole, "content": [], "stop_reason": None}
    if "nousage" not in model:
        start["usage"] = {**usage, "output_tokens": 1}
    events = [_sse({"type": "message_start", "message": start}, "message_start")]
    for i, block in enumerate(content):
        if block["type"] == "text":
            events += [
                _sse({"type": "content_block_start", "index": i,
                      "content_block": {"type": "text", "text": ""}}, "content_block_start"),
                _sse({"type": "content_block_delta", "index": i,
                      "delta": {"type": "text_delta", "text": "hi"}}, "content_block_delta"),
            ]  # fmt: skip
        else:
            events.append(_sse({"type": "content_block_start", "index": i,
                                "content_block": {**block, "input": {}}},
                               "content_block_start"))  # fmt: skip
        events.append(_sse({"type": "content_block_stop", "index": i}, "content_block_stop"))
    stop = {"stop_reason": "end_turn", "stop_sequence": None}
    delta: dict[str, Any] = {"type": "message_delta", "delta": stop}
    if "nousage" not in model:
        delta["usage"] = {"output_tokens": OUTPUT}
    events += [_sse(delta, "message_delta"), _sse({"type": "message_stop"}, "message_stop")]
    return whole, events


async def handle(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    body = json.loads(raw) if raw else {}
    SEEN.append({"method": request.method, "path": request.path, "query": request.query_string,
                 "headers": dict(request.headers), "body": body})  # fmt: skip
    if request.path == "/_seen":
        return web.json_response(SEEN[:-1])
    if request.path == "/v1/models":
        return web.json_response({"object": "list", "data": [
            {"id": "m", "object": "model", "created": 1, "owned_by": "test"}]})  # fmt: skip
    if request.path == "/v1/messages/count_tokens":
        return web.json_response({"input_tokens": INPUT})
    model = str(body.get("model", ""))
    if "e500" in model:
        return web.json_response({"error": {"message": "boom"}}, status=500)
    slow = re.search(r"slow(\d+(?:\.\d+)?)", model)
    if slow:
        await asyncio.sleep(float(slow.group(1)))
    stream = body.get("stream") is True
    if request.path == "/v1/chat/completions":
        include = (body.get("stream_options") or {}).get("include_usage") is True
        whole, events = chat(model, stream, include)
    elif request.path == "/v1/responses":
        whole, events = responses(model)
    elif request.path == "/v1/messages":
        whole, events = messages(model)
    else:
        return web.json_response({"error": "no route"}, status=404)
    if not stream:
        return web.json_response(whole, headers={"x-upstream": "scripted"})
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                      "x-upstream": "scripted"})  # fmt: skip
    await out.prepare(request)
    if "long" in model:
        filler = events[1] if len(events) > 2 else events[0]
        for _ in range(200):
            await out.write(filler)
            await asyncio.sleep(0.02)
    for event in events:
        await out.write(event)
    await out.write_eof()
    return out


async def main() -> None:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
    await site.start()
    print(f"port {runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
