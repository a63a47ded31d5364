"""Keeping one lease from the supervisor's side while its child runs.

It beats when a beat is owed (at most every ``min(0.25, gap/4)`` seconds), looks at the
lease when it could have lapsed, rides out a Redis outage for up to the gap (fail closed
after that), and says when the step must end and why (a :class:`worker.outcome.Outcome`).
It never sleeps: :meth:`Keeper.next_wake` tells the supervisor's poll loop when to call
:meth:`Keeper.tick` again.
"""

from __future__ import annotations

import contextlib
import logging
import time

from overnight.worker import outcome
from overnight.worker.clients import redis_errors
from overnight.worker.lease import LeaseCorrupt, LeaseDoc, LeaseRefused, Leases, lapsed_reason
from overnight.worker.outcome import Outcome

log = logging.getLogger("overnight.supervisor")


class Keeper:
    """The supervisor's hold on one running lease (``doc``, just acquired at ``now``)."""

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
    ) -> None:
        self.leases = leases
        self.doc = doc
        self.lease_id, self.token = doc.lease_id, doc.token
        self.gap = gap
        self.beat_while_alive = beat_while_alive
        self.host = host
        self.errors = redis_errors()
        self.min_interval = min(0.25, gap / 4)
        self.alive_interval = max(0.05, min(gap / 4, 10.0))
        self.retry_interval = max(0.02, min(0.1, gap / 10))
        self.beat_pending = False
        self.last_beat = now
        self.lapse_at = now + min(gap, deadline)
        self.unreachable_since: float | None = None
        self.retry_at = 0.0

    def attach(self, pid: int, ticks: int | None) -> None:
        """Record the started child on the lease (and on the local copy of the document)."""
        self.doc.holder_pid, self.doc.pgid, self.doc.child_start_ticks = pid, pid, ticks
        try:
            self.leases.attach(self.lease_id, self.token, pid=pid, pgid=pid, start=ticks)
        except LeaseRefused as exc:
            log.warning("lease=%s host=%s: attach refused: %s", self.lease_id, self.host,
                        exc.reason)  # fmt: skip
        except self.errors:
            self._unreachable(time.monotonic())

    def next_wake(self) -> float:
        """The next monotonic time :meth:`tick` has something to do."""
        wake = self.lapse_at
        if self.beat_pending:
            wake = min(wake, self.last_beat + self.min_interval)
        if self.beat_while_alive:
            wake = min(wake, self.last_beat + self.alive_interval)
        if self.unreachable_since is not None:
            wake = min(wake, self.retry_at, self.unreachable_since + self.gap)
        return wake

    def tick(self, now: float) -> Outcome | None:
        """Do what is due at ``now``; an outcome if the step must end."""
        if self.beat_while_alive and now >= self.last_beat + self.alive_interval:
            self.beat_pending = True
        if self.unreachable_since is not None:
            if now - self.unreachable_since >= self.gap:
                return self._lost(f"Redis unreachable for {now - self.unreachable_since:.1f}s")
            if now < self.retry_at:
                return None
            # Retry whatever is owed; a probe doubles as the reachability check.
            if self.beat_pending:
                return self._beat()
            return self._probe()
        if self.beat_pending and now >= self.last_beat + self.min_interval:
            ended = self._beat()
            if ended is not None or self.unreachable_since is not None:
                return ended
        if time.monotonic() >= self.lapse_at:
            return self._probe()
        return None

    def _beat(self) -> Outcome | None:
        t = time.monotonic()
        try:
            secs = self.leases.beat(self.lease_id, self.token)
        except LeaseRefused as exc:
            return self._refused(exc.reason)
        except self.errors:
            self._unreachable(t)
            return None
        self._reachable()
        self.beat_pending = False
        self.last_beat = t
        self.lapse_at = t + secs
        return None

    def _probe(self) -> Outcome | None:
        t = time.monotonic()
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
        log.warning("lease=%s host=%s: lapsed (%s); ending the tree", self.lease_id, self.host,
                    reason)  # fmt: skip
        return outcome.lapsed(reason)

    def _refused(self, reason: str) -> Outcome | None:
        if reason in ("lapsed", "deadline"):
            # The key is gone or about to be: the probe names the reason (or re-arms).
            return self._probe()
        if reason.startswith("not-running:"):
            return self._ended_elsewhere(reason.split(":", 1)[1])
        return self._lost(f"beat refused: {reason}")

    def _ended_elsewhere(self, status: str) -> Outcome:
        log.warning("lease=%s host=%s: already ended (%s) by another writer; ending the tree",
                    self.lease_id, self.host, status)  # fmt: skip
        return outcome.ended_elsewhere(status)

    def _lost(self, why: str) -> Outcome:
        log.error("lease=%s host=%s: lease lost (%s); killing the tree", self.lease_id,
                  self.host, why)  # fmt: skip
        return outcome.lost()

    def _unreachable(self, t: float) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = t
            log.warning("lease=%s host=%s: Redis unreachable; the child keeps running for "
                        "up to %.1fs", self.lease_id, self.host, self.gap)  # fmt: skip
        self.retry_at = time.monotonic() + self.retry_interval

    def _reachable(self) -> None:
        if self.unreachable_since is not None:
            log.warning("lease=%s host=%s: Redis reachable again after %.2fs", self.lease_id,
                        self.host, time.monotonic() - self.unreachable_since)  # fmt: skip
            self.unreachable_since = None

    # --- the end ----------------------------------------------------------------------------

    def end(self, ended: Outcome) -> tuple[bool, Outcome, LeaseDoc]:
        """Write the end, retrying through a Redis outage no longer than the gap.

        Returns whether this wrote it, the outcome (``lease-lost`` if the end could not be
        recorded) and the final document: as Redis holds it, else as last known here.
        """
        if not ended.write:
            return False, ended, self._final_doc(ended)
        now = time.monotonic()
        since = self.unreachable_since if self.unreachable_since is not None else now
        give_up = max(since + self.gap, now + (max(self.gap, 1.0) if ended.lost else 0))
        while True:
            try:
                doc = self.leases.end(self.lease_id, self.token, ended.status, ended.note,
                                      exit_code=ended.exit_code,
                                      receipt_kind=ended.receipt_kind, fetch=True)  # fmt: skip
                return True, ended, doc if doc is not None else self._final_doc(ended)
            except LeaseRefused as exc:
                log.warning("lease=%s host=%s: end refused: %s", self.lease_id, self.host,
                            exc.reason)  # fmt: skip
                return False, ended, self._final_doc(ended)
            except LeaseCorrupt as exc:
                log.warning("lease=%s host=%s: ended, but the record reads back wrong: %s",
                            self.lease_id, self.host, exc)  # fmt: skip
                return True, ended, self._final_doc(ended)
            except self.errors:
                if time.monotonic() >= give_up:
                    break
                time.sleep(self.retry_interval)
        log.error("lease=%s host=%s: could not record the end (%s); lease lost",
                  self.lease_id, self.host, ended.note)  # fmt: skip
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
