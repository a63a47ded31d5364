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
from typing import TYPE_CHECKING, Any, cast

import redis

from overnight.config import defaults
from overnight.config.keys import Keys
from overnight.config.settings import NAME_RE
from overnight.worker.envelope.refusals import (
    EnvelopeEmpty,
    EnvelopeRefused,
    EnvelopeUnavailable,
    ReservationLost,
    refusal_message,
)
from overnight.worker.envelope.state import (
    KINDS,
    MAX_UNITS,
    RESERVATION_TTL,
    EnvelopeState,
    Kind,
    Reply,
    Reservation,
)
from overnight.worker.redisio.receipts import STREAM_MAXLEN
from overnight.worker.redisio.scripts import register
from overnight.worker.supervise import procs

if TYPE_CHECKING:
    from redis.commands.core import Script

    from overnight.config.settings import Settings

__all__ = [
    "KINDS",
    "MAX_UNITS",
    "CallEnvelope",
    "EnvelopeEmpty",
    "EnvelopeRefused",
    "EnvelopeState",
    "EnvelopeUnavailable",
    "Kind",
    "Reservation",
    "ReservationLost",
    "refusal_message",
]


class CallEnvelope:
    """A named, shared budget of calls on one Redis; every method is one atomic script.

    ``redis_client`` may decode responses or not. ``namespace=None`` means the configured
    ``OVERNIGHT_NAMESPACE``. ``task_id``/``lease_id`` only label receipts. With ``replicas``,
    a spend that lets a call go ahead (consume, reserve) must be acknowledged by that many
    replicas within ``replica_timeout`` seconds (WAIT), or the call is refused
    (:class:`EnvelopeUnavailable`): a failover then cannot forget a spend whose call was made.
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
        replicas: int = 0,
        replica_timeout: float = 1.0,
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
        self.replicas = replicas
        self.replica_timeout_ms = max(1, int(replica_timeout * 1000))
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
        self._refund = register(redis_client, "envelope_refund")

    @classmethod
    def from_settings(
        cls, name: str = "default", settings: Settings | None = None, **kwargs: Any
    ) -> CallEnvelope:
        """An envelope on ``OVERNIGHT_REDIS_URL`` in ``OVERNIGHT_NAMESPACE``, its spends
        acknowledged by ``OVERNIGHT_REDIS_WAIT_REPLICAS`` replicas."""
        from overnight.config.connection import connect, wait_replicas
        from overnight.config.settings import load_settings

        settings = settings or load_settings()
        kwargs.setdefault("replicas", wait_replicas(settings))
        kwargs.setdefault("replica_timeout", settings.redis_wait_timeout)
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
            return self._run(self._consume, kind, 3, args, units, ack=not dry_run).state
        keys = self._keys_for(request_id)
        args = (*keys, *self._context, kind, units, dry, self.request_ttl, request_id)
        return self._run(self._consume, kind, 4, args, units, ack=not dry_run).state

    def reserve(
        self,
        kind: str,
        units: int,
        *,
        ttl: float = RESERVATION_TTL,
        request_id: str | None = None,
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
        reply = self._run(self._reserve, kind, len(keys), args, units, ack=True)
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

    def refund(self, kind: str, request_id: str, *, units: int = 1) -> bool:
        """Give back the ``units`` of ``kind`` consumed under ``request_id`` for a call that
        was never made (an ``envelope_refunded`` receipt says so); True if they were. Once
        per charge: a request id that holds no allowed answer gives nothing back."""
        _check_kind(kind)
        _check_units("units", units)
        keys = self._keys_for(request_id)
        args = [*self._context, kind, units, request_id]
        try:
            return bool(self._refund(keys=[keys[0], keys[2], keys[3]], args=args))
        except redis.RedisError as exc:
            raise EnvelopeUnavailable(kind, " ".join(str(exc).split())) from exc

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
        ack: bool = False,
    ) -> Reply:
        """One script; with ``ack`` (a spend that lets a call go ahead) and ``replicas``, its
        WAIT too, on the same connection (WAIT counts that connection's writes)."""
        keys = cast(Sequence[str], keys_and_args[:numkeys])
        args = keys_and_args[numkeys:]
        acked = None
        try:
            if ack and self.replicas > 0:
                with self.client.pipeline(transaction=False) as pipe:
                    script(keys=keys, args=args, client=pipe)
                    pipe.wait(self.replicas, self.replica_timeout_ms)
                    raw, acked = pipe.execute()
            else:
                raw = script(keys=keys, args=args)
        except redis.RedisError as exc:
            raise EnvelopeUnavailable(kind, " ".join(str(exc).split())) from exc
        reply = Reply.parse(raw)
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
        if acked is not None and int(acked) < self.replicas:
            # The spend stands on the primary, but a failover now could forget it: the call
            # is refused, as when Redis cannot be asked (a retry under its request id
            # is charged once).
            raise EnvelopeUnavailable(
                kind,
                f"the spend was acknowledged by {int(acked)} of {self.replicas} replica(s) "
                f"within {self.replica_timeout_ms} ms (OVERNIGHT_REDIS_WAIT_REPLICAS)",
            )
        return reply


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
