"""What ``overnight up`` (and ``overnight coordinator``, compose's) does about the night
besides running it: its end (``--until``, ``OVERNIGHT_STOP_AT``), the HTML report (refreshed
while it runs, written when it ends), ``/metrics`` and notifications.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from overnight.config.exits import EXIT_NEEDS_PERSON, EXIT_OK, EXIT_UNFINISHED
from overnight.coordinator.tasks.states import PAUSED, RUNNING, SETTLED, TERMINAL, State

if TYPE_CHECKING:
    import redis

    from overnight.config.keys import Keys
    from overnight.config.settings import Settings
    from overnight.coordinator.night.stack import Stack
    from overnight.coordinator.tasks.record import TaskRecord
    from overnight.coordinator.tasks.store import TaskStore

log = logging.getLogger("overnight.up")
REPORT_EVERY_SEC = 60.0
REPORT_NAME = "report.html"


def night_exit(states: Iterable[State]) -> int:
    """The exit status of a night that ended (every task settled, or its stop time came) with
    its tasks in ``states``: 0 only if every one finished verified; 5 if any needs a person
    (it ended otherwise, or is paused); else 6 (some had not ended: they resume next night)."""
    seen = list(states)
    if any(s in SETTLED and s != State.FINISHED_VERIFIED for s in seen):
        return EXIT_NEEDS_PERSON
    if any(s != State.FINISHED_VERIFIED for s in seen):
        return EXIT_UNFINISHED
    return EXIT_OK


def plural(n: int, word: str) -> str:
    """``1 task``, ``2 tasks``: a count and its noun (nouns that take an s)."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def ended_known(store: TaskStore, ids: list[str]) -> list[str]:
    """One line for each of ``ids`` that ended before this night: it is not run again unless
    asked."""
    out = []
    for task_id in ids:
        rec = store.get(task_id)
        if rec is not None and rec.state in TERMINAL:
            out.append(
                f"task {task_id} ended before ({rec.state}); `overnight rerun {task_id}` "
                "runs it again"
            )
    return out


def no_budget(names: list[str]) -> str:
    """Why ``up`` refuses tasks whose envelopes do not exist, in one line."""
    listed = ", ".join(repr(n) for n in names)
    what = f"envelope {listed} does not" if len(names) == 1 else f"envelopes {listed} do not"
    fix = "give --budget N (or set OVERNIGHT_BUDGET)"
    if names != ["default"]:
        fix += "; create others with `overnight envelope reset N --name NAME`"
    return f"no call budget: {what} exist, so every task would halt at its first call; {fix}"


def night_summary(records: list[TaskRecord]) -> str:
    """One line: which tasks of an ended night need a person and which had not ended."""
    person = [r for r in records if r.state in SETTLED and r.state != State.FINISHED_VERIFIED]
    open_ = [r for r in records if r.state not in SETTLED]
    parts = []
    if person:
        named = ", ".join(f"{r.id} ({r.state})" for r in person)
        parts.append(
            f"{plural(len(person), 'task')} {'needs' if len(person) == 1 else 'need'} "
            f"a person: {named}"
        )
    if open_:
        named = ", ".join(f"{r.id} ({r.state})" for r in open_)
        parts.append(f"{plural(len(open_), 'task')} not ended: {named}")
    return "; ".join(parts) or "every task finished verified"


class Night:
    """One night of ``up`` or ``overnight coordinator``: ``until`` (unix time) is when it
    ends, or None."""

    def __init__(
        self,
        until: float | None,
        settings: Settings,
        client: redis.Redis,
        keys: Keys,
        state_dir: Path,
    ) -> None:
        self.until, self.settings, self.client, self.keys = until, settings, client, keys
        self.report_path = state_dir / REPORT_NAME
        self.next_report = time.monotonic() + REPORT_EVERY_SEC
        self.ended = False  # the stop time came and the night was wound down
        self.stop_seen: float | None = None
        self.paused: set[str] = set()
        self.metrics: Any = None
        self.threads: list[threading.Thread] = []

    def prepare(self, stack: Stack) -> None:
        """Tell every member when the night ends (one absolute time, whatever the clock
        text was) and serve ``/metrics`` when a port is set."""
        if self.until is not None:
            stamp = self.stamp()
            stack.env["OVERNIGHT_STOP_AT"] = stamp
            log.info("the night ends at %s", stamp)
        stack.env.pop("OVERNIGHT_METRICS_PORT", None)
        port = self.settings.metrics_port
        if port is not None:
            from overnight.coordinator.report.metrics import serve

            self.metrics = serve(self.client, self.keys, port)

    def stamp(self) -> str:
        """When the night ends, as one absolute ISO date-time ("" if it never does)."""
        if self.until is None:
            return ""
        return datetime.fromtimestamp(self.until).astimezone().isoformat()

    def worker_env(self, index: int) -> dict[str, str]:
        """Extra environment of worker ``index`` (1, 2, ...): its metrics port."""
        port = self.settings.metrics_port
        return {} if port is None else {"OVERNIGHT_METRICS_PORT": str(port + index)}

    def tick(self, records: list[TaskRecord], now: float | None = None) -> bool:
        """Once per refresh of ``up``: notify new pauses, refresh the report every minute;
        True once the night is over (its stop time passed and no task is mid-step any more,
        or the grace for that ran out)."""
        now = time.time() if now is None else now
        for rec in records:
            if rec.state == PAUSED and rec.id not in self.paused:
                self.paused.add(rec.id)
                self._notify_pause(rec)
            elif rec.state != PAUSED:
                self.paused.discard(rec.id)
        if time.monotonic() >= self.next_report:
            self.next_report = time.monotonic() + REPORT_EVERY_SEC
            self.write_report()
        if self.until is None or now < self.until:
            return False
        if self.stop_seen is None:
            self.stop_seen = now
            log.info("the night ended; waiting for running steps to stop")
        busy = [r.id for r in records if r.state == RUNNING]
        s = self.settings
        patience = 2 * s.grace + s.heartbeat_gap + s.task_claim_ttl + 10.0
        if busy and now - self.until < patience:
            return False
        if busy:
            log.warning("the night ended; tasks still running after %.0f s: %s", patience, busy)
        self.ended = True
        return True

    def write_report(self) -> Any:
        """Write the HTML report into the state folder; returns the report (None if it
        could not be written: said in the log, the night goes on)."""
        from overnight.coordinator.report.view import write_html

        try:
            return write_html(self.client, self.keys.namespace, self.report_path)
        except Exception as exc:  # a report is never a reason to stop the night
            log.warning("could not write the report %s: %s", self.report_path, exc)
            return None

    def finish(self, reason: str) -> Path | None:
        """The night is over: write the report, POST the summary, stop ``/metrics``;
        returns the report's path (None if it could not be written)."""
        from overnight.coordinator.report import notify

        report = self.write_report()
        path = self.report_path.resolve() if report is not None else None
        if report is not None:
            payload = notify.night_summary(report, reason, path)
            thread = notify.send(self.settings.notify_url, payload)
            if thread is not None:
                thread.join(notify.ATTEMPTS * (notify.TIMEOUT_SEC + notify.BACKOFF_SEC * 4))
        for thread in self.threads:
            thread.join(0.1)
        if self.metrics is not None:
            self.metrics.shutdown()
        return path

    def _notify_pause(self, rec: TaskRecord) -> None:
        from overnight.coordinator.report import notify

        payload = notify.pause_summary(
            self.keys.namespace, rec.id, rec.detail, self.report_path.resolve()
        )
        thread = notify.send(self.settings.notify_url, payload)
        if thread is not None:
            self.threads.append(thread)


def resume_queued(
    client: redis.Redis, rq_conn: redis.Redis, keys: Keys, ids: list[str]
) -> list[str]:
    """Enqueue again, at once, the tasks of ``ids`` that wait in ``queued`` with no RQ job
    that could still run them (a night that ended sent them back); returns their ids."""
    from rq.exceptions import NoSuchJobError
    from rq.job import Job, JobStatus

    from overnight.coordinator.dispatch.enqueue import enqueue
    from overnight.coordinator.tasks.states import QUEUED
    from overnight.coordinator.tasks.store import TaskStore

    store = TaskStore(client, keys)
    again = []
    for task_id in ids:
        rec = store.get(task_id)
        if rec is None or rec.state != QUEUED:
            continue
        try:
            status = Job.fetch(rec.job_id(), connection=rq_conn).get_status(refresh=False)
        except NoSuchJobError:
            status = None
        if status in (
            None,
            JobStatus.FINISHED,
            JobStatus.FAILED,
            JobStatus.STOPPED,
            JobStatus.CANCELED,
        ):
            again.append(rec)
    if again:
        enqueue(rq_conn, again, keys.namespace)
    return [rec.id for rec in again]
