"""``overnight up``: Redis (embedded if none answers), a reaper, N workers and the coordinator
loop on one machine, with live progress; Ctrl-C stops everything it started.

A stop (Ctrl-C, SIGTERM) is a warm stop of each worker: a running step is ended through its
lease (its tree gets SIGTERM and the grace) and its task goes back to ``queued`` from its
checkpoint; a worker still busy after the grace, or a second Ctrl-C, is a forced stop (the
rest of the grace is skipped, the stop still recorded). See :mod:`coordinator.tasks.stop`."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from overnight.config.exits import EXIT_OK, EXIT_USAGE, CommandError
from overnight.config.keys import Keys
from overnight.config.spawn import overnight_argv
from overnight.coordinator.night.ending import (
    Night,
    ended_known,
    night_exit,
    night_summary,
    no_budget,
    plural,
    resume_queued,
)
from overnight.coordinator.night.instance import claim_instance, lock_state_dir, renew_instance
from overnight.coordinator.night.record import night_over, record_night
from overnight.coordinator.night.stack import Stack
from overnight.coordinator.report.progress import PlainProgress, TaskRow, table
from overnight.coordinator.tasks.states import State
from overnight.worker.supervise.procs import set_child_subreaper

if TYPE_CHECKING:
    import redis
    from redis.lock import Lock

    from overnight.config.settings import Settings
    from overnight.coordinator.tasks.store import TaskRecord
    from overnight.worker.sandbox.stepuser import StepUser

log = logging.getLogger("overnight.up")
REFRESH_SEC = 0.5
MAINTAIN_SEC = 2.0
# How long past the grace a warm stop of the workers may take before it is forced, and how
# long a forced one may take (the worker's own bound, dispatch.worker.FORCED_WAIT, plus a margin).
WARM_MARGIN = 2.0
FORCED_MARGIN = 20.0


@dataclass
class UpOptions:
    """What ``overnight up`` was asked to do."""

    workers: int = 2
    tasks: list[Path] = field(default_factory=list)
    budget: int | None = None
    exit_when_done: bool = False
    state_dir: Path = Path(".overnight")
    embedded: bool = False  # always start a private Redis (the demo)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for everything
    until: float | None = None  # unix time the night ends (--until; else OVERNIGHT_STOP_AT)


class StopRequested:
    """SIGINT/SIGTERM set the event; a second signal gives up on a gentle stop (``again``)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum = 0
        self.again: Callable[[], object] | None = None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.event.is_set() and self.again is not None:
            self.again()
        self.signum = signum
        self.event.set()


def _signal_workers(stack: Stack) -> list[subprocess.Popen[bytes]]:
    """SIGTERM to each live worker of ``stack`` (a first one is a warm stop, a second one a
    forced stop); returns them."""
    live = [p for n, p in stack.procs if n.startswith("worker") and p.poll() is None]
    for proc in live:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)  # our unreaped child: its pid is not reused
    return live


def _all_exit(procs: list[subprocess.Popen[bytes]], wait: float) -> bool:
    deadline = time.monotonic() + wait
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    return True


def stop_workers(stack: Stack, grace: float) -> None:
    """Stop the workers so that each running step is ended by the stop and recorded as such
    (its task back to ``queued``), not left to lapse as an unknown outcome: a warm stop, then
    a forced one for a worker not gone ``grace + WARM_MARGIN`` seconds later."""
    live = _signal_workers(stack)
    if not live or _all_exit(live, grace + WARM_MARGIN):
        return
    log.warning("workers still busy %.0fs after the stop; forcing it", grace + WARM_MARGIN)
    _all_exit(_signal_workers(stack), FORCED_MARGIN)


def task_rows(client: redis.Redis, keys: Keys, records: list[TaskRecord]) -> list[TaskRow]:
    """Progress rows: each task with the age and last beat of its running lease."""
    from overnight.worker.lease.store import Leases

    secs, micros = client.time()
    now = int(secs) + int(micros) / 1e6
    running = {
        doc.task_id: doc
        for doc in reversed(Leases(client, keys).recent(200))
        if doc.status == "running" and doc.task_id
    }
    out = []
    for rec in records:
        doc = running.get(rec.id) if rec.state == State.RUNNING else None
        verdict = rec.checkpoint.last_verdict
        text = ""
        if verdict is not None:
            text = "all rules pass" if not verdict.failed else "unmet: " + ", ".join(verdict.failed)
        out.append(
            TaskRow(
                task_id=rec.id,
                state=rec.state,
                turn=rec.turns,
                calls_used=rec.calls_used,
                max_calls=rec.spec.max_calls,
                lease_age=None if doc is None else now - doc.started_unix,
                beat_age=None if doc is None else now - doc.heartbeat_unix,
                verdict=text,
                endings=tuple(rec.checkpoint.endings),
            )
        )
    return out


def _night_end(opts: UpOptions, settings: Settings) -> float | None:
    """When this night ends: ``--until``, else ``OVERNIGHT_STOP_AT``, else never."""
    from datetime import datetime

    from overnight.config.stopat import StopAtError, parse_stop_at

    if opts.until is not None or not settings.stop_at:
        return opts.until
    try:
        return parse_stop_at(settings.stop_at, datetime.now().astimezone()).timestamp()
    except StopAtError as exc:
        raise CommandError(f"OVERNIGHT_STOP_AT: {exc}", EXIT_USAGE) from None


@dataclass
class UpResult:
    """How ``overnight up`` ended: its exit code and each task's final state."""

    code: int
    states: dict[str, str] = field(default_factory=dict)
    report: Path | None = None  # the HTML report written when the night ended


def run_up(opts: UpOptions, out: TextIO = sys.stdout) -> UpResult:
    """Run the stack until Ctrl-C/SIGTERM (or, with ``exit_when_done``, until every task of
    this run has ended or paused). Nothing it started outlives it."""
    from overnight.config.connection import connect
    from overnight.config.settings import load_settings
    from overnight.coordinator.workspace.hostdirs import prepare_host
    from overnight.worker.sandbox import launch
    from overnight.worker.sandbox.stepuser import decide

    stopper = StopRequested()
    stopper.install()
    os.environ.update(opts.env)
    settings = load_settings()
    euid = os.geteuid()
    user = decide(settings.step_user, settings.allow_root_steps, euid, uids=settings.step_uids)
    launch.require(settings.sandbox, user)  # exit 78 if a sandbox is asked for and cannot start
    prepare_host(settings, user)  # exit 78 naming a folder it cannot use, before any task
    lock = lock_state_dir(opts.state_dir)
    # Orphans of what the stack starts are re-parented here, so the final sweep reaps them.
    set_child_subreaper()
    stack = Stack(env=dict(os.environ), state_dir=opts.state_dir, grace=settings.grace)
    stopper.again = lambda: _signal_workers(stack)  # a second Ctrl-C forces the workers' stop
    try:
        # OVERNIGHT_REDIS_URL (environment or .env) or a private one: never a server that
        # merely answers on the default address, which may be anyone's.
        if opts.embedded or "redis_url" not in settings.model_fields_set:
            url = stack.start_redis()
            os.environ["OVERNIGHT_REDIS_URL"] = url
            settings = load_settings(redis_url=url)
            where = f"started a private redis-server, data and log in {opts.state_dir / 'redis'}"
            record_night(opts.state_dir, settings.namespace, opts.state_dir / "redis", url)
        else:
            where = "OVERNIGHT_REDIS_URL"
        return _run(opts, settings, stack, stopper, connect, out, where, user)
    finally:
        stop_workers(stack, settings.grace)
        leftovers = stack.stop()
        night_over(opts.state_dir)
        if leftovers:
            log.warning("killed %d leftover processes: %s", len(leftovers), leftovers)
        lock.close()


def _run(
    opts: UpOptions,
    settings: Settings,
    stack: Stack,
    stopper: StopRequested,
    connect: Any,
    out: TextIO,
    where: str,
    user: StepUser | None,
) -> UpResult:
    from overnight.config.connection import describe, require_password
    from overnight.coordinator.dispatch.gateway_probe import gateway_answers, gateway_wanted
    from overnight.coordinator.night.control import ensure_envelope, submit_folders
    from overnight.coordinator.report.view import envelope_lines, render_plain, sandbox_lines
    from overnight.coordinator.tasks.store import TaskStore
    from overnight.worker.sandbox.stepuser import steps_line

    client = connect(settings)
    rq_conn = connect(settings, decode_responses=False)
    client.ping()
    require_password(client, settings, "overnight up")
    keys = Keys(settings.namespace)
    lock = claim_instance(
        client, keys, f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    )
    # Named once the namespace is ours, so a refusal stays one line.
    print(f"overnight up: {describe(settings)} ({where})", file=sys.stderr, flush=True)
    print(f"overnight up: {steps_line(user, os.geteuid())}", file=sys.stderr)
    if settings.sandbox != "bwrap":
        print("overnight up: steps run WITHOUT a sandbox (OVERNIGHT_SANDBOX=off)", file=sys.stderr)
    try:
        budget = opts.budget if opts.budget is not None else settings.budget
        if budget is not None and ensure_envelope(client, keys, budget):
            print(
                f"overnight: envelope 'default' created with {plural(budget, 'call')}",
                file=sys.stderr,
            )
        stack.env.update({"OVERNIGHT_REDIS_URL": settings.redis_url})
        night = Night(_night_end(opts, settings), settings, client, keys, opts.state_dir)
        night.prepare(stack)
        stack.spawn(
            "reaper", overnight_argv("reaper", "--interval", repr(settings.reaper_interval))
        )
        if gateway_wanted(settings):  # this host's gateway, before the workers look for it
            stack.spawn("gateway", overnight_argv("gateway"))
            gateway_answers(settings, wait=10.0)
        for i in range(opts.workers):
            stack.spawn(
                f"worker-{i + 1}",
                overnight_argv("worker", "--name", f"up-{os.getpid()}-{i + 1}"),
                env=night.worker_env(i + 1),
            )
        submitted = submit_folders(client, rq_conn, settings, opts.tasks, need_envelopes=True)
        if submitted.problems:
            for line in submitted.problems:
                print(line, file=sys.stderr)
            raise CommandError("invalid task files; nothing was enqueued", EXIT_USAGE)
        if submitted.no_envelope:
            raise CommandError(no_budget(submitted.no_envelope), EXIT_USAGE)
        ids = [rec.id for rec in submitted.records] + submitted.known
        for task_id in resume_queued(client, rq_conn, keys, submitted.known):
            print(f"overnight: task {task_id} resumes from its checkpoint", file=sys.stderr)
        for line in ended_known(TaskStore(client, keys), submitted.known):
            print(f"overnight: {line}", file=sys.stderr)
        print(
            f"overnight: {plural(len(submitted.records), 'task')} enqueued, "
            f"{len(submitted.known)} already known; {plural(opts.workers, 'worker')}; "
            f"namespace {settings.namespace!r}; logs in {opts.state_dir / 'logs'}; "
            "Ctrl-C stops everything",
            file=sys.stderr,
        )
        store = TaskStore(client, keys)
        _watch(opts, settings, stack, stopper, client, rq_conn, keys, store, ids, lock, out, night)
        if stopper.signum:  # the steps it ends go back to queued before the states are shown
            stop_workers(stack, settings.grace)
        records = [r for r in (store.get(i) for i in ids) if r is not None]
        footer = envelope_lines(client, keys.namespace, records)
        render_plain(records, out, footer + sandbox_lines(client, keys.namespace))
        states = {r.id: r.state.value for r in records}
        why = "signal" if stopper.signum else "until" if night.ended else "done"
        report = night.finish(why)
        if report is not None:
            print(f"overnight: report {report}", file=sys.stderr, flush=True)
        if stopper.signum:
            return UpResult(128 + stopper.signum, states, report)
        code = night_exit(r.state for r in records) if opts.exit_when_done else EXIT_OK
        if code != EXIT_OK:
            print(f"overnight: {night_summary(records)}; exit {code}", file=sys.stderr)
        return UpResult(code, states, report)
    finally:
        lock.release()


def _watch(
    opts: UpOptions,
    settings: Settings,
    stack: Stack,
    stopper: StopRequested,
    client: redis.Redis,
    rq_conn: redis.Redis,
    keys: Keys,
    store: Any,
    ids: list[str],
    lock: Lock,
    out: TextIO,
    night: Night | None = None,
) -> None:
    from rich.console import Console
    from rich.live import Live

    from overnight.coordinator.night.control import maintain
    from overnight.coordinator.tasks.states import SETTLED
    from overnight.worker.envelope.envelope import CallEnvelope
    from overnight.worker.redisio.clients import Backoff, transient

    console = Console(file=out)
    envelope = CallEnvelope(client, "default", keys.namespace)
    plain = PlainProgress()
    started = time.monotonic()
    next_maintain = 0.0
    redis_state = Backoff("up", log)
    live = (
        Live(console=console, auto_refresh=False, transient=False) if console.is_terminal else None
    )
    if live is not None:
        live.start()
    try:
        while not stopper.event.is_set():
            now = time.monotonic()
            stack.reap_orphans()
            for line in stack.restart_dead():
                print(f"overnight: {line}", file=sys.stderr)
            try:
                renew_instance(lock, keys)
                if now >= next_maintain:
                    next_maintain = now + MAINTAIN_SEC
                    for line in maintain(client, rq_conn, settings):
                        log.info("coordinator: %s", line)
                records = [r for r in (store.get(i) for i in ids) if r is not None]
                rows = task_rows(client, keys, records)
                remaining = envelope.snapshot().remaining if live is not None else 0
            except Exception as exc:
                if not transient(exc):  # Redis away or full for a while: wait, go on
                    raise
                stopper.event.wait(redis_state.failed(exc))
                continue
            redis_state.ok()
            if live is not None:
                live.update(table(rows, "default", remaining, now - started), refresh=True)
            else:
                for line in plain.changes(rows):
                    print(line, file=out, flush=True)
            if opts.exit_when_done and all(r.state in SETTLED for r in records):
                return
            if night is not None and night.tick(records):
                return
            stopper.event.wait(REFRESH_SEC)
    finally:
        if live is not None:
            live.stop()
