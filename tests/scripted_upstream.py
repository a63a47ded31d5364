"""A scripted model upstream for the gateway tests and bench: canned OpenAI chat, Responses
and Anthropic Messages answers, JSON and SSE, with known usage.

Run as ``python tests/scripted_upstream.py``: it listens on a free loopback port and prints
``port N``. The model name scripts the answer: a name containing ``tool`` asks for two tool
calls, ``nousage`` reports no usage, ``e500`` answers HTTP 500, ``slow<N>`` waits N seconds
before answering, ``long`` streams 200 chunks 20 ms apart, ``big`` streams 50,000 characters
of chat text, ``fill`` bills every output token the request allows (its output cap times its
``n``/``best_of``), as an upstream whose model writes to the limit would. ``GET /_seen``
returns every request it got (path, query, headers, body).

``--script FILE`` plays a real agent's model instead: FILE is JSON ``{"turns": [{"text": ...,
"shell": CMD or null, "delay": SECONDS}, ...], "count": "all" | "tools"}``. Each completion
request (any format, streaming or not) is answered with the next turn: ``text`` as the
assistant's message and, when ``shell`` is set, one call of the shell-like tool the request
offers (its argument shaped from that tool's schema). After the last turn the last repeats.
With ``"count": "tools"`` a request that offers no tools gets ``text`` "ok" and uses no turn
(a CLI's side requests, such as a title). ``GET /_script`` says how many turns were used.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from dataclasses import dataclass
from typing import Any

from aiohttp import web

INPUT, OUTPUT, CACHE_READ, CACHE_WRITE = 11, 7, 3, 2
SEEN: list[dict[str, Any]] = []


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


@dataclass(frozen=True)
class Reply:
    """One answer: the assistant's text and the tool calls it asks for (name, arguments)."""

    text: str = "hi"
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()
    local_shell: bool = False  # a Responses ``local_shell_call`` instead of a function call


def canned(model: str) -> Reply:
    """The answer the model name scripts: ``tool`` asks for two calls of ``run``."""
    return Reply(calls=(("run", {}), ("run", {}))) if "tool" in model else Reply()


SHELL_NAMES = (
    "shell",
    "shell_command",
    "exec_command",
    "bash",
    "Bash",
    "run_command",
    "run_shell_command",
    "execute_command",
)


def _tool_specs(body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, JSON schema of its arguments) of each tool the request offers, any format."""
    specs = []
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict):
            continue
        if tool.get("type") == "local_shell":
            specs.append(("<local_shell>", {}))
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        schema = fn.get("parameters") or fn.get("input_schema") or {}
        if isinstance(name, str):
            specs.append((name, schema if isinstance(schema, dict) else {}))
    return specs


def shell_call(body: dict[str, Any], command: str) -> Reply | None:
    """A call running ``command`` with the shell-like tool the request offers (None: none)."""
    specs = _tool_specs(body)
    by_name = dict(specs)
    name = next((n for n in SHELL_NAMES if n in by_name), None)
    if name is None:
        shaped = [
            n for n, schema in specs if {"command", "cmd"} & set(schema.get("properties") or {})
        ]
        name = shaped[0] if shaped else None
    if name is None:
        if "<local_shell>" not in by_name:
            return None
        return Reply(
            calls=(("<local_shell>", {"command": ["bash", "-lc", command]}),), local_shell=True
        )
    props = by_name[name].get("properties") or {}
    key = "cmd" if "cmd" in props and "command" not in props else "command"
    shape = props.get(key) or {}
    value: Any = ["bash", "-lc", command] if shape.get("type") == "array" else command
    return Reply(calls=((name, {key: value}),))


class Script:
    """The turns of ``--script``, played in order."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.turns: list[dict[str, Any]] = list(data.get("turns") or [{"text": "done"}])
        self.count_all = data.get("count", "all") != "tools"
        self.used = 0

    def next(self, body: dict[str, Any]) -> tuple[Reply, float]:
        if not self.count_all and not body.get("tools"):
            return Reply(text="ok"), 0.0
        turn = self.turns[min(self.used, len(self.turns) - 1)]
        self.used += 1
        text = str(turn.get("text") or "")
        call = shell_call(body, str(turn["shell"])) if turn.get("shell") else None
        reply = Reply(text=text)
        if call is not None:
            reply = Reply(text=text, calls=call.calls, local_shell=call.local_shell)
        return reply, float(turn.get("delay") or 0)


SCRIPT: Script | None = None


def billed_output(model: str, body: dict[str, Any]) -> int:
    """Output tokens the answer reports: ``OUTPUT``, or with ``fill`` all the request allows."""
    if "fill" not in model:
        return OUTPUT
    caps = [body.get(k) for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")]
    cap = max([c for c in caps if isinstance(c, int)] or [OUTPUT])
    choices = max([c for c in (body.get("n"), body.get("best_of")) if isinstance(c, int)] or [1])
    return int(cap * choices)


def chat(
    model: str, reply: Reply, include_usage: bool, output: int = OUTPUT
) -> tuple[Any, list[bytes]]:
    tools = bool(reply.calls)
    usage = (
        None
        if "nousage" in model
        else {"prompt_tokens": INPUT, "completion_tokens": output, "total_tokens": INPUT + output}
    )
    calls = [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)},
        }
        for i, (name, args) in enumerate(reply.calls)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if tools:
        message["tool_calls"] = calls
    whole = {
        "id": "c1",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls" if tools else "stop"}
        ],
    }
    if usage:
        whole["usage"] = usage
    base = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": model}
    events = [
        _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    ]
    half = len(reply.text) // 2
    words = ["x" * 1000] * 50 if "big" in model else [reply.text[:half], reply.text[half:]]
    for word in words:
        events.append(_sse({**base, "choices": [{"index": 0, "delta": {"content": word}}]}))
    if tools:
        for i, (name, args) in enumerate(reply.calls):
            first = {
                "index": i,
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            rest = {"index": i, "function": {"arguments": json.dumps(args)}}
            for part in (first, rest):
                delta = {"tool_calls": [part]}
                events.append(_sse({**base, "choices": [{"index": 0, "delta": delta}]}))
    finish = "tool_calls" if tools else "stop"
    events.append(_sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}))
    if include_usage and usage:
        events.append(_sse({**base, "choices": [], "usage": usage}))
    events.append(b"data: [DONE]\n\n")
    return whole, events


def responses(model: str, reply: Reply, output_tokens: int = OUTPUT) -> tuple[Any, list[bytes]]:
    output: list[dict[str, Any]] = [
        {
            "type": "message",
            "id": "m1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": reply.text, "annotations": []}],
        }
    ]
    for i, (name, args) in enumerate(reply.calls):
        if reply.local_shell:
            output.append(
                {
                    "type": "local_shell_call",
                    "id": f"ls{i}",
                    "call_id": f"call_{i}",
                    "status": "completed",
                    "action": {"type": "exec", "command": args["command"], "env": {}},
                }
            )
        else:
            output.append(
                {
                    "type": "function_call",
                    "id": f"fc{i}",
                    "call_id": f"call_{i}",
                    "name": name,
                    "arguments": json.dumps(args),
                    "status": "completed",
                }
            )
    whole: dict[str, Any] = {
        "id": "r1",
        "object": "response",
        "created_at": 1,
        "status": "completed",
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    if "nousage" not in model:
        whole["usage"] = {
            "input_tokens": INPUT,
            "output_tokens": output_tokens,
            "total_tokens": INPUT + output_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
    created = {**whole, "status": "in_progress", "output": []}
    created.pop("usage", None)
    seq = iter(range(1_000))
    events = [
        _sse(
            {"type": "response.created", "response": created, "sequence_number": next(seq)},
            "response.created",
        )
    ]
    for index, item in enumerate(output):
        added = {**item, "status": "in_progress"}
        if item["type"] == "message":
            added["content"] = []
        events.append(
            _sse(
                {
                    "type": "response.output_item.added",
                    "output_index": index,
                    "item": added,
                    "sequence_number": next(seq),
                },
                "response.output_item.added",
            )
        )
        if item["type"] == "message":
            events.append(
                _sse(
                    {
                        "type": "response.output_text.delta",
                        "item_id": item["id"],
                        "output_index": index,
                        "content_index": 0,
                        "delta": reply.text,
                        "sequence_number": next(seq),
                    },
                    "response.output_text.delta",
                )
            )
        events.append(
            _sse(
                {
                    "type": "response.output_item.done",
                    "output_index": index,
                    "item": item,
                    "sequence_number": next(seq),
                },
                "response.output_item.done",
            )
        )
    events.append(
        _sse(
            {"type": "response.completed", "response": whole, "sequence_number": next(seq)},
            "response.completed",
        )
    )
    return whole, events


def messages(model: str, reply: Reply, output: int = OUTPUT) -> tuple[Any, list[bytes]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": reply.text}]
    content += [
        {"type": "tool_use", "id": f"tu{i}", "name": name, "input": args}
        for i, (name, args) in enumerate(reply.calls)
    ]
    usage = {
        "input_tokens": INPUT,
        "output_tokens": output,
        "cache_read_input_tokens": CACHE_READ,
        "cache_creation_input_tokens": CACHE_WRITE,
    }
    stop_reason = "tool_use" if reply.calls else "end_turn"
    whole: dict[str, Any] = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
    }
    if "nousage" not in model:
        whole["usage"] = usage
    start = {**whole, "content": [], "stop_reason": None}
    if "nousage" not in model:
        start["usage"] = {**usage, "output_tokens": 1}
    events = [_sse({"type": "message_start", "message": start}, "message_start")]
    for i, block in enumerate(content):
        if block["type"] == "text":
            events += [
                _sse(
                    {
                        "type": "content_block_start",
                        "index": i,
                        "content_block": {"type": "text", "text": ""},
                    },
                    "content_block_start",
                ),
                _sse(
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {"type": "text_delta", "text": reply.text},
                    },
                    "content_block_delta",
                ),
            ]
        else:
            events.append(
                _sse(
                    {
                        "type": "content_block_start",
                        "index": i,
                        "content_block": {**block, "input": {}},
                    },
                    "content_block_start",
                )
            )
            partial = json.dumps(block["input"])
            events.append(
                _sse(
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {"type": "input_json_delta", "partial_json": partial},
                    },
                    "content_block_delta",
                )
            )
        events.append(_sse({"type": "content_block_stop", "index": i}, "content_block_stop"))
    stop = {"stop_reason": stop_reason, "stop_sequence": None}
    delta: dict[str, Any] = {"type": "message_delta", "delta": stop}
    if "nousage" not in model:
        delta["usage"] = {"output_tokens": output}
    events += [_sse(delta, "message_delta"), _sse({"type": "message_stop"}, "message_stop")]
    return whole, events


async def handle(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    body = json.loads(raw) if raw else {}
    SEEN.append(
        {
            "method": request.method,
            "path": request.path,
            "query": request.query_string,
            "headers": dict(request.headers),
            "body": body,
        }
    )
    if request.path == "/_seen":
        return web.json_response(SEEN[:-1])
    if request.path == "/_script":
        return web.json_response({"used": SCRIPT.used if SCRIPT else 0})
    if request.path == "/v1/models":
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": "m", "object": "model", "created": 1, "owned_by": "test"}],
            }
        )
    if request.path == "/v1/messages/count_tokens":
        return web.json_response({"input_tokens": INPUT})
    model = str(body.get("model", ""))
    if "e500" in model:
        return web.json_response({"error": {"message": "boom"}}, status=500)
    if request.path not in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        return web.json_response({"error": "no route"}, status=404)
    slow = re.search(r"slow(\d+(?:\.\d+)?)", model)
    delay = float(slow.group(1)) if slow else 0.0
    reply = canned(model)
    if SCRIPT is not None:
        reply, delay = SCRIPT.next(body)
    if delay:
        await asyncio.sleep(delay)
    stream = body.get("stream") is True
    if request.path == "/v1/chat/completions":
        include = (body.get("stream_options") or {}).get("include_usage") is True
        whole, events = chat(model, reply, include, billed_output(model, body))
    elif request.path == "/v1/responses":
        whole, events = responses(model, reply, billed_output(model, body))
    else:
        whole, events = messages(model, reply, billed_output(model, body))
    if not stream:
        return web.json_response(whole, headers={"x-upstream": "scripted"})
    out = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "x-upstream": "scripted"}
    )
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
    global SCRIPT
    if "--script" in sys.argv:
        with open(sys.argv[sys.argv.index("--script") + 1], encoding="utf-8") as fh:
            SCRIPT = Script(json.load(fh))
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
