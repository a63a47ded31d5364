"""The gateway end to end: the official OpenAI and Anthropic SDKs as clients, through a real
``overnight gateway`` process, to a scripted upstream; every charge read back from Redis."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.gateway.grant import Grant, mint, revoke
from overnight.worker.lease.store import Leases
from overnight.worker.redisio.receipts import read
from tests.helpers import OVERNIGHT, UPSTREAM, wait_for

UP_TOKENS = 11 + 7  # the scripted upstream's OpenAI usage
ANTHROPIC_TOKENS = 11 + 7 + 3 + 2  # input, output, cache read, cache write


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, str(UPSTREAM)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("port "), line
    yield f"http://127.0.0.1:{line.split()[1]}"
    proc.terminate()
    proc.wait(10)
    proc.stdout.close()


@dataclass
class Gw:
    url: str
    r: redis.Redis
    keys: Keys
    namespace: str
    clients: list[openai.OpenAI | anthropic.Anthropic] = field(default_factory=list)

    def grant(self, **kw: Any) -> tuple[str, str]:
        """A running lease and a token for it: (lease id, token)."""
        leases = Leases(self.r, self.keys)
        doc = leases.acquire(budget_sec=120, gap_sec=30, task_id=kw.get("task_id"))
        token, _env = mint(
            self.r, self.keys, doc.lease_id, doc.token, Grant(self.url, **kw), ttl=120, gap=30
        )
        return doc.lease_id, token

    def envelope(self, name: str = "default") -> CallEnvelope:
        return CallEnvelope(self.r, name, self.namespace)

    def calls(self, kind: str = "model_call") -> list[dict[str, Any]]:
        return [rc.data for rc in read(self.r, self.keys) if rc.kind == kind]

    def openai(self, token: str) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=token, max_retries=0)
        self.clients.append(client)
        return client

    def anthropic(self, token: str) -> anthropic.Anthropic:
        client = anthropic.Anthropic(base_url=self.url, auth_token=token, max_retries=0)
        self.clients.append(client)
        return client

    def close(self) -> None:
        for client in self.clients:
            client.close()


def start_gateway(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``overnight gateway --port 0`` with its log in ``log``; returns it and its URL."""
    with log.open("wb") as out:
        proc = subprocess.Popen([OVERNIGHT, "gateway", "--port", "0"], env=env, stderr=out)

    def listening() -> str | None:
        text = log.read_text()
        assert proc.poll() is None, text
        return text.split("listening on ")[1].split()[0] if "listening on " in text else None

    return proc, wait_for(listening, timeout=20)


@pytest.fixture
def gw(
    env: dict[str, str], upstream: str, r: redis.Redis, namespace: str, tmp_path: Path
) -> Iterator[Gw]:
    env = {
        **env,
        "OVERNIGHT_MODEL_URL": f"{upstream}/v1",
        "OVERNIGHT_MODEL_API_KEY": "sk-real",
        "OVERNIGHT_ANTHROPIC_URL": upstream,
        "OVERNIGHT_ANTHROPIC_API_KEY": "ak-real",
        "OVERNIGHT_MODEL_TIMEOUT": "3",
    }
    proc, url = start_gateway(env, tmp_path / "gateway.log")
    gw = Gw(url, r, Keys(namespace), namespace)
    yield gw
    gw.close()
    proc.terminate()
    assert proc.wait(10) == 0
    assert "sk-real" not in (tmp_path / "gateway.log").read_text()


def _seen(upstream: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{upstream}/_seen", timeout=5) as resp:
        data: list[dict[str, Any]] = json.loads(resp.read())
    return data


def _raw(url: str, method: str = "POST", body: bytes = b"", **headers: str) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=body or None, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        exc.close()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode()


# --- each format, streaming and not: charged exactly once, usage as the upstream's --------


def test_chat_json_and_stream(gw: Gw, upstream: str) -> None:
    gw.envelope().reset(10)
    _, token = gw.grant()
    client = gw.openai(token)
    msgs: Any = [{"role": "user", "content": "hello"}]
    reply = client.chat.completions.create(model="m", messages=msgs)
    assert reply.choices[0].message.content == "hi"
    assert reply.usage is not None and reply.usage.total_tokens == UP_TOKENS
    chunks = list(client.chat.completions.create(model="m", messages=msgs, stream=True))
    # The client did not ask for usage: the chunk the gateway asked for is not shown.
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hi"
    asked = [s for s in _seen(upstream) if s["path"] == "/v1/chat/completions"][-1]
    assert asked["body"]["stream_options"] == {"include_usage": True}
    assert asked["headers"]["Authorization"] == "Bearer sk-real"
    with_usage = list(
        client.chat.completions.create(
            model="m", messages=msgs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert [c.usage.total_tokens for c in with_usage if c.usage] == [UP_TOKENS]
    state = gw.envelope().snapshot()
    assert (state.consumed_model, state.remaining) == (3, 7)
    assert (state.consumed_tokens, state.reserved_tokens) == (3 * UP_TOKENS, 0)
    rows = gw.calls()
    assert [(c["route"], c["stream"], c["tokens"], c["estimated"]) for c in rows] == [
        ("chat", False, UP_TOKENS, False),
        ("chat", True, UP_TOKENS, False),
        ("chat", True, UP_TOKENS, False),
    ]


def test_responses_json_and_stream_with_tool_calls(gw: Gw) -> None:
    gw.envelope().reset(10)
    _, token = gw.grant()
    client = gw.openai(token)
    reply = client.responses.create(model="m-tool", input="hello")
    assert reply.usage is not None and reply.usage.total_tokens == UP_TOKENS
    events = list(client.responses.create(model="m", input="hello", stream=True))
    assert events[-1].type == "response.completed"
    state = gw.envelope().snapshot()
    # Two model requests; the first asked for two tool calls: one tool unit each.
    assert (state.consumed_model, state.consumed_tool, state.remaining) == (2, 2, 6)
    assert state.consumed_tokens == 2 * UP_TOKENS
    assert [(c["route"], c["tool_calls"]) for c in gw.calls()] == [
        ("responses", 2),
        ("responses", 0),
    ]


def test_anthropic_json_and_stream_forward_headers(gw: Gw, upstream: str) -> None:
    gw.envelope().reset(10)
    _, token = gw.grant()
    client = gw.anthropic(token)
    msgs: Any = [{"role": "user", "content": "hello"}]
    reply = client.messages.create(
        model="m-tool", max_tokens=20000, messages=msgs, extra_headers={"anthropic-beta": "x-test"}
    )
    assert reply.usage.output_tokens == 7
    with client.messages.stream(model="m", max_tokens=100, messages=msgs) as stream:
        text = "".join(stream.text_stream)
    assert text == "hi"
    seen = [s for s in _seen(upstream) if s["path"] == "/v1/messages"]
    assert seen[-2]["headers"]["anthropic-beta"] == "x-test"
    assert "anthropic-version" in seen[-1]["headers"]
    assert seen[-1]["headers"]["x-api-key"] == "ak-real"
    assert token not in json.dumps(seen)
    state = gw.envelope().snapshot()
    assert (state.consumed_model, state.consumed_tool) == (2, 2)
    assert state.consumed_tokens == 2 * ANTHROPIC_TOKENS
    rows = gw.calls()
    assert [(c["cache_read_tokens"], c["cache_write_tokens"]) for c in rows] == [(3, 2), (3, 2)]
    # A whole answer that may be 20000 tokens holds them all; a stream holds what it asked
    # (at most one chunk, more as it runs).
    assert rows[0]["hold"] > 20_000 and 100 < rows[1]["hold"] < 8192


def test_query_string_count_tokens_models_and_head(gw: Gw, upstream: str) -> None:
    gw.envelope().reset(10)
    _, token = gw.grant()
    body = json.dumps(
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    ).encode()
    status, reply = _raw(f"{gw.url}/v1/messages?beta=true", body=body, **{"x-api-key": token})
    assert status == 200 and reply["usage"]["input_tokens"] == 11
    assert _seen(upstream)[-1]["query"] == "beta=true"
    status, counted = _raw(f"{gw.url}/v1/messages/count_tokens", body=body, **{"x-api-key": token})
    assert (status, counted) == (200, {"input_tokens": 11})
    models = gw.openai(token).models.list()
    assert [m.id for m in models] == ["m"]
    assert _raw(gw.url + "/", method="HEAD")[0] == 200
    state = gw.envelope().snapshot()
    assert state.consumed_model == 1  # count_tokens and models are not model calls


def test_no_usage_is_estimated(gw: Gw) -> None:
    gw.envelope().reset(10)
    _, token = gw.grant()
    gw.openai(token).chat.completions.create(
        model="m-nousage", messages=[{"role": "user", "content": "x"}]
    )
    (row,) = gw.calls()
    assert row["estimated"] is True and row["tokens"] > 0
    assert gw.envelope().snapshot().consumed_tokens == row["tokens"]


# --- refusals: the SDKs' own errors, nothing charged, the grant remembers ------------------


def test_refusal_is_a_429_in_each_format_and_sticks(gw: Gw) -> None:
    gw.envelope().reset(1)
    lease_id, token = gw.grant()
    client = gw.openai(token)
    msgs: Any = [{"role": "user", "content": "x"}]
    client.chat.completions.create(model="m", messages=msgs)
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="m", messages=msgs)
    assert "envelope default" in str(refused.value)
    # The SDKs (and the agent CLIs built on them) are told not to ask again.
    assert refused.value.response.headers["x-should-retry"] == "false"
    for _ in range(5):  # a retry loop burns nothing
        with pytest.raises(anthropic.RateLimitError):
            gw.anthropic(token).messages.create(model="m", max_tokens=5, messages=msgs)
    state = gw.envelope().snapshot()
    assert (state.consumed_model, state.remaining, state.reserved_tokens) == (1, 0, 0)
    assert len(gw.calls("call_refused")) == 1
    assert gw.r.hget(gw.keys.lease_grant(lease_id), "refused")


def test_token_cap_of_the_envelope_and_task_caps(gw: Gw) -> None:
    gw.envelope().reset(100, max_tokens=3 * UP_TOKENS)
    _, token = gw.grant()
    client = gw.openai(token)
    msgs: Any = [{"role": "user", "content": "x"}]
    # Each request holds its body's estimate plus its max_tokens (about 26 tokens here):
    # it is forwarded only while that whole hold fits under the cap.
    client.chat.completions.create(model="m", messages=msgs, max_tokens=10)
    client.chat.completions.create(model="m", messages=msgs, max_tokens=10)
    with pytest.raises(openai.RateLimitError, match="token cap"):
        client.chat.completions.create(model="m", messages=msgs, max_tokens=10)
    assert gw.envelope().snapshot().consumed_tokens == 2 * UP_TOKENS
    gw.envelope().reset(100)
    gw.r.hset(gw.keys.task("t1"), mapping={"calls_used": 1})
    _, token = gw.grant(task_id="t1", max_calls=3, prepaid=True)
    client = gw.openai(token)
    for _ in range(3):  # the prepaid floor unit, then two more
        client.chat.completions.create(model="m", messages=msgs)
    with pytest.raises(openai.RateLimitError, match="max_calls"):
        client.chat.completions.create(model="m", messages=msgs)
    assert gw.r.hget(gw.keys.task("t1"), "calls_used") == "3"
    assert gw.r.hget(gw.keys.task("t1"), "tokens_used") == str(3 * UP_TOKENS)
    assert gw.r.hget(gw.keys.task("t1"), "tokens_held") == "0"
    assert gw.envelope().snapshot().consumed_model == 2


def test_a_request_is_held_at_its_worst_case_or_refused(gw: Gw, upstream: str) -> None:
    # The upstream bills every token a request allows (its cap times its choices).
    gw.envelope().reset(100, max_tokens=50_000)
    msgs: Any = [{"role": "user", "content": "x"}]
    _, token = gw.grant(task_id="hostile", max_tokens=20_000)
    client = gw.openai(token)
    # 50 choices of 8000 tokens (400,000) could never be held: refused before anything.
    with pytest.raises(openai.BadRequestError, match="choices"):
        client.chat.completions.create(model="m-fill", messages=msgs, max_tokens=8000, n=50)
    for bad in ({"n": 2.5}, {"max_tokens": -1}, {"max_completion_tokens": "8000"}):
        status, reply = _raw(
            f"{gw.url}/v1/chat/completions",
            body=json.dumps({"model": "m-fill", "messages": msgs, **bad}).encode(),
            Authorization=f"Bearer {token}",
        )
        assert status == 400 and reply["error"]["type"] == "invalid_request_error", bad
    status, reply = _raw(
        f"{gw.url}/v1/messages",
        body=json.dumps({"model": "m-fill", "messages": msgs, "max_tokens": True}).encode(),
        **{"x-api-key": token},
    )
    assert status == 400 and reply["type"] == "error"
    # 8 choices of 8000 (64,000) are a hold past the task's 20,000: refused, nothing spent.
    with pytest.raises(openai.RateLimitError, match="max_tokens"):
        client.chat.completions.create(model="m-fill", messages=msgs, max_tokens=8000, n=8)
    assert not [s for s in _seen(upstream) if s["body"].get("model") == "m-fill"]
    assert gw.calls() == []
    assert gw.envelope().snapshot().consumed_tokens == 0
    assert int(gw.r.hget(gw.keys.task("hostile"), "tokens_used") or 0) == 0

    # The benign twin: each answer is charged what the upstream billed, within its hold.
    _, token = gw.grant(task_id="benign", max_tokens=20_000)
    client = gw.openai(token)
    reply = client.chat.completions.create(model="m-fill", messages=msgs, max_tokens=100, n=3)
    assert reply.usage is not None and reply.usage.completion_tokens == 300
    # A whole request that names no cap is given the default one, and holds it.
    reply = client.chat.completions.create(model="m-fill", messages=msgs)
    assert reply.usage is not None and reply.usage.completion_tokens == 8192
    assert [s for s in _seen(upstream) if s["body"].get("model") == "m-fill"][-1]["body"][
        "max_tokens"
    ] == 8192
    rows = gw.calls()
    assert [r["tokens"] for r in rows] == [11 + 300, 11 + 8192]
    assert all(r["hold"] >= r["tokens"] for r in rows)
    assert gw.r.hget(gw.keys.task("benign"), "tokens_used") == str(22 + 8492)
    state = gw.envelope().snapshot()
    assert (state.consumed_tokens, state.reserved_tokens) == (22 + 8492, 0)


# --- who may call: a hostile step's tokens -----------------------------------------------


def test_missing_made_up_and_ended_tokens_get_401(gw: Gw) -> None:
    gw.envelope().reset(10)
    msgs: Any = [{"role": "user", "content": "x"}]
    status, body = _raw(f"{gw.url}/v1/chat/completions", body=b"{}")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        gw.openai("ovn-made-up").chat.completions.create(model="m", messages=msgs)
    # A lease that ended: its record says so even while the token key still exists.
    lease_id, token = gw.grant()
    leases = Leases(gw.r, gw.keys)
    doc = leases.get(lease_id)
    assert doc is not None
    gw.r.hset(gw.keys.lease(lease_id), "status", "done")
    with pytest.raises(anthropic.AuthenticationError):
        gw.anthropic(token).messages.create(model="m", max_tokens=5, messages=msgs)
    # Another lease's token after that lease ended and its token was revoked.
    other_id, other = gw.grant()
    revoke(gw.r, gw.keys, other_id, other)
    with pytest.raises(openai.AuthenticationError):
        gw.openai(other).chat.completions.create(model="m", messages=msgs)
    assert gw.envelope().snapshot().consumed_model == 0


# --- bad input and faults: the format's error shape, nothing charged, still serving -------


def test_bad_input_and_upstream_faults(gw: Gw) -> None:
    gw.envelope().reset(10)
    _, token = gw.grant()
    auth = {"Authorization": f"Bearer {token}"}
    status, body = _raw(f"{gw.url}/v1/chat/completions", body=b"{not json", **auth)
    assert status == 400 and "malformed" in body["error"]["message"]
    status, body = _raw(f"{gw.url}/v1/nothing", body=b"{}", **auth)
    assert status == 404 and body["error"]["type"] == "invalid_request_error"
    status, body = _raw(f"{gw.url}/v1/messages/nothing", body=b"{}", **auth)
    assert status == 404 and body["type"] == "error"
    status, _ = _raw(
        f"{gw.url}/v1/responses", method="GET", Upgrade="websocket", Connection="Upgrade", **auth
    )
    assert status == 426
    msgs: Any = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.InternalServerError):
        gw.openai(token).chat.completions.create(model="m-e500", messages=msgs)
    with pytest.raises(anthropic.APIStatusError) as stalled:
        gw.anthropic(token).messages.create(model="m-slow5", max_tokens=5, messages=msgs)
    assert stalled.value.status_code == 504
    state = gw.envelope().snapshot()
    assert (state.consumed_model, state.remaining, state.reserved_tokens) == (0, 10, 0)
    gw.openai(token).chat.completions.create(model="m", messages=msgs)  # still serving
    assert gw.envelope().snapshot().consumed_model == 1
    assert [c["refunded"] for c in gw.calls()] == [True, True, False]


def test_upstream_down_is_a_502_and_refunded(
    env: dict[str, str], r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    env = {**env, "OVERNIGHT_MODEL_URL": "http://127.0.0.1:9/v1"}
    proc, url = start_gateway(env, tmp_path / "gateway.log")
    try:
        gw = Gw(url, r, Keys(namespace), namespace)
        gw.envelope().reset(5)
        _, token = gw.grant()
        with pytest.raises(openai.APIStatusError) as down:
            gw.openai(token).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}]
            )
        assert down.value.status_code == 502
        assert gw.envelope().snapshot().remaining == 5
        with pytest.raises(anthropic.APIStatusError) as unset:
            gw.anthropic(token).messages.create(
                model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]
            )
        assert unset.value.status_code == 502 and "OVERNIGHT_ANTHROPIC_URL" in str(unset.value)
        gw.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_client_disconnect_commits_real_usage(gw: Gw) -> None:
    gw.envelope().reset(10)
    _, token = gw.grant()
    stream = gw.openai(token).chat.completions.create(
        model="m-long", messages=[{"role": "user", "content": "x"}], stream=True
    )
    next(iter(stream))
    stream.close()
    (row,) = wait_for(lambda: gw.calls(), timeout=20)
    assert row["disconnected"] is True
    assert row["tokens"] == UP_TOKENS and row["estimated"] is False
    state = gw.envelope().snapshot()
    assert (state.consumed_tokens, state.reserved_tokens) == (UP_TOKENS, 0)


def test_a_stream_holds_more_in_chunks_and_is_cut_when_refused(gw: Gw) -> None:
    msgs: Any = [{"role": "user", "content": "x"}]
    # 50,000 characters are about 16,700 tokens by the running estimate: two more chunks.
    gw.envelope().reset(10, max_tokens=100_000)
    _, token = gw.grant()
    text = "".join(
        c.choices[0].delta.content or ""
        for c in gw.openai(token).chat.completions.create(model="m-big", messages=msgs, stream=True)
        if c.choices
    )
    assert len(text) == 50_000
    (row,) = gw.calls()
    assert row["hold"] > 2 * 8192 and row["tokens"] == UP_TOKENS and not row["cut"]
    assert gw.envelope().snapshot().reserved_tokens == 0
    # Under a cap of 10,000 the first chunk fits, the second does not: the stream is cut
    # with the format's error event, charged its usage (or its whole hold when the usage
    # had not come yet), never past the cap.
    gw.envelope().reset(10, max_tokens=10_000)
    _, token = gw.grant()
    with pytest.raises(openai.APIError, match="token cap reached mid-stream"):
        for _ in gw.openai(token).chat.completions.create(
            model="m-big", messages=msgs, stream=True
        ):
            pass
    row = gw.calls()[-1]
    assert row["cut"] and row["tokens"] in (UP_TOKENS, row["hold"])
    state = gw.envelope().snapshot()
    assert state.consumed_tokens == row["tokens"] <= 10_000
    assert state.reserved_tokens == 0
    assert len(gw.calls("call_refused")) == 1
