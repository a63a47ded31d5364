"""The gateway's Redis side: who a token is, reserve before, commit after, progress.

Each operation is one Lua script (``worker/lua/gateway_*.lua``, the envelope's prelude
prepended), so a request's model unit and token hold are taken from the shared envelope and
the task's caps together or not at all, and settled once.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from overnight.config import defaults
from overnight.config.errors import OvernightError
from overnight.config.keys import Keys
from overnight.worker.gateway.grant import digest
from overnight.worker.redisio.receipts import STREAM_MAXLEN
from overnight.worker.redisio.scripts import register

if TYPE_CHECKING:
    import redis.asyncio as aioredis

CACHE_SIZE = 4096
# An unsettled hold (the gateway died mid-request) is given back to the envelope after this.
HOLD_TTL_MS = 3_600_000


@dataclass(frozen=True)
class Holder:
    """The lease a token stands for, and what labels its receipts."""

    lease_id: str
    envelope: str
    task_id: str | None
    gap: float
    context: str  # the receipt labels, as the scripts take them


@dataclass(frozen=True)
class Hold:
    """One request's reservation: ``tokens`` held, whether its unit was the prepaid one."""

    member: str
    tokens: int
    prepaid: bool


class Refused(OvernightError):
    """The request may not be forwarded: ``reason`` as the reserve script names it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail

    @property
    def status(self) -> int:
        """401 for a lease that has ended, 429 for a refusal of the budget."""
        if self.reason == "ended":
            return 401
        if self.reason == "unreplicated":
            return 503
        return 500 if self.reason == "bad-args" else 429


class Meter:
    """Reserve/commit/progress for the gateway on an asyncio Redis client (text replies)."""

    def __init__(
        self,
        client: aioredis.Redis,
        namespace: str,
        host: str,
        *,
        replicas: int = 0,
        wait_ms: int = 1000,
    ) -> None:
        self.client = client
        self.replicas, self.wait_ms = replicas, wait_ms
        self.keys = Keys(namespace)
        self.host = host
        self._reserve = register(client, "gateway_reserve", lib="envelope_lib")
        self._commit = register(client, "gateway_commit", lib="envelope_lib")
        self._extend = register(client, "gateway_extend", lib="envelope_lib")
        self._progress = register(client, "gateway_progress")
        self._cache: OrderedDict[str, Holder] = OrderedDict()

    async def holder(self, token: str) -> Holder | None:
        """Who ``token`` stands for, or None if it is unknown or its lease has ended."""
        key = digest(token)
        cached = self._cache.get(key)
        if cached is not None:
            # Who a token stands for never changes; whether its lease still runs is checked
            # by every reserve (and by :meth:`alive` for the routes that reserve nothing).
            self._cache.move_to_end(key)
            return cached
        found_id = await self.client.get(self.keys.gateway_token(key))
        if not found_id:
            return None
        lease_id = str(found_id)
        raw = cast(dict[str, str], await self.client.hgetall(self.keys.lease_grant(lease_id)))
        if not raw:
            return None
        task_id = raw.get("task_id") or None
        labels = {
            "envelope": raw.get("envelope", "default"),
            "host": self.host,
            "task_id": task_id,
            "lease_id": lease_id,
            "maxlen": STREAM_MAXLEN,
        }
        found = Holder(
            lease_id,
            raw.get("envelope") or "default",
            task_id,
            float(raw.get("gap") or defaults.HEARTBEAT_GAP),
            json.dumps(labels),
        )
        self._cache[key] = found
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return found

    async def alive(self, token: str) -> bool:
        """Whether ``token`` still names a lease (its key is deleted when the lease ends)."""
        return bool(await self.client.exists(self.keys.gateway_token(digest(token))))

    def _keys(self, who: Holder) -> list[str]:
        k = self.keys
        keys = [
            k.lease_grant(who.lease_id),
            k.lease(who.lease_id),
            k.envelope(who.envelope),
            k.envelope_reservations(who.envelope),
            k.receipts,
        ]
        if who.task_id:
            keys.append(k.task(who.task_id))
        return keys

    async def reserve(self, who: Holder, tokens: int, route: str) -> Hold:
        """Take one model unit and a hold of up to ``tokens``, or raise :class:`Refused`."""
        args: list[str | int] = [who.context, max(1, tokens), uuid.uuid4().hex, HOLD_TTL_MS, route]
        acked = None
        if self.replicas > 0:
            # WAIT counts the writes of its own connection: the script and it share one.
            single = self.client.client()
            try:
                res: list[Any] = await self._reserve(keys=self._keys(who), args=args, client=single)
                acked = int(await single.wait(self.replicas, self.wait_ms))
            finally:
                await single.aclose()
        else:
            res = await self._reserve(keys=self._keys(who), args=args)
        if int(res[0]) != 1:
            raise Refused(str(res[1]), str(res[2]))
        if acked is not None and acked < self.replicas:
            # The call is not made: its hold is settled as a refund at once.
            await self._give_back(who, Hold(str(res[4]), int(res[2]), str(res[3]) == "1"), route)
            raise Refused(
                "unreplicated",
                f"the ledger's replicas did not acknowledge the hold ({acked} of "
                f"{self.replicas} within {self.wait_ms} ms); refused",
            )
        return Hold(str(res[4]), int(res[2]), str(res[3]) == "1")

    async def extend(self, who: Holder, hold: Hold, chunk: int, route: str) -> Hold:
        """Hold ``chunk`` more tokens for a stream that outgrew its hold, or raise
        :class:`Refused` (the grant then refuses every later request too)."""
        k = self.keys
        keys = [
            k.lease_grant(who.lease_id),
            k.envelope(who.envelope),
            k.envelope_reservations(who.envelope),
            k.receipts,
        ]
        if who.task_id:
            keys.append(k.task(who.task_id))
        args: list[str | int] = [who.context, hold.member, chunk, HOLD_TTL_MS, route]
        res: list[Any] = await self._extend(keys=keys, args=args)
        if int(res[0]) != 1:
            raise Refused(str(res[1]), str(res[2]))
        return Hold(str(res[2]), hold.tokens + chunk, hold.prepaid)

    async def commit(
        self,
        who: Holder,
        hold: Hold,
        *,
        tokens: int,
        tools: int,
        refund: bool,
        data: dict[str, Any],
    ) -> int:
        """Settle ``hold``: charge ``tokens`` and ``tools`` tool units (or refund the unit of a
        request that was not answered) and write its ``model_call`` receipt; returns the tool
        units charged."""
        k = self.keys
        keys = [
            k.lease_grant(who.lease_id),
            k.envelope(who.envelope),
            k.envelope_reservations(who.envelope),
            k.receipts,
        ]
        if who.task_id:
            keys.append(k.task(who.task_id))
        flags = ("1" if refund else "0", "1" if hold.prepaid else "0")
        args: list[str | int] = [
            who.context,
            hold.member,
            max(0, tokens),
            max(0, tools),
            *flags,
            json.dumps(data),
        ]
        res: list[Any] = await self._commit(keys=keys, args=args)
        return int(res[1]) if int(res[0]) == 1 else 0

    async def _give_back(self, who: Holder, hold: Hold, route: str) -> None:
        """Refund ``hold`` of a request never sent upstream (its receipt says so)."""
        zero = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")
        data: dict[str, Any] = {
            "route": route,
            "model": "",
            "stream": False,
            "status": 503,
            **dict.fromkeys(zero, 0),
            "tokens": 0,
            "tool_calls": 0,
            "model_units": 0,
            "prepaid": hold.prepaid,
            "hold": hold.tokens,
            "duration_ms": 0.0,
            "disconnected": False,
            "estimated": False,
            "cut": False,
            "refunded": True,
        }
        await self.commit(who, hold, tokens=0, tools=0, refund=True, data=data)

    async def progress(self, who: Holder) -> None:
        """A model is at work for this lease (the keeper counts it as progress)."""
        await self._progress(keys=[self.keys.lease_grant(who.lease_id)], args=[])
