"""The call envelope: one budget of model and tool calls shared by every process naming it.

State is one Redis hash per envelope. Each transition is one Lua script,
``worker/lua/envelope_<op>.lua`` after the library ``envelope_lib.lua``, that checks every
precondition itself, so no interleaving of workers can overshoot the budget. An envelope
that was never reset is empty and an unreachable Redis refuses: the envelope fails closed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, cast

import redis
from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from overnight.config import defaults
from overnight.config.errors import OvernightError
from overnight.config.keys import Keys
from overnight.config.settings import NAME_RE
from overnight.worker.redisio.receipts import STREAM_MAXLEN
from overnight.worker.redisio.scripts import register
from overnight.worker.supervise import procs

if TYPE_CHECKING:
    from redis.commands.core import Script

    from overnight.config.settings import Settings

Kind = Literal["model", "tool"]
KINDS: tuple[Kind, ...] = ("model", "tool")
# Lua numbers are doubles: beyond 2**53 the scripts' comparisons would stop being exact.
MAX_UNITS = 2**53


class EnvelopeState(BaseModel):
    """What is left and what was spent. ``model_dump()`` is the CLI's state JSON."""

    remaining: int = 0
    consumed_model: int = 0
    consumed_tool: int = 0
    reserved_model: int = 0
    reserved_tool: int = 0
    max_model: int | None = None
    max_tool: int | None = None
    budget: int = 0
    # Tokens (input + output) metered by the gateway; no cap unless reset with one.
    max_tokens: int | None = None
    consumed_tokens: int = 0
    reserved_tokens: int = 0
    # False for an envelope that was never created (it refuses every call).
    exists: bool = True
    # True when a request id was seen before and this is its first answer, replayed.
    replayed: bool = Field(False, exclude=True)

    @model_serializer(mode="wrap")
    def _tokens_when_metered(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # The token fields appear once tokens are capped or spent (contract section 5).
        data: dict[str, Any] = handler(self)
        if self.max_tokens is None and not self.consumed_tokens and not self.reserved_tokens:
            for key in ("max_tokens", "consumed_tokens", "reserved_tokens"):
                data.pop(key, None)
        return data


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


@dataclass(frozen=True)
class Reservation:
    """Units held by :meth:`CallEnvelope.reserve` until committed or expired."""

    id: str
    kind: Kind
    units: int
    expires_ms: int
    state: EnvelopeState

    @property
    def member(self) -> str:
        """The reservation as the scripts store it."""
        return f"{self.id}:{self.kind}:{self.units}"


class CallEnvelope:
    """A named, shared budget of calls on one Redis; every method is one atomic script.

    ``redis_client`` may decode responses or not. ``namespace=None`` means the configured
    ``OVERNIGHT_NAMESPACE``. ``task_id``/``lease_id`` only label receipts.
    """

    def __init__(
        self,
        redis_client: redis.Redis,
        name: str = "default",
        namespace: str | None = None,
        *,
        request_ttl: int | None = None,
        task_id: str | None = None,
        lease_id: str | None = None,
    ) -> None:
        if not NAME_RE.match(name):
            raise ValueError(f"bad envelope name {name!r}: letters, digits, '.', '_', '-'")
        if namespace is None or request_ttl is None:
            settings = _settings(required=namespace is None)
            if namespace is None:
                namespace = settings.namespace if settings else defaults.NAMESPACE
            if request_ttl is None:
                request_ttl = settings.request_id_ttl if settings else defaults.REQUEST_ID_TTL
        self.client = redis_client
        self.name = name
        self.namespace = namespace
        self.keys = Keys(namespace)
        self.request_ttl = request_ttl
        k = self.keys
        self._keys = [k.envelope(name), k.envelope_reservations(name), k.receipts]
        # Receipt labels travel as one argument; scripts decode them only to write a receipt.
        labels = {
            "envelope": name,
            "host": procs.hostname(),
            "task_id": task_id,
            "lease_id": lease_id,
            "maxlen": STREAM_MAXLEN,
        }
        self._context: list[str | int] = [json.dumps(labels)]
        self._consume = _register(redis_client, "consume")
        self._reserve = _register(redis_client, "reserve")
        self._commit = _register(redis_client, "commit")
        self._reset = _register(redis_client, "reset")
        self._status = _register(redis_client, "status")

    @classmethod
    def from_settings(
        cls, name: str = "default", settings: Settings | None = None, **kwargs: Any
    ) -> CallEnvelope:
        """An envelope on ``OVERNIGHT_REDIS_URL`` in ``OVERNIGHT_NAMESPACE``."""
        from overnight.config.connection import connect
        from overnight.config.settings import load_settings

        settings = settings or load_settings()
        return cls(
            connect(settings),
            name,
            settings.namespace,
            request_ttl=settings.request_id_ttl,
            **kwargs,
        )

    def reset(
        self,
        n: int,
        *,
        max_model: int | None = None,
        max_tool: int | None = None,
        max_tokens: int | None = None,
    ) -> EnvelopeState:
        """Set ``remaining`` to ``n`` and the consumed counters to 0; caps are set or cleared.

        ``max_tokens`` caps the tokens (input + output) the gateway may spend; None: no cap.
        Open reservations are dropped. Raises ``ValueError`` for ``n < 0`` or a negative cap.
        """
        caps = (
            ("n", n),
            ("max_model", max_model),
            ("max_tool", max_tool),
            ("max_tokens", max_tokens),
        )
        for label, value in caps:
            if value is not None:
                _check_units(label, value, minimum=0)
        args = (
            *self._keys,
            *self._context,
            n,
            _opt(max_model),
            _opt(max_tool),
            "",
            _opt(max_tokens),
        )
        return self._run(self._reset, "reset", 3, args).state

    def create(self, n: int) -> bool:
        """:meth:`reset` to ``n`` only if the envelope does not exist; True if it was created.

        Atomic, so two coordinators starting together create it once and a restarted one
        never refills an envelope the night has been spending.
        """
        _check_units("n", n, minimum=0)
        args = (*self._keys, *self._context, n, "", "", "1")
        return self._run(self._reset, "reset", 3, args, refuse=False).allowed

    def snapshot(self) -> EnvelopeState:
        """The current state (all zero, ``exists`` False, for an envelope never created)."""
        reply = self._run(self._status, "status", 2, self._keys[:2], refuse=False)
        return reply.state.model_copy(update={"exists": reply.allowed})

    def try_consume(
        self,
        kind: str,
        request_id: str | None = None,
        *,
        units: int = 1,
        dry_run: bool = False,
    ) -> EnvelopeState:
        """Take ``units`` of ``kind`` (``model`` or ``tool``) or raise :class:`EnvelopeEmpty`.

        With ``request_id``, a repeat gets the first answer again (allowed or refused) and
        consumes nothing more, for ``request_ttl`` seconds. ``dry_run`` answers the same way
        but changes nothing. Raises :class:`EnvelopeUnavailable` if Redis cannot be asked.
        """
        _check_kind(kind)
        _check_units("units", units)
        dry = "1" if dry_run else "0"
        if request_id is None:
            args: tuple[str | int, ...] = (*self._keys, *self._context, kind, units, dry)
            return self._run(self._consume, kind, 3, args, units).state
        keys = self._keys_for(request_id)
        args = (*keys, *self._context, kind, units, dry, self.request_ttl, request_id)
        return self._run(self._consume, kind, 4, args, units).state

    def reserve(
        self, kind: str, units: int, *, ttl: float = 300.0, request_id: str | None = None
    ) -> Reservation:
        """Hold the worst case of a call before making it; settle with :meth:`commit`.

        If not committed within ``ttl`` seconds the units return to the envelope.
        Raises :class:`EnvelopeEmpty` when the worst case does not fit.
        """
        _check_kind(kind)
        _check_units("units", units)
        ttl_ms = int(ttl * 1000)
        if ttl_ms < 1:
            raise ValueError("ttl must be at least 1 ms")
        rsv_id = uuid.uuid4().hex
        keys = self._keys_for(request_id)
        args = (
            *keys,
            *self._context,
            kind,
            units,
            rsv_id,
            ttl_ms,
            self.request_ttl,
            request_id or "",
        )
        reply = self._run(self._reserve, kind, len(keys), args, units)
        member, expires = reply.extra
        rsv_id, _, _ = member.split(":")
        return Reservation(rsv_id, cast(Kind, kind), units, int(expires), reply.state)

    def commit(self, reservation: Reservation, actual: int) -> EnvelopeState:
        """Charge ``actual`` units (0..reserved) and give back the rest; once per reservation.

        Raises :class:`ReservationLost` if the reservation is no longer open.
        """
        _check_units("actual", actual, minimum=0, maximum=reservation.units)
        args: tuple[str | int, ...] = (*self._keys[:2], reservation.member, actual)
        reply = self._run(self._commit, reservation.kind, 2, args, refuse=False)
        if not reply.allowed:
            raise ReservationLost(reservation)
        return reply.state

    def release(self, reservation: Reservation) -> EnvelopeState:
        """Give a reservation back whole (the call was not made)."""
        return self.commit(reservation, 0)

    def guard(
        self, kind: str, request_id: str | None = None
    ) -> AbstractContextManager[EnvelopeState]:
        """``with envelope.guard("tool"):`` consumes one unit before the body, or raises."""
        return _guard(self, kind, request_id)

    def _keys_for(self, request_id: str | None) -> list[str]:
        if request_id is None:
            return self._keys
        if not request_id or len(request_id) > 256:
            raise ValueError("request_id must be 1-256 characters")
        return [*self._keys, self.keys.envelope_request(self.name, request_id)]

    def _run(
        self,
        script: Script,
        kind: str,
        numkeys: int,
        keys_and_args: Sequence[str | int],
        units: int = 1,
        *,
        refuse: bool = True,
    ) -> _Reply:
        try:
            keys = cast(Sequence[str], keys_and_args[:numkeys])
            raw = script(keys=keys, args=keys_and_args[numkeys:])
        except redis.RedisError as exc:
            raise EnvelopeUnavailable(kind, " ".join(str(exc).split())) from exc
        reply = _Reply.parse(raw)
        if reply.reason.startswith("bad-"):
            raise ValueError(f"envelope refused the arguments: {reply.reason}")
        if reply.reason == "corrupt":
            raise EnvelopeEmpty(kind, 0, reason="corrupt", units=units, name=self.name)
        if refuse and not reply.allowed:
            state = reply.state
            if reply.reason == "unknown":
                state = state.model_copy(update={"exists": False})
            raise EnvelopeEmpty(
                kind, state.remaining, reason=reply.reason, units=units, state=state, name=self.name
            )
        return reply


class _Reply(NamedTuple):
    allowed: bool
    reason: str
    state: EnvelopeState
    extra: tuple[str, str]

    @classmethod
    def parse(cls, raw: str | bytes) -> _Reply:
        """A script's JSON reply (the shape is in ``envelope_lib.lua``)."""
        doc: dict[str, Any] = json.loads(raw)
        fields: dict[str, str] | None = doc.get("state")
        if fields is None:
            return cls(False, doc["reason"], EnvelopeState(), ("", ""))
        # A validating __init__ is about twice as fast as model_construct here.
        state = EnvelopeState(
            remaining=_count(fields["remaining"]),
            consumed_model=_count(fields["consumed_model"]),
            consumed_tool=_count(fields["consumed_tool"]),
            reserved_model=_count(fields["reserved_model"]),
            reserved_tool=_count(fields["reserved_tool"]),
            max_model=_cap(fields["max_model"]),
            max_tool=_cap(fields["max_tool"]),
            budget=_count(fields["budget"]),
            max_tokens=_cap(fields["max_tokens"]),
            consumed_tokens=_count(fields["consumed_tokens"]),
            reserved_tokens=_count(fields["reserved_tokens"]),
            replayed=bool(doc.get("replayed")),
        )
        extra = (str(doc.get("member", "")), str(doc.get("expires_ms", "")))
        return cls(bool(doc["allowed"]), doc["reason"], state, extra)


def _count(field: str) -> int:
    return int(field) if field else 0


def _cap(field: str) -> int | None:
    return int(field) if field else None


@contextmanager
def _guard(envelope: CallEnvelope, kind: str, request_id: str | None) -> Iterator[EnvelopeState]:
    yield envelope.try_consume(kind, request_id)


def _register(client: redis.Redis, op: str) -> Script:
    return register(client, f"envelope_{op}", lib="envelope_lib")


def _settings(*, required: bool) -> Settings | None:
    from overnight.config.settings import ConfigError, load_settings

    try:
        return load_settings()
    except ConfigError:
        if required:
            raise
        return None


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be 'model' or 'tool', not {kind!r}")


def _check_units(label: str, value: int, *, minimum: int = 1, maximum: int = MAX_UNITS) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{label} must be a whole number, not {value!r}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{label} must be between {minimum} and {maximum}, not {value}")


def _opt(value: int | None) -> int | str:
    return "" if value is None else value
