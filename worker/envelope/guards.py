"""Guards for the places calls happen, so the envelope cannot be forgotten.

``gated`` wraps a model client or tool function, ``reserving`` holds the worst case of a
weighted call and settles it afterwards, and ``run_agent_loop`` runs planned steps until
the first refusal.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple, ParamSpec, TypeVar

from overnight.worker.envelope.envelope import (
    CallEnvelope,
    EnvelopeRefused,
    EnvelopeState,
    EnvelopeUnavailable,
    Reservation,
)
from overnight.worker.envelope.state import RESERVATION_TTL

P = ParamSpec("P")
R = TypeVar("R")
log = logging.getLogger("overnight.envelope")


def gated(
    envelope: CallEnvelope,
    kind: str,
    *,
    units: int = 1,
    request_id: Callable[P, str] | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate ``fn`` so every call first takes ``units`` of ``kind`` from ``envelope``.

    A refused call raises (:class:`~worker.envelope.envelope.EnvelopeEmpty` or
    :class:`~worker.envelope.envelope.EnvelopeUnavailable`) and ``fn`` is not called.
    ``request_id``,
    given the call's arguments, names the call so a retry is not charged twice.
    """
    if kind not in ("model", "tool"):
        raise ValueError(f"kind must be 'model' or 'tool', not {kind!r}")

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            rid = request_id(*args, **kwargs) if request_id else None
            envelope.try_consume(kind, rid, units=units)
            return fn(*args, **kwargs)

        return wrapper

    return decorate


@dataclass
class Hold:
    """An open reservation inside :func:`reserving`; set ``actual`` to what the call used."""

    reservation: Reservation
    actual: int | None = None
    state: EnvelopeState | None = None


@contextmanager
def reserving(
    envelope: CallEnvelope,
    kind: str,
    units: int,
    *,
    ttl: float = RESERVATION_TTL,
    request_id: str | None = None,
) -> Iterator[Hold]:
    """Reserve ``units`` before the body and commit ``hold.actual`` after it.

    If the body does not set ``actual`` (or raises before it does) the whole reservation is
    charged: a call that may have spent is never refunded by guesswork. Choose ``ttl`` longer
    than the call, since an expired reservation is refunded.
    """
    hold = Hold(envelope.reserve(kind, units, ttl=ttl, request_id=request_id))
    try:
        yield hold
    finally:
        spent = units if hold.actual is None else hold.actual
        hold.state = envelope.commit(hold.reservation, spent)


class Step(NamedTuple):
    """One planned call: its kind and its payload, run only once the envelope allows it.

    A callable payload is called and its return value is the step's output; any other
    payload is the output itself (``("model", "summarise the diff")``).
    """

    kind: str
    call: object


class LoopResult(list[str]):
    """How :func:`run_agent_loop` ended: its log lines, in order, plus what they came from.

    As a list it holds the lines (``model ok: …``, ``tool ok: …``, ``halt: …``);
    ``outputs`` has each run step's ``(kind, output)``, ``halted`` the refusal (or None) and
    ``state`` the envelope read back after the loop (None if Redis did not answer).
    """

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[str, object]] = []
        self.halted: EnvelopeRefused | None = None
        self.state: EnvelopeState | None = None


def run_agent_loop(
    envelope: CallEnvelope,
    steps: Iterable[Step | tuple[str, object]],
    *,
    echo: Callable[[str], None] | None = None,
    request_prefix: str | None = None,
) -> LoopResult:
    """Run ``steps`` in order, each only after the envelope allowed it; stop at the first refusal.

    ``steps`` are ``(kind, payload)`` pairs (see :class:`Step`). Each step that runs adds
    ``<kind> ok: <output>``; a refusal adds ``halt: <why>`` and no later step runs. The
    returned :class:`LoopResult` is the list of those lines; each line also goes to ``echo``
    (default: the ``overnight.envelope`` logger). With ``request_prefix``, step ``i``
    consumes as request ``<prefix>:<i>``, so a rerun of the same loop is not charged again
    for steps already allowed.
    """
    say = echo or log.info
    result = LoopResult()

    def line(text: str) -> None:
        result.append(text)
        say(text)

    for i, (kind, payload) in enumerate(steps):
        rid = f"{request_prefix}:{i}" if request_prefix else None
        try:
            envelope.try_consume(kind, rid)
        except EnvelopeRefused as exc:
            line(f"halt: {exc}")
            result.halted = exc
            break
        output = payload() if callable(payload) else payload
        result.outputs.append((kind, output))
        line(f"{kind} ok: {output}")
    try:
        result.state = envelope.snapshot()
    except EnvelopeUnavailable:
        result.state = None
    return result


def demo_steps() -> list[Step]:
    """The contract's five planned steps (model, tool, model, tool, model), with stub calls."""
    plan = ["model", "tool", "model", "tool", "model"]
    return [Step(kind, _stub(kind, i + 1)) for i, kind in enumerate(plan)]


def _stub(kind: str, n: int) -> Callable[[], object]:
    if kind == "model":
        return lambda: f"echo: step {n} planned"
    return lambda: f"tool step {n} ran"
