"""The call envelope's scripts, row by row of the contract, on fakeredis and on real Redis."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import fakeredis
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overnight.coordinator.night.embedded_redis import EmbeddedRedis, free_port
from overnight.worker.envelope.envelope import (
    CallEnvelope,
    EnvelopeEmpty,
    EnvelopeRefused,
    EnvelopeUnavailable,
    ReservationLost,
)
from overnight.worker.envelope.guards import Step, demo_steps, gated, reserving, run_agent_loop
from overnight.worker.redisio.receipts import read
from overnight.worker.redisio.scripts import register
from tests.helpers import wait_for


@pytest.fixture(params=["fake", "fake-bytes", "real", "real-bytes"])
def client(request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    decode = not request.param.endswith("bytes")
    if request.param.startswith("fake"):
        yield fakeredis.FakeRedis(decode_responses=decode)
        return
    server: EmbeddedRedis = request.getfixturevalue("redis_server")
    real = redis.Redis.from_url(server.url, decode_responses=decode)
    yield real
    real.close()


@pytest.fixture
def ev(client: redis.Redis, namespace: str) -> CallEnvelope:
    return CallEnvelope(client, "default", namespace)


def kinds_of(receipts: list[object]) -> list[str]:
    return [rc.kind for rc in receipts]  # type: ignore[attr-defined]


def test_consume_takes_one_from_the_shared_counter(ev: CallEnvelope) -> None:
    ev.reset(3)
    s1 = ev.try_consume("model")
    s2 = ev.try_consume("tool")
    assert (s1.remaining, s1.consumed_model, s1.consumed_tool) == (2, 1, 0)
    assert (s2.remaining, s2.consumed_model, s2.consumed_tool) == (1, 1, 1)
    assert ev.snapshot().model_dump()["remaining"] == 1


def test_empty_refuses_and_leaves_remaining_unchanged(ev: CallEnvelope) -> None:
    ev.reset(1)
    ev.try_consume("tool")
    with pytest.raises(EnvelopeEmpty) as info:
        ev.try_consume("model")
    assert str(info.value) == "envelope empty; refused model call; remaining=0"
    assert (info.value.kind, info.value.remaining, info.value.reason) == ("model", 0, "empty")
    assert info.value.public() == {
        "error": "envelope empty; refused model call; remaining=0",
        "remaining": 0,
        "kind": "model",
    }
    snap = ev.snapshot()
    assert (snap.remaining, snap.consumed_model, snap.consumed_tool) == (0, 0, 1)
    refused = [rc for rc in read(ev.client, ev.keys) if rc.kind == "envelope_refused"]
    assert len(refused) == 1
    assert refused[0].data == {
        "envelope": "default",
        "kind": "model",
        "units": 1,
        "reason": "empty",
        "remaining": 0,
    }


def test_reset_sets_remaining_and_zeroes_counters(ev: CallEnvelope) -> None:
    ev.reset(5)
    ev.try_consume("model")
    ev.try_consume("tool")
    state = ev.reset(7)
    assert state.model_dump() == {
        "remaining": 7,
        "consumed_model": 0,
        "consumed_tool": 0,
        "reserved_model": 0,
        "reserved_tool": 0,
        "max_model": None,
        "max_tool": None,
        "budget": 7,
        "exists": True,
    }
    resets = [rc for rc in read(ev.client, ev.keys) if rc.kind == "envelope_reset"]
    assert [rc.data["budget"] for rc in resets] == [5, 7]
    assert resets[1].data["previous_remaining"] == 3


def test_reset_zero_refuses_at_once(ev: CallEnvelope) -> None:
    ev.reset(0)
    with pytest.raises(EnvelopeEmpty):
        ev.try_consume("tool")


def test_never_reset_envelope_is_empty(ev: CallEnvelope) -> None:
    assert ev.snapshot().remaining == 0
    with pytest.raises(EnvelopeEmpty) as info:
        ev.try_consume("model")
    assert str(info.value).startswith("envelope 'default' does not exist (create it with")
    assert info.value.public()["error"] == "envelope empty; refused model call; remaining=0"
    assert info.value.reason == "unknown" and ev.snapshot().exists is False
    assert not ev.client.exists(ev.keys.envelope("default"))
    assert kinds_of(read(ev.client, ev.keys)) == ["envelope_refused"]  # type: ignore[arg-type]


def test_negative_reset_and_bad_units_are_value_errors(ev: CallEnvelope) -> None:
    ev.reset(2)
    for bad in (-1, 2**60):
        with pytest.raises(ValueError):
            ev.reset(bad)
    with pytest.raises(ValueError):
        ev.reset(3, max_model=-1)
    for units in (0, -3):
        with pytest.raises(ValueError):
            ev.try_consume("model", units=units)
    assert ev.snapshot().remaining == 2


def test_unknown_kind_is_a_value_error(ev: CallEnvelope) -> None:
    ev.reset(2)
    with pytest.raises(ValueError, match="kind"):
        ev.try_consume("image")
    assert ev.snapshot().remaining == 2


def test_scripts_check_their_own_preconditions(ev: CallEnvelope, client: redis.Redis) -> None:
    ev.reset(2)
    consume = register(client, "envelope_consume", lib="envelope_lib")
    ctx = ['{"envelope": "default", "maxlen": 1000}']
    keys = [ev.keys.envelope("default"), ev.keys.envelope_reservations("default"), "r"]

    def reason(raw: str | bytes) -> str:
        doc = json.loads(raw)
        assert doc["allowed"] is False
        return str(doc["reason"])

    for bad_kind, units, why in (("image", 1, "bad-kind"), ("model", 0, "bad-units")):
        assert reason(consume(keys=keys, args=[*ctx, bad_kind, units, "0"])) == why
    reset = register(client, "envelope_reset", lib="envelope_lib")
    assert reason(reset(keys=keys, args=[*ctx, -1, "", ""])) == "bad-units"
    commit = register(client, "envelope_commit", lib="envelope_lib")
    rsv = ev.reserve("tool", 1)
    assert reason(commit(keys=keys[:2], args=[rsv.member, 2])) == "bad-actual"
    assert reason(commit(keys=keys[:2], args=["x:tool:1", 1])) == "unknown"
    assert ev.snapshot().remaining == 1


@pytest.mark.parametrize(
    "corruption", [{"remaining": "abc"}, {"consumed_tool": "1.5"}, {"max_model": "{"}, "str"]
)
def test_a_corrupt_record_is_refused_untouched_until_reset(
    ev: CallEnvelope, corruption: dict[str, str] | str
) -> None:
    key = ev.keys.envelope("default")
    if isinstance(corruption, dict):
        ev.reset(3)
        ev.client.hset(key, mapping=corruption)
    else:
        ev.client.set(key, corruption)
    raw = ev.client.dump(key)
    for attempt in (
        lambda: ev.try_consume("model"),
        lambda: ev.reserve("tool", 1),
        lambda: ev.snapshot(),
    ):
        with pytest.raises(EnvelopeEmpty) as info:
            attempt()
        assert info.value.reason == "corrupt" and "corrupt" in str(info.value)
    assert ev.client.dump(key) == raw
    assert ev.reset(2).remaining == 2
    assert ev.try_consume("model").remaining == 1


def test_repeated_request_id_gets_the_first_answer(ev: CallEnvelope) -> None:
    ev.reset(2)
    first = ev.try_consume("model", "req-1")
    again = ev.try_consume("model", "req-1")
    assert not first.replayed and again.replayed
    assert again.model_dump() == first.model_dump()
    assert ev.snapshot().remaining == 1
    ttl = ev.client.ttl(ev.keys.envelope_request("default", "req-1"))
    assert 86_000 < ttl <= 86_400


def test_a_refused_first_answer_is_replayed_as_refused(ev: CallEnvelope) -> None:
    ev.reset(0)
    with pytest.raises(EnvelopeEmpty):
        ev.try_consume("tool", "late")
    ev.reset(5)
    with pytest.raises(EnvelopeEmpty) as info:
        ev.try_consume("tool", "late")
    assert info.value.state.replayed
    assert ev.snapshot().remaining == 5


def test_request_ids_expire_on_their_own(client: redis.Redis, namespace: str) -> None:
    ev = CallEnvelope(client, "short", namespace, request_ttl=1)
    ev.reset(3)
    ev.try_consume("model", "r")
    key = ev.keys.envelope_request("short", "r")
    assert 0 < client.pttl(key) <= 1000
    wait_for(lambda: not client.exists(key), timeout=5)
    ev.try_consume("model", "r")
    assert ev.snapshot().remaining == 1


def test_dry_run_answers_and_changes_nothing(ev: CallEnvelope) -> None:
    ev.reset(1)
    before = ev.client.hgetall(ev.keys.envelope("default"))
    stream_len = ev.client.xlen(ev.keys.receipts)
    assert ev.try_consume("model", "dry", dry_run=True).remaining == 1
    assert ev.client.hgetall(ev.keys.envelope("default")) == before
    assert not ev.client.exists(ev.keys.envelope_request("default", "dry"))
    ev.try_consume("model")
    with pytest.raises(EnvelopeEmpty):
        ev.try_consume("tool", dry_run=True)
    assert ev.client.xlen(ev.keys.receipts) == stream_len
    assert ev.snapshot().remaining == 0


def test_per_kind_caps_live_in_the_same_envelope(ev: CallEnvelope) -> None:
    state = ev.reset(10, max_model=2, max_tool=3)
    assert (state.max_model, state.max_tool) == (2, 3)
    ev.try_consume("model")
    ev.try_consume("model")
    with pytest.raises(EnvelopeEmpty) as info:
        ev.try_consume("model")
    assert info.value.reason == "cap"
    assert (
        str(info.value)
        == "envelope model cap reached (max_model=2); refused model call; remaining=8"
    )
    assert ev.try_consume("tool").remaining == 7
    assert ev.reset(4).max_model is None


def test_reserve_then_commit_refunds_the_difference(ev: CallEnvelope) -> None:
    ev.reset(20)
    rsv = ev.reserve("model", 10)
    assert (rsv.state.remaining, rsv.state.reserved_model) == (10, 10)
    state = ev.commit(rsv, 4)
    assert (state.remaining, state.consumed_model, state.reserved_model) == (16, 4, 0)
    with pytest.raises(ReservationLost):
        ev.commit(rsv, 4)
    with pytest.raises(ValueError):
        ev.commit(ev.reserve("tool", 2), 3)
    assert ev.snapshot().remaining == 14


def test_reservations_make_overshoot_impossible(ev: CallEnvelope) -> None:
    ev.reset(10)
    held = ev.reserve("model", 6)
    with pytest.raises(EnvelopeEmpty) as info:
        ev.reserve("tool", 6)
    assert info.value.reason == "short" and info.value.remaining == 4
    ev.try_consume("tool", units=4)
    with pytest.raises(EnvelopeEmpty):
        ev.try_consume("tool")
    state = ev.commit(held, 6)
    assert state.remaining == 0 and state.consumed_model + state.consumed_tool == 10


def test_caps_count_open_reservations(ev: CallEnvelope) -> None:
    ev.reset(100, max_model=5)
    ev.reserve("model", 4)
    with pytest.raises(EnvelopeEmpty) as info:
        ev.try_consume("model", units=2)
    assert info.value.reason == "cap"


def test_an_expired_reservation_is_refunded_by_the_next_script(ev: CallEnvelope) -> None:
    ev.reset(10)
    rsv = ev.reserve("tool", 7, ttl=0.05)
    assert ev.client.zcard(ev.keys.envelope_reservations("default")) == 1
    state = wait_for(lambda: (s := ev.snapshot()).reserved_tool == 0 and s, timeout=5)
    assert (state.remaining, state.consumed_tool) == (10, 0)
    with pytest.raises(ReservationLost):
        ev.commit(rsv, 7)
    assert ev.snapshot().remaining == 10
    rsv2 = ev.reserve("tool", 10, ttl=0.05)
    wait_for(
        lambda: (
            ev.client.zscore(ev.keys.envelope_reservations("default"), rsv2.member)
            and ev.client.time()[0] * 1000 + ev.client.time()[1] // 1000 > rsv2.expires_ms
        ),
        timeout=5,
    )
    assert ev.try_consume("tool", units=10).remaining == 0


def test_reset_drops_open_reservations(ev: CallEnvelope) -> None:
    ev.reset(10)
    rsv = ev.reserve("model", 5)
    ev.reset(3)
    with pytest.raises(ReservationLost):
        ev.commit(rsv, 0)
    assert ev.snapshot().remaining == 3


def test_reserve_with_request_id_returns_the_same_reservation(ev: CallEnvelope) -> None:
    ev.reset(10)
    a = ev.reserve("model", 4, request_id="big-call")
    b = ev.reserve("model", 4, request_id="big-call")
    assert a.id == b.id and b.state.replayed
    assert ev.snapshot().remaining == 6


def test_redis_unreachable_refuses_with_its_own_error() -> None:
    down = redis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1)
    ev = CallEnvelope(down, "default", "ns")
    with pytest.raises(EnvelopeUnavailable) as info:
        ev.try_consume("model")
    assert isinstance(info.value, EnvelopeRefused) and not isinstance(info.value, EnvelopeEmpty)
    assert info.value.kind == "model" and "\n" not in str(info.value)


def test_namespaces_are_separate(client: redis.Redis, namespace: str) -> None:
    a = CallEnvelope(client, "default", namespace + "-a")
    b = CallEnvelope(client, "default", namespace + "-b")
    a.reset(5)
    with pytest.raises(EnvelopeEmpty):
        b.try_consume("model")
    assert a.snapshot().remaining == 5


def test_namespace_none_means_the_configured_one(
    env: dict[str, str], redis_server: EmbeddedRedis, namespace: str
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    assert CallEnvelope(client).namespace == namespace
    from_env = CallEnvelope.from_settings("x")
    from_env.reset(1)
    assert CallEnvelope(client, "x").try_consume("tool").remaining == 0
    client.close()


def test_bad_envelope_name_is_a_value_error(client: redis.Redis) -> None:
    with pytest.raises(ValueError):
        CallEnvelope(client, "a b", "ns")


def test_gated_functions_are_not_called_once_refused(ev: CallEnvelope) -> None:
    ev.reset(1)
    calls: list[str] = []

    @gated(ev, "model")
    def ask(prompt: str) -> str:
        calls.append(prompt)
        return prompt.upper()

    @gated(ev, "tool", request_id=lambda path: f"read:{path}")
    def read_file(path: str) -> str:
        calls.append(path)
        return "text"

    assert ask("hi") == "HI"
    with pytest.raises(EnvelopeEmpty):
        ask("again")
    with pytest.raises(EnvelopeEmpty):
        read_file("a.txt")
    assert calls == ["hi"]
    with pytest.raises(ValueError):
        gated(ev, "image")


def test_guard_context_manager_consumes_before_the_body(ev: CallEnvelope) -> None:
    ev.reset(1)
    with ev.guard("tool") as state:
        assert state.remaining == 0
    ran = False
    with pytest.raises(EnvelopeEmpty), ev.guard("tool"):
        ran = True
    assert not ran


def test_reserving_charges_actual_or_the_worst_case(ev: CallEnvelope) -> None:
    ev.reset(100)
    with reserving(ev, "model", 30) as hold:
        assert ev.snapshot().remaining == 70
        hold.actual = 12
    assert hold.state is not None and hold.state.remaining == 88
    with pytest.raises(RuntimeError), reserving(ev, "tool", 20):
        raise RuntimeError("call failed midway")
    snap = ev.snapshot()
    assert (snap.remaining, snap.consumed_tool, snap.reserved_tool) == (68, 20, 0)


def test_agent_loop_halts_at_the_first_refusal(
    ev: CallEnvelope, caplog: pytest.LogCaptureFixture
) -> None:
    ev.reset(3)
    ran: list[int] = []
    steps = [
        Step(s.kind, lambda i=i, s=s: (ran.append(i), s.call())[1])
        for i, s in enumerate(demo_steps())
    ]
    with caplog.at_level(logging.INFO, logger="overnight.envelope"):
        result = run_agent_loop(ev, steps)
    assert ran == [0, 1, 2]
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[0] for line in lines] == ["model ok", "tool ok", "model ok", "halt"]
    assert lines[-1] == "halt: envelope empty; refused tool call; remaining=0"
    assert isinstance(result.halted, EnvelopeEmpty)
    assert result.state is not None and result.state.remaining == 0


def test_agent_loop_with_request_prefix_is_not_charged_twice(ev: CallEnvelope) -> None:
    ev.reset(10)
    out: list[str] = []
    run_agent_loop(ev, demo_steps(), echo=out.append, request_prefix="loop-1")
    rerun = run_agent_loop(ev, demo_steps(), echo=out.append, request_prefix="loop-1")
    assert rerun.halted is None and len(out) == 10
    assert ev.snapshot().remaining == 5


_op = st.one_of(
    st.tuples(st.just("consume"), st.sampled_from(["model", "tool"]), st.integers(1, 4)),
    st.tuples(st.just("reserve"), st.sampled_from(["model", "tool"]), st.integers(1, 6)),
    st.tuples(st.just("commit"), st.integers(0, 5), st.integers(0, 6)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budget=st.integers(0, 20), ops=st.lists(_op, max_size=25))
def test_units_always_add_up_to_the_budget(budget: int, ops: list[tuple[str, object, int]]) -> None:
    ev = CallEnvelope(fakeredis.FakeRedis(), "p", "prop")
    ev.reset(budget)
    held = []
    allowed = 0
    for op, a, b in ops:
        try:
            if op == "consume":
                ev.try_consume(str(a), units=b)
                allowed += b
            elif op == "reserve":
                held.append(ev.reserve(str(a), b))
            elif held:
                rsv = held.pop(int(a) % len(held))
                ev.commit(rsv, min(b, rsv.units))
                allowed += min(b, rsv.units)
        except EnvelopeEmpty:
            pass
        s = ev.snapshot()
        spent = s.consumed_model + s.consumed_tool
        assert s.remaining >= 0
        assert s.remaining + spent + s.reserved_model + s.reserved_tool == budget
        assert spent == allowed
