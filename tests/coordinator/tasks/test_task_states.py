"""The task lifecycle table, and every task script held to it on fakeredis and on real Redis.

For each script that changes a state, every (current state, target) pair is tried against a
record put in that state by hand: the script writes exactly when the table allows it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.tasks.states import (
    LIVE,
    SETTLED,
    TERMINAL,
    TRANSITIONS,
    State,
    legal,
    lua_prelude,
)
from overnight.coordinator.tasks.store import (
    Checkpoint,
    InFlight,
    Next,
    Runner,
    TaskIdTaken,
    TaskRefused,
    TaskStore,
)
from overnight.coordinator.tasks.taskfile import Rule, TaskSpec
from tests.helpers import ROOT

TOKEN = "tok"
LUA = ROOT / "coordinator" / "lua"


@pytest.fixture(params=["fake", "real"])
def client(request: pytest.FixtureRequest) -> redis.Redis:
    return request.getfixturevalue("fake" if request.param == "fake" else "r")  # type: ignore[no-any-return]


def test_the_sets() -> None:
    assert set(State) == TERMINAL | LIVE
    assert not TERMINAL & LIVE
    assert TERMINAL | {State.PAUSED} == SETTLED
    assert State.AGENT_FAILED in TERMINAL
    assert [s.value for s in State if s not in TERMINAL] == [
        "queued",
        "running",
        "paused_for_reconciliation",
    ]


@pytest.mark.parametrize(
    ("op", "source", "target", "ok"),
    [
        ("create", None, "queued", True),
        ("create", "expired", "queued", True),
        ("create", "paused_for_reconciliation", "queued", False),
        ("create", "running", "queued", False),
        ("claim", "queued", "running", True),
        ("claim", "paused_for_reconciliation", "running", False),
        ("save", "running", "running", True),
        ("save", "running", "agent_failed", True),
        ("save", "running", "paused_for_reconciliation", True),
        ("save", "running", "aborted", False),
        ("save", "running", "queued", True),  # the night ended (coordinator.tasks.stop)
        ("save", "finished_verified", "finished_verified", False),
        ("orphan", "running", "queued", True),
        ("orphan", "running", "expired", True),
        ("orphan", "running", "finished_verified", False),
        ("orphan", "queued", "queued", False),
        ("resume", "paused_for_reconciliation", "queued", True),
        ("resume", "running", "queued", False),
        ("abort", "queued", "aborted", True),
        ("abort", "running", "aborted", True),
        ("abort", "halted_stuck", "aborted", False),
        ("abort", "queued", "expired", False),
        ("save", "running", "no-such-state", False),
    ],
)
def test_legal(op: str, source: str | None, target: str, ok: bool) -> None:
    assert legal(op, source, target) is ok  # type: ignore[arg-type]


def test_nothing_leaves_a_terminal_state_but_a_new_submit_or_a_rerun() -> None:
    for op, rows in TRANSITIONS.items():
        for target, sources in rows.items():
            assert op in ("create", "rerun") or not sources & TERMINAL, op
            assert op not in ("create", "rerun") or target == State.QUEUED, op


def test_prelude_is_the_table_in_lua() -> None:
    text = lua_prelude("resume")
    assert text.startswith("local LEGAL = {queued = {paused_for_reconciliation = true}}\n")
    assert "agent_failed = true" in text.splitlines()[1]
    assert lua_prelude(None).startswith("local LEGAL = {}\n")


def _spec(tmp_path: Path) -> TaskSpec:
    return TaskSpec(
        assignment="x",
        workdir=str(tmp_path),
        agent=["true"],
        max_calls=3,
        verifier=[Rule(name="r", run=["true"])],
    )


def _put(client: redis.Redis, store: TaskStore, task_id: str, state: State, claimed: bool) -> None:
    """Force the record into ``state`` at attempt 1, its claim held under TOKEN or absent."""
    client.hset(store.keys.task(task_id), mapping={"state": state.value, "attempt": "1"})
    claim = store.keys.task_claim(task_id)
    if claimed:
        client.set(claim, TOKEN, px=60_000)
    else:
        client.delete(claim)


def _state(client: redis.Redis, store: TaskStore, task_id: str) -> str:
    return str(client.hget(store.keys.task(task_id), "state"))


def _try(call: Callable[[], object]) -> bool:
    try:
        call()
    except TaskRefused as exc:
        assert exc.reason in ("state", "illegal"), exc
        return False
    return True


def _write(store: TaskStore, op: str, task_id: str, target: State) -> Callable[[], object]:
    rec = store.get(task_id)
    assert rec is not None
    cp = Checkpoint()
    if op == "claim":
        return lambda: store.claim(task_id, 1, "other", 5.0, Runner())
    if op == "begin":
        flight = InFlight(turn=1, step=0, name="agent", request_id="b", started_unix=1.0)
        return lambda: store.begin(rec, TOKEN, Checkpoint(in_flight=flight), 5)
    if op == "save":
        return lambda: store.save(rec, TOKEN, Next(cp, target, "d"))
    if op == "orphan":
        return lambda: store.orphan(rec, Next(cp, target, "d"), 2)
    if op == "resume":
        return lambda: store.resume(rec, cp)
    return lambda: store.abort(task_id, "d")


TARGETS: dict[str, list[State]] = {
    "claim": [State.RUNNING],
    "begin": [State.RUNNING],
    "save": list(State),
    "orphan": list(State),
    "resume": [State.QUEUED],
    "abort": [State.ABORTED],
}


@pytest.mark.parametrize("op", sorted(TARGETS))
def test_each_script_writes_exactly_what_the_table_allows(
    client: redis.Redis, namespace: str, tmp_path: Path, op: str
) -> None:
    store = TaskStore(client, Keys(namespace))
    [rec] = store.create([_spec(tmp_path)], "q")
    for source in State:
        for target in TARGETS[op]:
            # The save script's holder keeps its claim whatever the state, so the refusals
            # seen are the table's, not a lost claim's.
            _put(client, store, rec.id, source, claimed=op in ("begin", "save"))
            wrote = _try(_write(store, op, rec.id, target))
            assert wrote is legal(op, source, target), (source, target)  # type: ignore[arg-type]
            assert _state(client, store, rec.id) == (target if wrote else source)


def test_create_refuses_to_replace_a_live_task(
    client: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    store = TaskStore(client, Keys(namespace))
    [rec] = store.create([_spec(tmp_path)], "q")
    spec = _spec(tmp_path).model_copy(update={"id": rec.id})
    for source in State:
        _put(client, store, rec.id, source, claimed=False)
        try:
            store.create([spec], "q")
            replaced = True
        except TaskIdTaken:
            replaced = False
        assert replaced is legal("create", source, State.QUEUED), source
        assert _state(client, store, rec.id) == (State.QUEUED if replaced else source)


def test_refusals_are_one_exception_with_a_reason(
    client: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    store = TaskStore(client, Keys(namespace))
    [rec] = store.create([_spec(tmp_path)], "q")

    def flying(request: str) -> Checkpoint:
        flight = InFlight(turn=1, step=0, name="agent", request_id=request, started_unix=1.0)
        return Checkpoint(in_flight=flight)

    def why(call: Callable[[], object]) -> str:
        with pytest.raises(TaskRefused) as info:
            call()
        assert info.value.task_id in (rec.id, "nope")
        return info.value.why

    assert why(lambda: store.claim("nope", 1, TOKEN, 5.0, Runner())) == "unknown"
    assert why(lambda: store.claim(rec.id, 2, TOKEN, 5.0, Runner())) == "stale-attempt"
    assert why(lambda: store.renew(rec.id, TOKEN, 5.0)) == "lost"
    store.claim(rec.id, 1, TOKEN, 5.0, Runner(pid=4242))
    assert why(lambda: store.claim(rec.id, 1, TOKEN, 5.0, Runner())) == "state:running"
    assert why(lambda: store.begin(rec, "other", flying("r0"), 3)) == "lost"
    begun = [store.begin(rec, TOKEN, flying(f"r{i}"), 2) for i in (0, 0, 1)]
    assert [b.calls_used for b in begun] == [1, 1, 2]
    assert begun[0].now <= begun[1].now <= begun[2].now
    assert why(lambda: store.begin(rec, TOKEN, flying("r2"), 2)) == "ceiling"
    in_flight = store.get(rec.id)
    assert in_flight is not None and in_flight.checkpoint == flying("r1"), "refusal wrote"
    assert store.uncharge(rec.id, TOKEN, "r1") == 1
    assert why(lambda: store.uncharge(rec.id, "other", "r0")) == "lost"
    cp = Checkpoint()
    assert why(lambda: store.save(rec, "other", Next(cp))) == "lost"
    assert why(lambda: store.save(rec, TOKEN, Next(cp, State.ABORTED))) == "illegal:aborted"
    assert why(lambda: store.orphan(rec, Next(cp, State.QUEUED), 2)) == "alive"
    assert why(lambda: store.drop_claim(rec.id, 2, 4242)) == "stale-attempt"
    assert why(lambda: store.drop_claim(rec.id, 1, 4243)) == "not-runner"
    store.drop_claim(rec.id, 1, 4242)
    assert why(lambda: store.drop_claim(rec.id, 1, 4242)) == "lost"
    assert why(lambda: store.resume(rec, cp)) == "state:running"
    store.abort(rec.id, "enough")
    assert why(lambda: store.abort(rec.id, "again")) == "state:aborted"
    taken = _spec(tmp_path).model_copy(update={"id": rec.id})
    store.create([taken], "q")
    with pytest.raises(TaskRefused) as info:
        store.create([taken], "q")
    assert isinstance(info.value, TaskIdTaken) and info.value.reason == "taken"
    assert str(info.value) == f"id {rec.id!r} names a task that is still live"


def test_every_state_changing_script_checks_the_table() -> None:
    for op in TRANSITIONS:
        text = (LUA / f"task_{op}.lua").read_text()
        assert "LEGAL" in text and "-- LEGAL, TERMINAL:" in text, op
