"""The gateway under load: 8 client processes x 100 requests on a call budget and on a
token budget (calls exact, tokens never past the cap), and clients that hang up mid-stream
(every hold settled, nothing left reserved)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.gateway.grant import Grant, mint
from overnight.worker.lease.store import Leases
from overnight.worker.redisio.receipts import read
from tests.helpers import run_gateway, wait_for

PROCS, REQUESTS = 8, 100
TOKENS = 11 + 7

# One client process: REQUESTS requests on one keep-alive connection; prints its counts.
CLIENT = textwrap.dedent("""
    import http.client, json, sys, urllib.parse
    url, token, count, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    where = urllib.parse.urlsplit(url)
    seen = {}
    for _ in range(count):
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
        stream = mode == "hangup"
        body = {"model": "m-long" if stream else "m", "stream": stream, "max_tokens": 10,
                "messages": [{"role": "user", "content": "x"}]}
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Authorization": "Bearer " + token, "Content-Type": "application/json"})
        resp = conn.getresponse()
        if stream:
            resp.read(10)  # the first bytes, then hang up mid-stream
        else:
            resp.read()
        conn.close()
        seen[resp.status] = seen.get(resp.status, 0) + 1
    print(json.dumps(seen))
""")


@pytest.fixture
def gateway(env: dict[str, str], upstream: str, tmp_path: Path) -> Iterator[str]:
    with run_gateway({**env, "OVERNIGHT_MODEL_URL": upstream}, tmp_path) as url:
        yield url


def _clients(r: redis.Redis, namespace: str, url: str, count: int, mode: str) -> dict[int, int]:
    keys, leases = Keys(namespace), Leases(r, Keys(namespace))
    procs = []
    for _ in range(PROCS):
        doc = leases.acquire(budget_sec=300, gap_sec=60)
        token, _ = mint(r, keys, doc.lease_id, doc.token, Grant(url), ttl=300, gap=60)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", CLIENT, url, token, str(count), mode],
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    total: dict[int, int] = {}
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        for status, n in json.loads(out).items():
            total[int(status)] = total.get(int(status), 0) + n
    return total


def test_a_call_budget_is_exact(r: redis.Redis, namespace: str, gateway: str) -> None:
    envelope = CallEnvelope(r, "default", namespace)
    envelope.reset(500)
    seen = _clients(r, namespace, gateway, REQUESTS, "json")
    state = envelope.snapshot()
    assert seen[200] == 500 == state.consumed_model
    assert seen[429] == PROCS * REQUESTS - 500
    assert (state.remaining, state.reserved_tokens) == (0, 0)
    assert state.consumed_tokens == 500 * TOKENS


def test_a_token_budget_is_never_passed(r: redis.Redis, namespace: str, gateway: str) -> None:
    envelope = CallEnvelope(r, "default", namespace)
    cap = 300 * TOKENS
    envelope.reset(10_000, max_tokens=cap)
    seen = _clients(r, namespace, gateway, REQUESTS, "json")
    state = envelope.snapshot()
    assert state.consumed_tokens <= cap
    assert state.consumed_tokens == seen[200] * TOKENS == state.consumed_model * TOKENS
    assert state.reserved_tokens == 0
    # Each request holds about 26 tokens: the budget runs until less than one hold is left.
    assert cap - state.consumed_tokens < 2 * 26 + TOKENS


def test_clients_that_hang_up_leave_nothing_held(
    r: redis.Redis, namespace: str, gateway: str
) -> None:
    envelope = CallEnvelope(r, "default", namespace)
    envelope.reset(100)
    seen = _clients(r, namespace, gateway, 3, "hangup")
    assert seen == {200: PROCS * 3}
    keys = Keys(namespace)

    def settled() -> list[dict[str, object]] | None:
        rows = [rc.data for rc in read(r, keys) if rc.kind == "model_call"]
        return rows if len(rows) == PROCS * 3 else None

    rows = wait_for(settled, timeout=60)
    assert all(row["disconnected"] for row in rows)
    # Each stream's usage came in the drain after the hang-up: the real usage, not a guess.
    assert all(row["tokens"] == TOKENS and not row["estimated"] for row in rows)
    state = envelope.snapshot()
    assert (state.consumed_model, state.reserved_tokens) == (PROCS * 3, 0)
    assert state.consumed_tokens == PROCS * 3 * TOKENS
    assert r.zcard(keys.envelope_reservations("default")) == 0
