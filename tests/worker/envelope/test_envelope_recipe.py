"""The envelope recipe's own halt tests, as a user of the file-based recipe would port them.

Only the import line and the envelope's construction (a Redis client, not a file) differ
from the recipe: the loop still takes ``(kind, payload)`` steps and returns its log lines.
Each test runs on the private redis-server and on fakeredis.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from overnight import CallEnvelope, EnvelopeEmpty, run_agent_loop

PLAN = [
    ("model", "read the failing test"),
    ("tool", "pytest -q tests/test_parse.py"),
    ("model", "write the fix"),
    ("tool", "pytest -q"),
    ("model", "summarise the change"),
]


@pytest.fixture(params=["r", "fake"])
def redis_client(request: pytest.FixtureRequest) -> redis.Redis:
    client: redis.Redis = request.getfixturevalue(request.param)
    return client


def test_loop_halts_when_the_envelope_runs_out(redis_client: redis.Redis, namespace: str) -> None:
    envelope = CallEnvelope(redis_client, "recipe", namespace)
    envelope.reset(3)

    lines = run_agent_loop(envelope, PLAN)

    assert lines == [
        "model ok: read the failing test",
        "tool ok: pytest -q tests/test_parse.py",
        "model ok: write the fix",
        "halt: envelope empty; refused tool call; remaining=0",
    ]
    state = envelope.snapshot().model_dump()
    assert (state["remaining"], state["consumed_model"], state["consumed_tool"]) == (0, 2, 1)
    with pytest.raises(EnvelopeEmpty):
        envelope.try_consume("model")


def test_empty_reset_refuses_at_once(redis_client: redis.Redis, namespace: str) -> None:
    envelope = CallEnvelope(redis_client, "recipe", namespace)
    envelope.reset(0)

    lines = run_agent_loop(envelope, PLAN)

    assert lines == ["halt: envelope empty; refused model call; remaining=0"]
    state = envelope.snapshot().model_dump()
    assert (state["remaining"], state["consumed_model"], state["consumed_tool"]) == (0, 0, 0)
    with pytest.raises(EnvelopeEmpty) as refused:
        envelope.try_consume("tool")
    assert (refused.value.kind, refused.value.remaining) == ("tool", 0)


@pytest.mark.parametrize("budget", [3, 0])
def test_callable_payloads_after_the_halt_are_never_called(
    redis_client: redis.Redis, namespace: str, budget: int
) -> None:
    envelope = CallEnvelope(redis_client, "recipe", namespace)
    envelope.reset(budget)
    called: list[str] = []

    def payload(text: str) -> Callable[[], str]:
        def run() -> str:
            called.append(text)
            return text

        return run

    steps = [(kind, payload(text)) for kind, text in PLAN]
    lines = run_agent_loop(envelope, steps)

    ran = PLAN[:budget]
    assert called == [text for _, text in ran]
    assert lines.outputs == ran
    assert lines[:budget] == [f"{kind} ok: {text}" for kind, text in ran]
    refused = PLAN[budget][0]
    assert lines[budget:] == [f"halt: envelope empty; refused {refused} call; remaining=0"]
    assert isinstance(lines.halted, EnvelopeEmpty)
    assert lines.state is not None and lines.state.remaining == 0
