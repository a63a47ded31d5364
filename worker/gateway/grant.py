"""Per-lease gateway credentials: the supervisor's side.

When a step is to reach a model, its supervisor mints an opaque token for the lease it just
acquired and writes two keys with a TTL: ``gateway:token:<sha256>`` -> lease id (only the
hash of the token is ever stored) and the lease's grant hash (task, envelope, caps, the
prepaid floor unit, the lease's fencing token). The step gets the token as its OpenAI and
Anthropic API key and the gateway as its base URL; both keys are deleted when the lease
ends, and the gateway checks on every request that the lease is still running.

The gateway writes two fields of the grant that nothing else writes: ``progress_ms`` (a
model was at work for this lease, in Redis server ms) and ``refused`` (a call was refused;
the step is to end). The keeper reads them through :func:`watch`. A step cannot forge
either: it holds no Redis credential.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis
    from redis.typing import EncodableT, FieldT

    from overnight.config.keys import Keys

TOKEN_PREFIX = "ovn-"
# Seconds a step waits for its host's gateway to answer (it may be starting again after a
# crash) before it is refused a token and not started (at most half its heartbeat gap).
GATEWAY_WAIT = 5.0
STEP_VARS = (
    "OPENAI_BASE_URL",
    "OPENAI_API_BASE",
    "OPENAI_API_KEY",
    "ANTHROPIC_BASE_URL",
    "ANTHROPIC_AUTH_TOKEN",
)


@dataclass(frozen=True)
class Grant:
    """What one step may spend through the gateway at ``base_url``.

    ``prepaid``: the step's floor unit was already charged (the task loop charges one model
    unit per agent step before it runs); the step's first request uses it instead of a new
    unit, so a step costs max(1, requests) model units.
    """

    base_url: str
    envelope: str = "default"
    task_id: str | None = None
    max_calls: int | None = None
    max_tokens: int | None = None
    prepaid: bool = False


def digest(token: str) -> str:
    """How a token is known in Redis."""
    return hashlib.sha256(token.encode()).hexdigest()


def step_env(base_url: str, token: str) -> dict[str, str]:
    """The variables that point a step's OpenAI and Anthropic clients at the gateway."""
    base = base_url.rstrip("/")
    return {
        "OPENAI_BASE_URL": f"{base}/v1",
        "OPENAI_API_BASE": f"{base}/v1",
        "OPENAI_API_KEY": token,
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_AUTH_TOKEN": token,
    }


def reach_problem(base_url: str, socket: str | None = None) -> str | None:
    """Why a step may not be given a token for the gateway it would reach: through
    ``socket`` (a sandbox binds it in), the socket's place and peer; else the loopback port
    of ``base_url``, whoever holds it (:mod:`worker.gateway.peer`). None: it is overnight's."""
    from pathlib import Path

    from overnight.worker.gateway import peer

    if socket is not None:
        return peer.socket_problem(Path(socket))
    return peer.tcp_problem(base_url)


def awaited_problem(base_url: str, socket: str | None, wait: float) -> str | None:
    """:func:`reach_problem`, asked again for up to ``wait`` seconds while there is one: a
    gateway starting (again, after a crash) is waited for, not held against the step."""
    deadline = time.monotonic() + wait
    while (problem := reach_problem(base_url, socket)) is not None:
        if time.monotonic() >= deadline:
            return problem
        time.sleep(0.1)
    return None


def mint(
    client: redis.Redis,
    keys: Keys,
    lease_id: str,
    lease_token: int,
    grant: Grant,
    ttl: float,
    gap: float,
) -> tuple[str, dict[str, str]]:
    """Write a new token for ``lease_id`` (whose gap is ``gap`` seconds: the gateway reports
    progress well within it); returns the token and the step's variables."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    fields: dict[FieldT, EncodableT] = {
        "lease_id": lease_id,
        "lease_token": str(lease_token),
        "envelope": grant.envelope,
        "task_id": grant.task_id or "",
        "prepaid": "1" if grant.prepaid else "0",
        "gap": repr(float(gap)),
    }
    if grant.max_calls is not None:
        fields["max_calls"] = grant.max_calls
    if grant.max_tokens is not None:
        fields["max_tokens"] = grant.max_tokens
    seconds = max(1, int(ttl))
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.lease_grant(lease_id), mapping=fields)
    pipe.expire(keys.lease_grant(lease_id), seconds)
    pipe.set(keys.gateway_token(digest(token)), lease_id, ex=seconds)
    pipe.execute()
    return token, step_env(grant.base_url, token)


def revoke(client: redis.Redis, keys: Keys, lease_id: str, token: str) -> None:
    """Delete the token and the grant: the gateway answers 401 from now on."""
    client.delete(keys.gateway_token(digest(token)), keys.lease_grant(lease_id))


@dataclass(frozen=True)
class Seen:
    """What the gateway last wrote for a lease: how long ago (seconds, on the Redis clock)
    a model was last at work for it, and why a call was refused."""

    progress_age: float | None
    refused: str | None


def watch(client: redis.Redis, keys: Keys, lease_id: str) -> Callable[[], Seen]:
    """A reader of the gateway's fields for the keeper (one round trip a call)."""
    key = keys.lease_grant(lease_id)

    def read() -> Seen:
        pipe = client.pipeline(transaction=False)
        pipe.hmget(key, "progress_ms", "refused")
        pipe.time()
        (progress, refused), (sec, usec) = pipe.execute()
        age = None
        if progress:
            now_ms = int(sec) * 1000 + int(usec) // 1000
            age = max(0.0, (now_ms - int(progress)) / 1000)
        text = refused.decode() if isinstance(refused, bytes) else refused
        return Seen(age, text or None)

    return read
