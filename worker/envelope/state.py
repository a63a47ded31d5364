"""What an envelope holds (:class:`EnvelopeState`), a reservation of it, and the scripts'
JSON reply read into them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

Kind = Literal["model", "tool"]
KINDS: tuple[Kind, ...] = ("model", "tool")
# Lua numbers are doubles: beyond 2**53 the scripts' comparisons would stop being exact.
MAX_UNITS = 2**53
# Seconds a reservation holds its units unless given a ttl; uncommitted, they return after.
RESERVATION_TTL = 300.0


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


@dataclass(frozen=True)
class Reservation:
    """Units held by ``CallEnvelope.reserve`` until committed or expired."""

    id: str
    kind: Kind
    units: int
    expires_ms: int
    state: EnvelopeState

    @property
    def member(self) -> str:
        """The reservation as the scripts store it."""
        return f"{self.id}:{self.kind}:{self.units}"


class Reply(NamedTuple):
    """What an envelope script answered: allowed, its reason, the state it saw, and a
    reservation's member and expiry (empty strings otherwise)."""

    allowed: bool
    reason: str
    state: EnvelopeState
    extra: tuple[str, str]

    @classmethod
    def parse(cls, raw: str | bytes) -> Reply:
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
