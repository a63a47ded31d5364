"""Keeping one lease from the supervisor's side while its child runs.

It renews the lease (a beat) when progress was seen since the last renewal and at least
``renew_interval`` (``gap/3``, less on a gap under 10 s) has passed since it (every
``renew_interval`` while the child merely being alive counts), looks at the lease when it
could have lapsed, rides out a Redis outage for up to the gap (fail closed after that, and
always before Redis could let the lease lapse: recovery may then run the task elsewhere),
and says when the step must end and why (a :class:`worker.supervise.outcome.Outcome`).

Renewing every ``gap/3`` rather than on every line keeps beats cheap for Redis and costs
the gap no precision: it is judged here, on every line. A
step that keeps showing progress leaves its liveness key at least ``2*gap/3`` when a
renewal is due, so a failed one is retried (every ``retry_interval``) long before the key
could lapse; one silent for most of the gap is renewed at its next line, as before.
``heartbeat_unix`` in Redis is the last renewal, never more than ``gap/3`` behind the last
progress seen here while Redis answers; the key lapses exactly at ``heartbeat_unix + gap``
(or the deadline), so no sooner than the step's gap runs out here. What it costs: an
outage that begins just before a renewal is ridden out for ``2*gap/3`` less the io budget
(17 s at gap 30 s), not ``gap`` less 0.25 s and the io budget; and a liveness key deleted
in Redis is noticed at the next renewal, up to ``gap/3`` later.
It never sleeps: :meth:`Keeper.next_wake` tells the supervisor's poll loop when to call
:meth:`Keeper.tick` again.

The limits are the supervisor's own: the deadline (acquire time + budget) and the gap (last
progress seen here + gap) run on its monotonic clock from the spec it was given. Redis can
only end a step sooner (its liveness key gone, the lease ended elsewhere), never later: a
``deadline_unix`` or a TTL pushed ahead by whoever holds the token changes nothing here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from overnight.worker.beat.batch import Seat
from overnight.worker.gateway.grant import Seen
from overnight.worker.lease.store import LeaseCorrupt, LeaseDoc, LeaseRefused, Leases, lapsed_reason
from overnight.worker.redisio.clients import io_timeout, redis_errors
from overnight.worker.supervise import outcome
from overnight.worker.supervise.outcome import Outcome

if TYPE_CHECKING:
    from overnight.worker.supervise.limitwatch import Guard

log = logging.getLogger("overnight.supervisor")


class Keeper:
    """The supervisor's hold on one running lease (``doc``, just acquired at ``now``).

    ``deadline`` and ``gap`` are the spec's budget and gap in seconds; progress is only what
    this process sees (output, beats on the step's channel, the gateway's word), never a
    heartbeat read back from Redis, which the step cannot reach. ``clock`` is the monotonic
    clock.
    ``io_budget``: the longest one Redis call can block here (default: the supervisor
    client's read timeout, then its one retry's connect and read).
    ``batch``: renew in the host's batch (:mod:`worker.beat.batch`) where there is one.
    """

    def __init__(
        self,
        leases: Leases,
        doc: LeaseDoc,
        *,
        gap: float,
        deadline: float,
        beat_while_alive: bool,
        host: str,
        now: float,
        clock: Callable[[], float] = time.monotonic,
        io_budget: float | None = None,
        batch: Seat | bool = True,
    ) -> None:
        self.leases = leases
        self.doc = doc
        self.lease_id, self.token = doc.lease_id, doc.token
        self.gap = gap
        self.beat_while_alive = beat_while_alive
        self.host = host
        self.clock = clock
        self.errors = redis_errors()
        # How often the supervisor looks for progress it must poll (the lease file) and
        # writes notes; not how often it renews.
        self.min_interval = min(0.25, gap / 4)
        self.retry_interval = max(0.02, min(0.1, gap / 10))
        self.io_budget = 3 * io_timeout(gap) if io_budget is None else io_budget
        # gap/3; sooner on a short gap, so that a renewal failing when due still leaves the
        # key half of what is left past the io budget (the outage is ridden out that long);
        # never more often than min_interval, however chatty the step.
        self.renew_interval = max(self.min_interval, min(gap / 3, (gap - self.io_budget) / 2))
        self._beat_pending = False
        self.last_beat = now  # our last beat written to Redis (or the acquire)
        self.deadline_at = now + deadline
        self.last_seen = now  # the last progress seen here
        self.lapse_at = now + min(gap, deadline)  # when Redis's liveness key could lapse
        self.unreachable_since: float | None = None
        self.retry_at = 0.0
        # What the gateway wrote for this lease (set when the step was given a token): a
        # model at work counts as progress; a refused call ends the step.
        self.gateway: Callable[[], Seen] | None = None
        self.gateway_every = max(0.05, min(1.0, gap / 4))
        self.gateway_at = now
        self.limits: Guard | None = None  # the step's limits, once its child is watched
        self.seat = batch if isinstance(batch, Seat) else None
        if batch is True and clock is time.monotonic and isinstance(leases, Leases):
            self.seat = Seat.for_host(leases, self.lease_id, self.token, self.renew_interval)

    @property
    def beat_pending(self) -> bool:
        """A beat is owed to Redis; setting it records progress (output, a beat) seen now."""
        return self._beat_pending

    @beat_pending.setter
    def beat_pending(self, owed: bool) -> None:
        if owed:
            self.last_seen = max(self.last_seen, self.clock())
        self._beat_pending = owed

    def local_lapse(self, now: float) -> str | None:
        """Why the step is over on the supervisor's own clock at ``now``, or None.

        ``budget-exceeded`` once the deadline is crossed, else ``heartbeat-gap-X.Xs`` once
        no progress was seen for the gap (never while the child merely being alive counts).
        """
        if now >= self.deadline_at:
            return "budget-exceeded"
        # Compared as next_wake computes it, so waking at last_seen + gap always ends it.
        if not self.beat_while_alive and now >= self.last_seen + self.gap:
            return f"heartbeat-gap-{now - self.last_seen:.1f}s"
        return None

    @property
    def cut_off_at(self) -> float:
        """While Redis is unreachable, when the step must be ended: early enough that a
        call blocked for the whole io budget still leaves it before the liveness key could
        lapse on the server, where recovery may run the task elsewhere."""
        return self.lapse_at - self.io_budget

    def attach(self, pid: int, ticks: int | None) -> None:
        """Record the started child on the lease (and on the local copy of the document)."""
        self.doc.holder_pid, self.doc.pgid, self.doc.child_start_ticks = pid, pid, ticks
        try:
            self.leases.attach(self.lease_id, self.token, pid=pid, pgid=pid, start=ticks)
        except LeaseRefused as exc:
            log.warning(
                "lease=%s host=%s: attach refused: %s", self.lease_id, self.host, exc.reason
            )
        except self.errors:
            self._unreachable(self.clock())

    def next_wake(self) -> float:
        """The next monotonic time :meth:`tick` has something to do."""
        wake = min(self.lapse_at, self.deadline_at)
        if not self.beat_while_alive:
            wake = min(wake, self.last_seen + self.gap)
        if self.unreachable_since is not None:
            # Retries run on their own timer: a renewal overdue since the outage began
            # must not make the poll loop spin until the next retry.
            wake = min(wake, self.retry_at, self.unreachable_since + self.gap, self.cut_off_at)
        elif self.beat_pending or self.beat_while_alive:
            wake = min(wake, self.renew_at())
        if self.gateway is not None:
            wake = min(wake, self.gateway_at)
        if self.limits is not None:
            wake = min(wake, self.limits.next_check)
        return wake

    def tick(self, now: float) -> Outcome | None:
        """Do what is due at ``now``; an outcome if the step must end."""
        if self.beat_while_alive and now >= self.renew_at():
            self.beat_pending = True
        over = self.limits.tick(now) if self.limits is not None else None
        if over is not None:
            return over
        if self.gateway is not None and now >= self.gateway_at:
            refused = self._look_at_gateway(now)
            if refused is not None:
                return refused
        reason = self.local_lapse(now)
        if reason is not None:
            return self._lapsed_here(reason)
        if self.unreachable_since is not None:
            if now - self.unreachable_since >= self.gap or now >= self.cut_off_at:
                return self._lost(f"Redis unreachable for {now - self.unreachable_since:.1f}s")
            if now < self.retry_at:
                return None
            # Retry whatever is owed; a probe doubles as the reachability check.
            if self.beat_pending:
                return self._beat()
            return self._probe()
        if self.seat is not None and (self.beat_pending or self.beat_while_alive):
            self.seat = self.seat if self.seat.ask(self.last_beat, now) else None
        if self.beat_pending and now >= self.renew_at():
            ended = self._beat()
            if ended is not None or self.unreachable_since is not None:
                return ended
        if self.clock() >= self.lapse_at:
            return self._probe()
        return None

    def _look_at_gateway(self, now: float) -> Outcome | None:
        assert self.gateway is not None
        self.gateway_at = now + self.gateway_every
        try:
            seen = self.gateway()
        except self.errors:
            return None  # the lease's own probes and beats decide about an outage
        if seen.refused:
            log.warning(
                "lease=%s host=%s: the gateway refused a call (%s); ending the tree",
                self.lease_id,
                self.host,
                seen.refused,
            )
            return outcome.call_refused(seen.refused)
        if seen.progress_age is not None and seen.progress_age < self.gap:
            at = now - seen.progress_age
            if at > self.last_seen:
                self.last_seen = at
                self._beat_pending = True
        return None

    def renew_at(self) -> float:
        """When a renewal owed now is made (with a host batch: :func:`worker.beat.batch.due_at`)."""
        if self.seat is None or self.unreachable_since is not None:
            return self.last_beat + self.renew_interval
        return self.seat.due(self.last_beat, self.clock())

    def _beat(self) -> Outcome | None:
        t = self.clock()
        try:
            alone = self.unreachable_since is not None  # renewed alone until Redis answers
            got = self.seat.take(self.io_budget, alone=alone) if self.seat is not None else None
            if got is not None and got.reason:
                return self._refused(got.reason)
            at, secs = (
                (got.at, got.secs) if got else (t, self.leases.beat(self.lease_id, self.token))
            )
        except LeaseRefused as exc:
            return self._refused(exc.reason)
        except self.errors:
            self._unreachable(t)
            return None
        self._reachable()
        self._beat_pending = self.last_seen > at and not self.beat_while_alive
        self.last_beat = at
        self.lapse_at = at + secs
        if self.seat is not None and self.beat_while_alive:
            self.seat.ask(at, self.clock())
        return None

    def _probe(self) -> Outcome | None:
        t = self.clock()
        try:
            pttl, doc, server_now = self.leases.probe(self.lease_id)
        except LeaseCorrupt as exc:
            return self._lost(str(exc))
        except self.errors:
            self._unreachable(t)
            return None
        self._reachable()
        if doc is None or doc.token != self.token:
            return self._lost("the lease record is gone")
        if doc.status != "running":
            return self._ended_elsewhere(doc.status)
        if pttl >= 0:
            self.lapse_at = t + max(pttl, 1) / 1000
            return None
        if pttl == -1:  # no TTL: cannot happen through our scripts; look again in a gap
            self.lapse_at = t + self.gap
            return None
        self.doc = doc
        reason = lapsed_reason(doc, server_now)
        log.warning(
            "lease=%s host=%s: lapsed (%s); ending the tree", self.lease_id, self.host, reason
        )
        return outcome.lapsed(reason)

    def _lapsed_here(self, reason: str) -> Outcome:
        log.warning(
            "lease=%s host=%s: %s on the supervisor's clock; ending the tree",
            self.lease_id,
            self.host,
            reason,
        )
        return outcome.lapsed(reason)

    def _refused(self, reason: str) -> Outcome | None:
        if reason in ("lapsed", "deadline"):
            # The key is gone or about to be: the probe names the reason (or re-arms).
            return self._probe()
        if reason.startswith("not-running:"):
            return self._ended_elsewhere(reason.split(":", 1)[1])
        return self._lost(f"beat refused: {reason}")

    def _ended_elsewhere(self, status: str) -> Outcome:
        log.warning(
            "lease=%s host=%s: already ended (%s) by another writer; ending the tree",
            self.lease_id,
            self.host,
            status,
        )
        return outcome.ended_elsewhere(status)

    def _lost(self, why: str) -> Outcome:
        log.error(
            "lease=%s host=%s: lease lost (%s); killing the tree", self.lease_id, self.host, why
        )
        return outcome.lost()

    def _unreachable(self, t: float) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = t
            log.warning(
                "lease=%s host=%s: Redis unreachable; the child keeps running for up to %.1fs",
                self.lease_id,
                self.host,
                self.gap,
            )
        self.retry_at = self.clock() + self.retry_interval

    def _reachable(self) -> None:
        if self.unreachable_since is not None:
            log.warning(
                "lease=%s host=%s: Redis reachable again after %.2fs",
                self.lease_id,
                self.host,
                self.clock() - self.unreachable_since,
            )
            self.unreachable_since = None

    # --- the end ----------------------------------------------------------------------------

    def end(self, ended: Outcome) -> tuple[bool, Outcome, LeaseDoc]:
        """Write the end, retrying through a Redis outage no longer than the gap.

        Returns whether this wrote it, the outcome (``lease-lost`` if the end could not be
        recorded) and the final document: as Redis holds it, else as last known here.
        """
        if self.seat is not None:
            self.seat.batch.forget(self.lease_id)
        if not ended.write:
            return False, ended, self._final_doc(ended)
        now = self.clock()
        since = self.unreachable_since if self.unreachable_since is not None else now
        give_up = max(since + self.gap, now + (max(self.gap, 1.0) if ended.lost else 0))
        while True:
            try:
                doc = self.leases.end(
                    self.lease_id,
                    self.token,
                    ended.status,
                    ended.note,
                    exit_code=ended.exit_code,
                    receipt_kind=ended.receipt_kind,
                    fetch=True,
                )
                return True, ended, doc if doc is not None else self._final_doc(ended)
            except LeaseRefused as exc:
                log.warning(
                    "lease=%s host=%s: end refused: %s", self.lease_id, self.host, exc.reason
                )
                return False, ended, self._final_doc(ended)
            except LeaseCorrupt as exc:
                log.warning(
                    "lease=%s host=%s: ended, but the record reads back wrong: %s",
                    self.lease_id,
                    self.host,
                    exc,
                )
                return True, ended, self._final_doc(ended)
            except self.errors:
                if self.clock() >= give_up:
                    break
                time.sleep(self.retry_interval)
        log.error(
            "lease=%s host=%s: could not record the end (%s); lease lost",
            self.lease_id,
            self.host,
            ended.note,
        )
        if not ended.lost:
            ended = outcome.lost()
        return False, ended, self._final_doc(ended)

    def _final_doc(self, ended: Outcome) -> LeaseDoc:
        with contextlib.suppress(*self.errors, LeaseCorrupt):
            doc = self.leases.get(self.lease_id)
            if doc is not None and doc.token == self.token:
                return doc
        doc = self.doc
        if doc.status == "running":
            doc.status = ended.status
            doc.note = ended.note
            doc.exit_code = ended.exit_code
            doc.ended_unix = time.time()
        return doc
