"""A step's call, charged twice and given back from both: to the task's own ``max_calls`` and
to the shared envelope, under one request id fixed by (task, run, turn, step).

The two books agree after every ending. The task is charged first (with the step saved as
in flight), then the envelope; an envelope that refuses or cannot be asked gives the task
charge back; a step that never started gives back both, but only while the task's charge is
still this worker's (a worker that lost the claim gives back neither: the next holder may
be running that step under the same request id). Every charge and give-back is asked again
while Redis cannot answer, and counts once however often it is asked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import redis

from overnight.config.errors import OvernightError
from overnight.coordinator.tasks.record import Checkpoint, TaskRecord
from overnight.coordinator.tasks.scripts import WRITE_PATIENCE
from overnight.coordinator.tasks.store import TaskRefused, TaskStore
from overnight.worker.envelope.refusals import EnvelopeRefused, EnvelopeUnavailable
from overnight.worker.redisio.clients import retry_transient, transient

log = logging.getLogger("overnight.loop")
T = TypeVar("T")


class CallRefused(OvernightError):
    """A call was refused: ``who`` is ``task`` (its max_calls) or ``envelope``."""

    def __init__(self, who: str, detail: str) -> None:
        super().__init__(detail)
        self.who = who
        self.detail = detail


# (envelope name, kind, request id) -> None, or raise CallRefused (refused), or
# EnvelopeUnavailable (it could not be asked, after its own retries).
Consume = Callable[[str, str, str], None]


def kind_of(step: int) -> str:
    """The envelope kind a step's call is charged as: the agent's a model call, a rule's a
    tool call."""
    return "model" if step == 0 else "tool"


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the envelope could not be asked for now: Redis away, full or
    failing over (a :func:`transient` cause), or no replica acknowledging yet (no cause);
    not a wrong answer that asking again would only repeat."""
    if not isinstance(exc, EnvelopeUnavailable):
        return False
    return exc.__cause__ is None or transient(exc.__cause__)


def asked_again(ask: Callable[[], T], name: str) -> T:
    """``ask()`` of the envelope ``name`` under a request id (so it counts once however often
    it is asked), asked again while :func:`unavailable` says so, for up to WRITE_PATIENCE."""
    return retry_transient(ask, f"envelope {name}", log, patience=WRITE_PATIENCE, when=unavailable)


def charge(
    store: TaskStore,
    token: str,
    consume: Consume,
    rec: TaskRecord,
    started: Checkpoint,
    request: str,
) -> float:
    """Charge the step in flight in ``started`` to the task (and save it as in flight), then
    to the shared envelope; returns the server time of the write. Raises CallRefused,
    EnvelopeUnavailable (the task charge given back), or TaskRefused if the claim is lost."""
    spec = rec.spec
    kind = kind_of(started.step)
    try:
        begun = store.begin(rec, token, started, spec.max_calls)
    except TaskRefused as exc:
        if exc.reason != "ceiling":
            raise
        detail = f"task max_calls ({spec.max_calls}) reached; refused {kind} call"
        raise CallRefused("task", detail) from None
    try:
        consume(spec.envelope, kind, request)
    except CallRefused:
        store.uncharge(rec.id, token, request)
        raise
    except EnvelopeUnavailable:
        # The step cannot start: its call goes back to the task, so that the step run again
        # (same request id) is charged once to both, whatever the envelope did.
        try:
            store.uncharge(rec.id, token, request)
        except (TaskRefused, redis.RedisError) as exc:
            log.warning("task %s: could not give back the call of %s: %s", rec.id, request, exc)
        raise
    return begun.now


def give_back(store: TaskStore, token: str, rec: TaskRecord, step: int, request: str) -> None:
    """A step that never started (or an agent that could not start) spent nothing: its call
    goes back to the task and then to the shared envelope, so both agree with what ran."""
    from overnight.worker.envelope.envelope import CallEnvelope

    try:
        store.uncharge(rec.id, token, request)
    except (TaskRefused, redis.RedisError) as exc:
        # The task keeps its charge, so the envelope keeps its own: a new holder of the
        # claim may be running the step under the same request id right now.
        log.warning("task %s: could not give back the call of %s: %s", rec.id, request, exc)
        return
    name = rec.spec.envelope
    envelope = CallEnvelope(store.client, name, store.keys.namespace, task_id=rec.id)
    try:
        asked_again(lambda: envelope.refund(kind_of(step), request), name)
    except (EnvelopeRefused, redis.RedisError) as exc:
        log.warning("task %s: envelope kept the call of %s: %s", rec.id, request, exc)
