"""The books agree whatever Redis does between a task's charge and the envelope's: a step
that cannot be charged to the envelope never starts and gives its task charge back; a step
that never started gives back both charges only while its task's charge is still its own;
the envelope charge is asked again, under its request id, while Redis refuses writes."""

from __future__ import annotations

import logging
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.config.settings import Settings
from overnight.coordinator.dispatch.job_config import envelope_consume
from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.coordinator.tasks.charge import unavailable
from overnight.coordinator.tasks.loop import Consume, LoopConfig, TaskLoop
from overnight.coordinator.tasks.steps import StepOutcome, StepRequest, plain_runner
from overnight.coordinator.tasks.store import Runner, TaskStore
from overnight.coordinator.tasks.taskfile import Rule, TaskSpec
from overnight.worker.envelope.envelope import CallEnvelope, EnvelopeEmpty, EnvelopeUnavailable
from tests.helpers import fill_redis, wait_for

PY = sys.executable


def _spec(tmp_path: Path) -> TaskSpec:
    return TaskSpec.model_validate(
        {
            "assignment": "make ok.txt",
            "workdir": str(tmp_path),
            "agent": [PY, "-c", "import pathlib; pathlib.Path('ok.txt').touch()"],
            "max_calls": 10,
            "verifier": [Rule(name="has-ok", run=["test", "-f", "ok.txt"])],
        }
    )


def _consume(r: redis.Redis, namespace: str, unavailable: bool) -> Consume:
    """The shared envelope's charge; ``unavailable``: Redis could not be asked in time (what
    the retrying consume raises once its patience is spent), whatever it did meanwhile."""

    def consume(name: str, kind: str, request_id: str) -> None:
        envelope = CallEnvelope(r, name, namespace)
        envelope.try_consume(kind, request_id=request_id)  # the spend may land...
        if unavailable:
            raise EnvelopeUnavailable(kind, "no reply")  # ...and its answer be lost

    return consume


def _consumed(r: redis.Redis, namespace: str) -> int:
    state = CallEnvelope(r, "default", namespace).snapshot()
    return state.consumed_model + state.consumed_tool


def _loop(
    r: redis.Redis, namespace: str, tmp_path: Path, consume: Consume, runner: Callable[..., object]
) -> tuple[TaskLoop, str]:
    store = TaskStore(r, Keys(namespace))
    CallEnvelope(r, "default", namespace).reset(10)
    [rec] = store.create([_spec(tmp_path)], queue="q")
    config = LoopConfig(claim_ttl=5, prompt_dir=tmp_path / "prompts")
    return TaskLoop(store, runner, consume, config), rec.id  # type: ignore[arg-type]


def test_a_step_the_envelope_cannot_charge_never_starts_and_gives_its_charge_back(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    loop, task_id = _loop(r, namespace, tmp_path, _consume(r, namespace, True), plain_runner)
    end = loop.run(task_id, 1, Runner(worker="test"))
    assert end.label == "lost"  # left to recovery, which runs the step again
    rec = loop.store.get(task_id)
    assert rec is not None and rec.state == "running" and rec.checkpoint.in_flight is not None
    assert not (tmp_path / "ok.txt").exists()  # the step never ran
    assert rec.calls_used == 0
    assert _consumed(r, namespace) == 1  # the lost answer's spend: the run again replays it


def test_the_benign_twin_charges_both_books_once_a_step(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    loop, task_id = _loop(r, namespace, tmp_path, _consume(r, namespace, False), plain_runner)
    assert loop.run(task_id, 1, Runner(worker="test")).label == "finished_verified"
    rec = loop.store.get(task_id)
    assert rec is not None and rec.calls_used == 2 == _consumed(r, namespace)


def _never_started(steal: bool, r: redis.Redis, namespace: str) -> Callable[..., StepOutcome]:
    """A runner whose step never starts; ``steal``: meanwhile another worker took the task."""

    def runner(req: StepRequest) -> StepOutcome:
        if steal:
            r.set(Keys(namespace).task_claim(req.task_id), "someone-else")
        return StepOutcome(127, "agent_failed", "worker-exit-127", None, "", "", started=False)

    return runner


def test_a_step_that_never_started_keeps_both_charges_once_its_claim_is_taken(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    consume = _consume(r, namespace, False)
    loop, task_id = _loop(r, namespace, tmp_path, consume, _never_started(True, r, namespace))
    loop.run(task_id, 1, Runner(worker="test"))
    rec = loop.store.get(task_id)
    # The new holder may be running that step under the same request id: both keep it.
    assert rec is not None and rec.calls_used == 1 == _consumed(r, namespace)


def test_the_benign_twin_gives_back_both_charges_of_a_step_that_never_started(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    consume = _consume(r, namespace, False)
    loop, task_id = _loop(r, namespace, tmp_path, consume, _never_started(False, r, namespace))
    loop.run(task_id, 1, Runner(worker="test"))
    rec = loop.store.get(task_id)
    assert rec is not None and rec.state == "agent_failed"
    assert rec.calls_used == 0 == _consumed(r, namespace)


def test_the_envelope_charge_waits_out_a_full_redis_and_is_made_once(
    redis_factory: Callable[..., EmbeddedRedis], namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_factory(
        password=uuid.uuid4().hex,
        extra_args=["--maxmemory", "16mb", "--maxmemory-policy", "noeviction"],
    )
    client = redis.Redis.from_url(server.url)
    CallEnvelope(client, "default", namespace).reset(5)
    consume = envelope_consume(client, namespace, "t1", Settings(redis_url=server.url))
    fill_redis(client)
    with pytest.raises(EnvelopeUnavailable, match="maxmemory"):  # the stall is real
        CallEnvelope(client, "default", namespace).try_consume("tool")
    done: list[BaseException | None] = []

    def charge() -> None:
        try:
            consume("default", "model", "t1:r:1:0")
        except BaseException as exc:
            done.append(exc)
        else:
            done.append(None)

    with caplog.at_level(logging.WARNING, logger="overnight.loop"):
        charging = threading.Thread(target=charge)
        charging.start()
        wait_for(lambda: "envelope default: Redis unavailable" in caplog.text, timeout=30)
        for key in client.scan_iter("filler:*", count=1000):
            client.delete(key)
        charging.join(timeout=90)
    assert done == [None]
    assert "Redis available again" in caplog.text
    consume("default", "model", "t1:r:1:0")  # asked again: its first answer, no new spend
    assert CallEnvelope(client, "default", namespace).snapshot().consumed_model == 1


def _cause(exc: BaseException | None) -> EnvelopeUnavailable:
    try:
        raise EnvelopeUnavailable("model", "asked") from exc
    except EnvelopeUnavailable as out:
        return out


@pytest.mark.parametrize(
    ("exc", "again"),
    [
        (_cause(redis.exceptions.OutOfMemoryError("OOM command not allowed")), True),
        (_cause(redis.ConnectionError("Connection reset by peer")), True),
        (_cause(redis.ResponseError("READONLY You can't write against a read only replica")), True),
        (_cause(None), True),  # no replica acknowledged the spend yet
        (_cause(redis.ResponseError("WRONGTYPE Operation against a key")), False),
        (EnvelopeEmpty("model", 0), False),
        (ValueError("bad"), False),
    ],
)
def test_what_the_envelope_charge_is_asked_again_for(exc: BaseException, again: bool) -> None:
    assert unavailable(exc) is again
