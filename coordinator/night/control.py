"""The coordinator's work, as plain functions: seed the envelope, submit task folders, and
the maintenance pass (leases of dead hosts, tasks whose worker died or deadline passed).

``overnight coordinator`` (what compose runs) and ``overnight up`` both call these. The
coordinator also ends a night as ``up`` does (:class:`coordinator.night.ending.Night`): at
``OVERNIGHT_STOP_AT`` it waits for running steps to end, writes the report, notifies, asks
the workers of its queues to stop, and exits 0.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from overnight.config.keys import Keys

if TYPE_CHECKING:
    import redis

    from overnight.config.settings import Settings
    from overnight.coordinator.dispatch.lead import RecoveryLead
    from overnight.coordinator.night.ending import Night
    from overnight.coordinator.tasks.store import TaskRecord

log = logging.getLogger("overnight.coordinator")
TASK_SUFFIXES = (".toml", ".json")


def ensure_envelope(client: redis.Redis, keys: Keys, budget: int, name: str = "default") -> bool:
    """Create envelope ``name`` with ``budget`` calls unless it exists; True if created.

    An existing envelope is never refilled: a restarted coordinator must not hand the
    night a second budget.
    """
    from overnight.worker.envelope.envelope import CallEnvelope

    if not CallEnvelope(client, name, keys.namespace).create(budget):
        return False
    log.info("namespace=%s envelope %s created with %d calls", keys.namespace, name, budget)
    return True


def task_files(folder: Path) -> list[Path]:
    """Task files under ``folder`` (``*.toml``/``*.json``, any depth), in name order."""
    if folder.is_file():
        return [folder]
    return sorted(
        p
        for p in folder.rglob("*")
        if p.suffix.lower() in TASK_SUFFIXES and p.is_file() and not _hidden(p, folder)
    )


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


@dataclass
class Submitted:
    """What a submit pass did."""

    records: list[TaskRecord] = field(default_factory=list)
    known: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # Envelopes the new tasks name that do not exist (with ``need_envelopes``: none enqueued).
    no_envelope: list[str] = field(default_factory=list)


def missing_envelopes(client: redis.Redis, keys: Keys, names: set[str]) -> list[str]:
    """Those of ``names`` that name no envelope of the namespace, in name order."""
    from overnight.worker.envelope.envelope import CallEnvelope

    return [
        n for n in sorted(names) if not CallEnvelope(client, n, keys.namespace).snapshot().exists
    ]


def submit_folders(
    client: redis.Redis,
    rq_conn: redis.Redis,
    settings: Settings,
    folders: list[Path],
    *,
    need_envelopes: bool = False,
) -> Submitted:
    """Validate every task file under ``folders``; enqueue those whose id is new.

    All-or-nothing like ``overnight submit``: one invalid file and nothing is enqueued
    (``problems`` says why). Tasks whose id the namespace already knows, in any state, are
    skipped, so a restarted coordinator does not run finished tasks again. With
    ``need_envelopes``, nothing is enqueued either if a new task names an envelope that does
    not exist (``no_envelope``): it would halt at its first call.
    """
    from overnight.coordinator.dispatch.enqueue import enqueue
    from overnight.coordinator.tasks.store import TaskStore
    from overnight.coordinator.tasks.taskfile import TaskFileError, load_all

    files = [f for folder in folders for f in task_files(folder)]
    out = Submitted()
    store = TaskStore(client, Keys(settings.namespace))
    try:
        specs = load_all(files, known=lambda task_id: store.get(task_id) is not None)
    except TaskFileError as exc:
        out.problems = exc.problems
        return out
    fresh = []
    for spec in specs:
        if spec.id is not None and store.get(spec.id) is not None:
            out.known.append(spec.id)
        else:
            fresh.append(spec)
    if need_envelopes:
        out.no_envelope = missing_envelopes(client, store.keys, {s.envelope for s in fresh})
        if out.no_envelope:
            return out
    if fresh:
        out.records = store.create(fresh, settings.queue)
        enqueue(rq_conn, out.records, settings.namespace)
    return out


# Per client and namespace, this process's recovery lead (its token must stay the same
# from one pass to the next for it to renew the lead it holds).
_leads: weakref.WeakKeyDictionary[redis.Redis, dict[str, RecoveryLead]] = (
    weakref.WeakKeyDictionary()
)


def maintain(client: redis.Redis, rq_conn: redis.Redis, settings: Settings) -> list[str]:
    """One maintenance pass; returns one line per action.

    Ends leases of hosts whose reaper is gone (``reaped: host-lost``) and, if this process
    holds the namespace's recovery lead (taken here when free), recovers tasks whose worker
    died or whose own deadline passed.
    """
    from overnight.coordinator.dispatch.lead import RecoveryLead, lead_ttl
    from overnight.coordinator.dispatch.recovery import recover
    from overnight.coordinator.report.metrics import REAPER
    from overnight.worker.reaper.reaper import reap_once

    keys = Keys(settings.namespace)
    report = reap_once(client, keys, grace=settings.grace, host_ttl=None)
    REAPER.passes += 1
    REAPER.kills += len(report.actions)
    lines = [f"lease {a.lease_id}: {a.outcome}: {a.why}" for a in report.actions]
    mine = _leads.setdefault(client, {})
    lead = mine.get(keys.namespace)
    if lead is None:
        lead = mine[keys.namespace] = RecoveryLead(client, keys, lead_ttl(settings))
    if lead.hold():
        lines += recover(client, rq_conn, keys, settings)
    return lines


# How long the end of a night keeps asking the workers to stop (past the grace a busy one
# may need): a worker starting up as the first request goes out is not subscribed yet.
END_WORKERS_MARGIN = 10.0


def end_workers(rq_conn: redis.Redis, queues: set[str], wait: float) -> list[str]:
    """Ask every RQ worker registered on ``queues`` to stop (RQ's shutdown command: a warm
    stop, as SIGINT would be; an idle ``overnight worker`` exits 0), again each second for up
    to ``wait`` seconds while any is still registered; returns those that still are."""
    import time

    from rq import Queue, Worker
    from rq.command import send_shutdown_command

    deadline = time.monotonic() + wait
    while True:
        names = sorted(
            {
                w.name
                for name in queues
                for w in Worker.all(connection=rq_conn, queue=Queue(name, connection=rq_conn))
            }
        )
        if not names or time.monotonic() >= deadline:
            return names
        for name in names:
            send_shutdown_command(rq_conn, name)
        time.sleep(1.0)


def run_coordinator(
    folders: list[Path],
    interval: float,
    *,
    exit_when_done: bool = False,
    once: bool = False,
    state_dir: Path = Path(".overnight"),
) -> int:
    """The ``overnight coordinator`` process; returns its exit code. Its report (refreshed
    every minute, written when the night ends) is ``state_dir/report.html``, as ``up``'s."""
    import signal
    import sys
    import threading

    from overnight.config.connection import connect, require_password
    from overnight.config.context import settings as current
    from overnight.coordinator.night.ending import Night
    from overnight.coordinator.tasks.states import SETTLED
    from overnight.coordinator.tasks.stop import configured
    from overnight.coordinator.tasks.store import TaskStore
    from overnight.worker.redisio.clients import STARTUP_WAIT, Backoff, retry_transient, transient

    settings = current()
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    client = connect(settings)
    rq_conn = connect(settings, decode_responses=False)
    # A coordinator started while a failover runs waits for the new primary.
    for call in (client.ping, partial(require_password, client, settings, "overnight coordinator")):
        retry_transient(call, "coordinator start", log, patience=STARTUP_WAIT, cap=2.0)
    keys = Keys(settings.namespace)
    night = Night(None if once else configured(), settings, client, keys, state_dir)
    if settings.metrics_port is not None:
        from overnight.coordinator.report.metrics import serve

        night.metrics = serve(client, keys, settings.metrics_port)
    if night.until is not None:
        log.info("namespace=%s the night ends at %s", keys.namespace, night.stamp())
    if settings.budget is not None:
        ensure_envelope(client, keys, settings.budget)
    submitted = submit_folders(client, rq_conn, settings, folders)
    if submitted.problems:
        for line in submitted.problems:
            print(line, file=sys.stderr)
        print("overnight: invalid task files; nothing was enqueued", file=sys.stderr)
        return 64
    for rec in submitted.records:
        log.info("namespace=%s task %s enqueued on %s", keys.namespace, rec.id, rec.queue)
    for task_id in submitted.known:
        log.info("namespace=%s task %s already known; not enqueued again", keys.namespace, task_id)
    missing = missing_envelopes(client, keys, {rec.spec.envelope for rec in submitted.records})
    if missing:  # a service is not refused (it would be restarted); said at once instead
        from overnight.coordinator.night.ending import no_budget

        log.warning("namespace=%s %s", keys.namespace, no_budget(missing))
    store = TaskStore(client, keys)
    # The night's tasks: those of its folders, and any other that changed while it ran.
    mine = {rec.id for rec in submitted.records} | set(submitted.known)
    began = store.now()
    # Redis away or refusing writes for a while (clients.transient): logged once, retried.
    redis_state = Backoff(f"coordinator namespace={keys.namespace}", log, first=interval)
    while not stop.is_set():
        wait = interval
        try:
            for line in maintain(client, rq_conn, settings):
                log.info("namespace=%s %s", keys.namespace, line)
            records = store.all()
            tonight = [r for r in records if r.id in mine or (r.updated_unix or 0) >= began]
            if exit_when_done and all(rec.state in SETTLED for rec in records):
                log.info("namespace=%s every task has ended or paused", keys.namespace)
                if once:
                    return 0
                night.finish("done")
                return _night_code(keys, tonight)
            if not once and night.tick(records):
                _end_night(night, rq_conn, {settings.queue, *(r.queue for r in records)})
                # A service (compose's `restart: on-failure`) ends its night with 0.
                return _night_code(keys, tonight) if exit_when_done else 0
            redis_state.ok()
        except Exception as exc:
            if once or not transient(exc):
                raise
            wait = max(interval, redis_state.failed(exc))
        if once:
            return 0
        stop.wait(wait)
    return 0


def _night_code(keys: Keys, records: list[TaskRecord]) -> int:
    """The night's exit status (:func:`coordinator.night.ending.night_exit`), said in a log
    line when it is not 0."""
    from overnight.coordinator.night.ending import night_exit, night_summary

    code = night_exit(r.state for r in records)
    if code:
        log.warning("namespace=%s %s; exit %d", keys.namespace, night_summary(records), code)
    return code


def _end_night(night: Night, rq_conn: redis.Redis, queues: set[str]) -> None:
    """The stop time came and no step runs any more (or the wait for that ran out): the
    report, the notification, then the workers of ``queues`` are asked to stop."""
    path = night.finish("until")
    log.info("namespace=%s the night ended; report %s", night.keys.namespace, path)
    left = end_workers(rq_conn, queues, night.settings.grace + END_WORKERS_MARGIN)
    if left:
        log.warning("namespace=%s workers still registered: %s", night.keys.namespace, left)
