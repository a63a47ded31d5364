"""`overnight status` carries what the gateway charged each task: tokens_used (the task
record's count, held against max_tokens) and input_tokens / output_tokens from its ledger."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.report.tokens import ledger_tokens, with_tokens
from overnight.worker.redisio.receipts import Receipt, emit
from tests.helpers import OVERNIGHT, task_file


def _call(rid: str, task: str | None, inp: Any, out: Any, kind: str = "model_call") -> Receipt:
    return Receipt(
        id=rid, kind=kind, task_id=task, data={"input_tokens": inp, "output_tokens": out}
    )


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([], {"a": [0, 0], "b": [0, 0]}),
        ([_call("2000-0", "a", 11, 7), _call("2001-3", "a", 5, 1)], {"a": [16, 8], "b": [0, 0]}),
        ([_call("1999-9", "a", 11, 7)], {"a": [0, 0], "b": [0, 0]}),  # before a's submission
        ([_call("3000-0", "b", 4, 2)], {"a": [0, 0], "b": [4, 2]}),  # b submitted at 3000
        ([_call("2999-0", "b", 4, 2)], {"a": [0, 0], "b": [0, 0]}),
        ([_call("2500-0", "a", 3, 3, kind="lease_ended")], {"a": [0, 0], "b": [0, 0]}),
        ([_call("2500-0", "c", 3, 3), _call("2500-1", None, 3, 3)], {"a": [0, 0], "b": [0, 0]}),
        (
            [_call("2500-0", "a", None, "7"), _call("2500-1", "a", -4, True)],
            {"a": [0, 0], "b": [0, 0]},
        ),
    ],
)
def test_ledger_tokens_counts_a_tasks_own_calls_since_it_was_submitted(
    rows: list[Receipt], expected: dict[str, list[int]]
) -> None:
    assert ledger_tokens(rows, {"a": 2000, "b": 3000}) == expected


def test_token_fields_follow_max_calls() -> None:
    status = {"id": "t", "calls_used": 2, "max_calls": 5, "envelope": "default"}
    tokens: dict[str, int | None] = {
        "tokens_used": 18,
        "input_tokens": 11,
        "output_tokens": 7,
        "max_tokens": None,
    }
    assert list(with_tokens(status, tokens)) == [
        "id",
        "calls_used",
        "max_calls",
        "tokens_used",
        "input_tokens",
        "output_tokens",
        "max_tokens",
        "envelope",
    ]
    assert list(with_tokens({"id": "t"}, tokens))[-1] == "max_tokens"


def _cli(env: dict[str, str], *args: str) -> Any:
    done = subprocess.run(
        [OVERNIGHT, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_status_shows_the_tokens_the_gateway_charged(
    env: dict[str, str], tmp_path: Path, r: redis.Redis, namespace: str
) -> None:
    keys = Keys(namespace)
    # A model_call of an earlier task with the same id: not this one's.
    r.xadd(
        keys.receipts,
        {
            "kind": "model_call",
            "data": json.dumps(
                {"task_id": "metered", "data": {"input_tokens": 500, "output_tokens": 500}}
            ),
        },
        id="1000-0",
    )
    env = {**env, "OVERNIGHT_QUEUE": namespace}
    metered = task_file(tmp_path, "metered", ["true"], [["true"]], max_tokens=5000)
    plain = task_file(tmp_path, "plain", ["true"], [["true"]])
    subprocess.run(
        [OVERNIGHT, "submit", str(metered), str(plain)],
        env=env,
        check=True,
        capture_output=True,
        timeout=60,
    )
    # What the gateway's commit writes for two answered requests (one estimated: no usage).
    r.hincrby(keys.task("metered"), "tokens_used", 18 + 40)
    emit(
        r,
        keys,
        "model_call",
        task_id="metered",
        lease_id="l1",
        input_tokens=11,
        output_tokens=7,
        tokens=18,
    )
    emit(
        r,
        keys,
        "model_call",
        task_id="metered",
        lease_id="l1",
        input_tokens=0,
        output_tokens=0,
        tokens=40,
        estimated=True,
    )
    emit(r, keys, "model_call", task_id="other", lease_id="l2", input_tokens=3, output_tokens=3)

    one = _cli(env, "status", "metered")
    want = {"tokens_used": 58, "input_tokens": 11, "output_tokens": 7, "max_tokens": 5000}
    assert {k: one[k] for k in want} == want
    assert one["calls_used"] == 0 and one["state"] == "queued"

    listed = {row["id"]: row for row in _cli(env, "status")}
    assert {k: listed["metered"][k] for k in want} == want
    assert {k: listed["plain"][k] for k in want} == {
        "tokens_used": 0,
        "input_tokens": 0,
        "output_tokens": 0,
        "max_tokens": None,
    }
