"""The envelope's refusals: each a named :class:`OvernightError`, with its one-line message."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from overnight.config.errors import OvernightError
from overnight.worker.envelope.state import EnvelopeState

if TYPE_CHECKING:
    from overnight.worker.envelope.state import Reservation


class EnvelopeRefused(OvernightError):
    """A call was not allowed. Catch this to halt on any refusal, Redis outage included."""

    kind: str


class EnvelopeEmpty(EnvelopeRefused):
    """The envelope refused a call: empty, never reset, short of units, or a per-kind cap.

    ``reason`` is ``empty``, ``unknown``, ``short``, ``cap`` or ``corrupt`` (the record
    holds something that is not a count: refused until reset); ``state`` is the envelope
    as the refusing script saw it.
    """

    def __init__(
        self,
        kind: str,
        remaining: int,
        *,
        reason: str = "empty",
        units: int = 1,
        state: EnvelopeState | None = None,
        name: str | None = None,
    ) -> None:
        self.kind = kind
        self.remaining = remaining
        self.reason = reason
        self.units = units
        self.name = name
        self.state = state or EnvelopeState(remaining=remaining)
        super().__init__(refusal_message(kind, remaining, reason, units, self.state, name))

    def public(self) -> dict[str, Any]:
        """The CLI's error JSON (the contract's wording: an unknown envelope is empty)."""
        line = refusal_message(self.kind, self.remaining, self.reason, self.units, self.state)
        return {"error": line, "remaining": self.remaining, "kind": self.kind}


class EnvelopeUnavailable(EnvelopeRefused):
    """Redis could not be asked, so the call is refused (fail closed)."""

    def __init__(self, kind: str, detail: str) -> None:
        self.kind = kind
        self.remaining: int | None = None
        self.detail = detail
        super().__init__(f"envelope unavailable; refused {kind} call; Redis unreachable: {detail}")


class ReservationLost(OvernightError):
    """A commit found no open reservation: it expired (and was refunded), was already
    settled, or the envelope was reset since."""

    def __init__(self, reservation: Reservation) -> None:
        super().__init__(f"reservation {reservation.id} is no longer open")
        self.reservation = reservation


def refusal_message(
    kind: str,
    remaining: int,
    reason: str,
    units: int,
    state: EnvelopeState,
    name: str | None = None,
) -> str:
    """One line saying why a ``kind`` call was refused."""
    if reason == "unknown" and name is not None:
        return (
            f"envelope {name!r} does not exist (create it with `overnight envelope reset N` "
            f"or OVERNIGHT_BUDGET); refused {kind} call; remaining=0"
        )
    if reason == "short":
        what = f"short of {units} units"
    elif reason == "corrupt":
        what = "record is corrupt (reset it to repair)"
    elif reason == "cap":
        what = f"{kind} cap reached (max_{kind}={getattr(state, f'max_{kind}')})"
    else:
        what = "empty"
    return f"envelope {what}; refused {kind} call; remaining={remaining}"
