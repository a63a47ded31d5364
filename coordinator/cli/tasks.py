"""Task commands: submit, worker, status, reconcile, receipts, logs, report. Parsing only; the logic
lives in taskfile, taskstore, dispatch and report, imported when a command runs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from overnight.config.exits import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, CommandError
from overnight.config.spawn import overnight_argv
from overnight.coordinator.cli.nightopt import night_option

if TYPE_CHECKING:
    from overnight.coordinator.tasks.store import TaskRecord, TaskStore


def _store() -> TaskStore:
    from overnight.config.context import redis_client, settings
    from overnight.config.keys import Keys
    from overnight.coordinator.tasks.store import TaskStore

    return TaskStore(redis_client(), Keys(settings().namespace))


def _record(store: TaskStore, task_id: str) -> TaskRecord:
    from overnight.coordinator.tasks.store import TaskCorrupt

    try:
        rec = store.get(task_id)
    except TaskCorrupt as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    if rec is None:
        raise CommandError(f"no task {task_id!r} in namespace {store.keys.namespace!r}", EXIT_USAGE)
    return rec


def _statuses(store: TaskStore, records: list[TaskRecord]) -> list[dict[str, Any]]:
    """``overnight status`` JSON of each record, token fields included."""
    from overnight.coordinator.report.tokens import token_fields, with_tokens
    from overnight.coordinator.report.view import status_dict

    tokens = token_fields(store.client, store.keys, records)
    return [
        with_tokens(status_dict(rec, store.claim_alive(rec.id)), tokens[rec.id]) for rec in records
    ]


def _status_json(store: TaskStore, rec: TaskRecord) -> str:
    return json.dumps(_statuses(store, [rec])[0], indent=2)


@click.command("submit")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--queue", "-q", metavar="Q", help="RQ queue to put the tasks on [OVERNIGHT_QUEUE].")
@click.option("--wait", is_flag=True, help="Wait until every task has ended (or paused).")
@click.option("--timeout", type=float, metavar="SEC", help="With --wait: give up after SEC.")
def submit_command(
    files: tuple[Path, ...], queue: str | None, wait: bool, timeout: float | None
) -> None:
    """Validate task files (TOML or JSON) and enqueue each as an RQ job.

    Every file is checked before any is enqueued: with one bad file nothing is enqueued,
    and each problem is printed on its own line naming the file and key (exit 64).
    Prints one task id per line. With --wait, waits for the tasks to end and exits 0
    only if every one is finished_verified (else 2).
    """
    from overnight.config.context import rq_connection, settings
    from overnight.config.settings import NAME_RE
    from overnight.coordinator.dispatch.enqueue import enqueue
    from overnight.coordinator.tasks.store import TaskIdTaken
    from overnight.coordinator.tasks.taskfile import TaskFileError, load_all

    queue = queue or settings().queue
    if not NAME_RE.match(queue):
        raise click.BadParameter("letters, digits, '.', '_' or '-'", param_hint="--queue")
    try:
        specs = load_all(list(files), warn=lambda line: click.echo(line, err=True))
    except TaskFileError as exc:
        for line in exc.problems:
            click.echo(line, err=True)
        raise CommandError("", EXIT_USAGE) from None
    store = _store()
    wanted = [s.id for s in specs if s.id]
    live = set(store.live_ids(wanted))
    if live:
        for path, spec in zip(files, specs, strict=True):
            if spec.id in live:
                click.echo(f"{path}: id: {spec.id!r} names a task that is still live", err=True)
        raise CommandError("", EXIT_USAGE)
    try:
        records = store.create(specs, queue)
    except TaskIdTaken as exc:
        raise CommandError(f"{exc}; nothing was enqueued", EXIT_USAGE) from None
    enqueue(rq_connection(), records, settings().namespace)
    for rec in records:
        click.echo(rec.id)
    sys.stdout.flush()
    _warn_missing_envelopes(sorted({spec.envelope for spec in specs}))
    if wait:
        code = _wait([rec.id for rec in records], store, timeout)
        raise SystemExit(code)


def _wait(ids: list[str], store: TaskStore, timeout: float | None) -> int:
    from overnight.coordinator.tasks.states import SETTLED, State

    end = None if timeout is None else time.monotonic() + timeout
    pending = set(ids)
    states: dict[str, str] = {}
    while pending:
        for task_id in sorted(pending):
            rec = store.get(task_id)
            if rec is not None and rec.state in SETTLED:
                states[task_id] = rec.state
                pending.discard(task_id)
                click.echo(f"{task_id}: {rec.state}", err=True)
        if pending and end is not None and time.monotonic() > end:
            click.echo(
                f"overnight: still running after {timeout:g}s: {', '.join(sorted(pending))}",
                err=True,
            )
            return EXIT_REFUSED
        if pending:
            time.sleep(0.2)
    ok = all(state == State.FINISHED_VERIFIED for state in states.values())
    return EXIT_OK if ok else EXIT_REFUSED


@click.command("worker")
@click.option("--burst", is_flag=True, help="Run queued jobs, then exit (instead of waiting).")
@click.option(
    "--queues", "-q", multiple=True, metavar="Q[,Q…]", help="Queues to serve [OVERNIGHT_QUEUE]."
)
@click.option("--name", metavar="NAME", help="Worker name (default: random).")
@click.option("--max-jobs", type=click.IntRange(min=1), help="Exit after this many jobs.")
@click.option(
    "--with-reaper",
    is_flag=True,
    help="Also run this host's reaper as a child process (one command per container, "
    "as docker-compose.yml does); it stops with the worker.",
)
def worker_command(
    burst: bool, queues: tuple[str, ...], name: str | None, max_jobs: int | None, with_reaper: bool
) -> None:
    """Run an RQ worker that runs overnight tasks (an rq.Worker subclass).

    Equivalent to `rq worker -w overnight.coordinator.dispatch.OvernightWorker QUEUE`. Each job
    runs one task's loop in the work horse, every step under a lease. At start and every
    OVERNIGHT_RECOVERY_INTERVAL seconds while idle it recovers tasks whose worker died:
    re-queued from their checkpoint, or paused when a step's outcome is unknown.
    """
    import contextlib
    import logging

    import redis

    from overnight.config.connection import describe, require_password
    from overnight.config.context import rq_connection, settings
    from overnight.config.settings import NAME_RE
    from overnight.coordinator.dispatch.gateway_watch import GatewayWatch
    from overnight.coordinator.dispatch.worker import OvernightWorker
    from overnight.coordinator.report.metrics import serve_from_settings as serve_metrics
    from overnight.coordinator.workspace.hostdirs import prepare_host
    from overnight.worker.redisio.clients import STARTUP_WAIT, retry_transient, transient
    from overnight.worker.sandbox import launch
    from overnight.worker.sandbox.stepuser import configured

    user = configured()  # who steps run as: a setting that cannot be honoured is exit 78 now
    sandboxed = launch.configured(user)  # likewise a sandbox asked for that cannot start
    prepare_host(settings(), user)  # likewise a folder it cannot use, before any task
    click.echo(f"overnight worker: {describe(settings())}", err=True)
    if not sandboxed:
        click.echo(
            f"overnight worker: steps run WITHOUT a sandbox ({launch.SANDBOX_VAR}=off)", err=True
        )
    names = [q for item in queues for q in item.split(",") if q] or [settings().queue]
    for q in names:
        if not NAME_RE.match(q):
            raise click.BadParameter(f"bad queue name {q!r}", param_hint="--queues")
    conn = rq_connection()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    retry_transient(
        conn.ping,
        "worker start",
        logging.getLogger("overnight.worker"),
        patience=STARTUP_WAIT,
        cap=2.0,
    )
    require_password(conn, settings(), "overnight worker")
    worker = OvernightWorker(names, connection=conn, name=name)
    serve_metrics(worker.name)  # OVERNIGHT_METRICS_PORT: this worker's /metrics
    reaper = _start_reaper() if with_reaper else None
    gateway = GatewayWatch.start_for(settings())  # restarted whenever it exits
    try:
        while True:
            try:
                worker.work(burst=burst, logging_level="INFO", max_jobs=max_jobs)
                break
            except redis.RedisError as exc:
                # RQ rides out a lost connection while it waits for jobs, not while it starts
                # up or reports a job: start over once Redis is back (as RQ would have); so
                # too for a write refused (maxmemory, a replica, loading) that no override
                # of ours caught.
                if not transient(exc):
                    raise
                logging.getLogger("overnight.worker").warning(
                    "Redis unavailable (%s: %s); starting the worker again in 1s",
                    type(exc).__name__,
                    exc,
                )
                with contextlib.suppress(Exception):
                    worker.unsubscribe()
                    worker.register_death()  # type: ignore[no-untyped-call]
                time.sleep(1.0)
                worker = OvernightWorker(names, connection=conn, name=name)
    finally:
        if reaper is not None:
            reaper.terminate()
            reaper.wait(30)
        if gateway is not None:
            gateway.stop()


def _start_reaper() -> subprocess.Popen[bytes]:
    """``overnight reaper`` as a child that gets SIGTERM if this worker dies."""

    from overnight.worker.supervise.procs import set_pdeathsig

    return subprocess.Popen(
        overnight_argv("reaper"),
        stdin=subprocess.DEVNULL,
        preexec_fn=lambda: set_pdeathsig(signal.SIGTERM),
    )


def _warn_missing_envelopes(names: list[str]) -> None:
    """One stderr line per envelope the submitted tasks name that does not exist yet."""
    from overnight.config.context import redis_client, settings
    from overnight.worker.envelope.envelope import CallEnvelope, EnvelopeRefused

    for name in names:
        try:
            exists = CallEnvelope(redis_client(), name, settings().namespace).snapshot().exists
        except EnvelopeRefused:
            continue  # a corrupt record or a Redis hiccup: the tasks will say so themselves
        if not exists:
            click.echo(
                f"overnight submit: warning: envelope {name!r} does not exist, so its tasks "
                "will halt at their first call; create it with `overnight envelope reset N` "
                "(or OVERNIGHT_BUDGET for the coordinator)",
                err=True,
            )


@click.command("status")
@night_option
@click.argument("task_id", required=False)
def status_command(task_id: str | None) -> None:
    """Print a task's state as JSON (state, calls_used, turns, last_verdict, ...).

    tokens_used is what the gateway charged the task (held against max_tokens);
    input_tokens and output_tokens are the upstream's figures from the ledger.

    With no TASK, prints a JSON array with every task of the namespace.
    """
    store = _store()
    if task_id is not None:
        click.echo(_status_json(store, _record(store, task_id)))
        return
    click.echo(json.dumps(_statuses(store, store.all()), indent=2))


@click.command("reconcile")
@click.argument("task_id")
@click.option("--resume", "action", flag_value="resume", help="Queue the task again; it goes on.")
@click.option("--abort", "action", flag_value="abort", help="End the task as aborted.")
def reconcile_command(task_id: str, action: str | None) -> None:
    """Resume or abort a task paused for reconciliation (a step's outcome was unknown).

    --resume re-runs the step whose outcome was unknown (it is not charged again) and
    continues from the checkpoint; --abort ends the task as aborted (also a queued or
    running one). Prints the task's status JSON.
    """
    from overnight.config.context import redis_client, rq_connection, settings
    from overnight.coordinator.dispatch.enqueue import enqueue
    from overnight.coordinator.dispatch.recovery import recover
    from overnight.coordinator.tasks.states import PAUSED, RUNNING
    from overnight.coordinator.tasks.store import TaskRefused

    if action is None:
        raise click.UsageError("say --resume or --abort")
    store = _store()
    rec = _record(store, task_id)
    if rec.state == RUNNING and not store.claim_alive(task_id):
        recover(redis_client(), rq_connection(), store.keys, settings())
        rec = _record(store, task_id)
    if action == "abort":
        try:
            store.abort(task_id, "aborted by overnight reconcile")
        except TaskRefused:
            raise CommandError(
                f"task {task_id!r} has already ended ({rec.state})", EXIT_USAGE
            ) from None
        _cancel_job(rec)
    else:
        if rec.state != PAUSED:
            raise CommandError(f"task {task_id!r} is {rec.state}, not paused", EXIT_USAGE)
        cp = rec.checkpoint.model_copy(update={"in_flight": None, "lost_leases": 0})
        try:
            store.resume(rec, cp)
        except TaskRefused as exc:
            raise CommandError(
                f"task {task_id!r} changed meanwhile ({exc.why}); try again", EXIT_USAGE
            ) from None
        enqueue(rq_connection(), [_record(store, task_id)], settings().namespace)
    click.echo(_status_json(store, _record(store, task_id)))


@click.command("rerun")
@click.argument("task_id")
@click.option(
    "--budget",
    type=click.IntRange(min=1),
    metavar="N",
    help="Calls this run may use, model and tool together (default: the task's max_calls).",
)
@click.option(
    "--from-base",
    is_flag=True,
    help="Start over from the task's base commit; the earlier work stays on the branch "
    "overnight/TASK-<run>.",
)
def rerun_command(task_id: str, budget: int | None, from_base: bool) -> None:
    """Run an ended task again (finished, halted, expired, aborted or agent_failed).

    By default it goes on where it stopped: on its branch, with its commits kept, from the
    next turn, the first prompt naming the rules still unmet. Its calls_used goes on
    counting; it may use N more (--budget). Its deadline starts again. A worker (`overnight
    worker`, `up`) runs it. Refused (exit 2, one line) while it is live, or when its envelope
    has no calls left. Prints the task's status JSON.
    """
    from overnight.config.context import rq_connection
    from overnight.coordinator.tasks.runagain import RerunRefused, run_again

    store = _store()
    try:
        done = run_again(store, rq_connection(), task_id, budget=budget, from_base=from_base)
    except RerunRefused as exc:
        raise CommandError(str(exc), EXIT_REFUSED) from None
    where = f"; the earlier work is on {done.kept_branch}" if done.kept_branch else ""
    click.echo(
        f"overnight: task {task_id} queued again (attempt {done.attempt}, "
        f"max_calls {done.max_calls}){where}",
        err=True,
    )
    click.echo(_status_json(store, _record(store, task_id)))


def _cancel_job(rec: TaskRecord) -> None:
    from rq.exceptions import InvalidJobOperation, NoSuchJobError
    from rq.job import Job, JobStatus

    from overnight.config.context import rq_connection

    try:
        job = Job.fetch(rec.job_id(), connection=rq_connection())
        if job.get_status() == JobStatus.QUEUED:
            job.cancel()
    except (NoSuchJobError, InvalidJobOperation):
        pass


@click.command("receipts")
@night_option
@click.argument("task_id", required=False)
@click.option("--follow", "-f", is_flag=True, help="Keep printing new receipts as they arrive.")
def receipts_command(task_id: str | None, follow: bool) -> None:
    """Print receipts (lease endings, refusals, verdicts, state changes) as JSON lines.

    With TASK, only that task's. With --follow, waits for new ones until interrupted.
    """
    from overnight.config.context import redis_client, settings
    from overnight.config.keys import Keys
    from overnight.worker.redisio import receipts

    client, keys = redis_client(), Keys(settings().namespace)
    if follow:
        for rc in receipts.follow(client, keys, task_id=task_id):
            click.echo(rc.to_json())
        return
    for rc in receipts.read(client, keys, task_id=task_id):
        click.echo(rc.to_json())


@click.command("logs")
@night_option
@click.argument("task_id")
@click.option("--turn", type=click.IntRange(min=1), metavar="N", help="Only turn N's steps.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing until the task has settled.")
def logs_command(task_id: str, turn: int | None, follow: bool) -> None:
    """Print what the task's steps printed (agent and rules), each under a header line.

    The whole output of every step is kept on the host of the worker that ran it, under
    OVERNIGHT_STATE_DIR/task-logs/<namespace>/<task>/ (up to 8 MiB a step); control
    characters are shown escaped. With --follow, waits for new output until the task has
    ended or paused.
    """
    from overnight.config.context import settings
    from overnight.coordinator.report.logs import print_logs, task_folder, task_log_root
    from overnight.coordinator.tasks.states import SETTLED

    store = _store()
    rec = _record(store, task_id)
    folder = task_folder(rec, task_log_root(settings(), store.keys.namespace))

    def settled() -> bool:
        now = store.get(task_id)
        return now is None or now.state in SETTLED

    printed = print_logs(folder, sys.stdout, turn=turn, follow=follow, settled=settled)
    if not printed:
        which = f"turn {turn} of " if turn is not None else ""
        click.echo(
            f"overnight logs: no step output of {which}task {task_id!r} in {folder}", err=True
        )


@click.command("report")
@night_option
@click.option("--plain", is_flag=True, help="Plain text even on a terminal.")
@click.option(
    "--html",
    "html_file",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE",
    help="Write the whole night as one self-contained HTML page to FILE instead.",
)
def report_command(plain: bool, html_file: Path | None) -> None:
    """The morning view: one line per task with state, calls, turns, time, last verdict.

    With --html FILE: a page that needs no network (what needs a person, tasks by state,
    the envelope, a timeline of every step, the burn-down and a card per task)."""
    from overnight.config.context import redis_client, settings
    from overnight.coordinator.report.view import (
        envelope_lines,
        ledger_lines,
        redis_notices,
        render_plain,
        render_rich,
    )

    if html_file is not None:
        from overnight.coordinator.report.view import write_html

        write_html(redis_client(), settings().namespace, html_file)
        click.echo(str(html_file))
        return
    store = _store()
    records = store.all()
    footer = envelope_lines(redis_client(), settings().namespace, records)
    footer += ledger_lines(redis_client(), settings().namespace)
    footer += redis_notices(redis_client())
    if plain or not sys.stdout.isatty():
        render_plain(records, sys.stdout, footer)
    else:
        render_rich(records, footer)


@click.command("diff")
@night_option
@click.argument("task_id")
@click.option("--stat", is_flag=True, help="Only the diffstat.")
def diff_command(task_id: str, stat: bool) -> None:
    """Print the task branch's diff against its base (git diff BASE..overnight/TASK).

    Merging stays a person's act: review this, then merge the branch yourself.
    """
    from overnight.coordinator.workspace import worktree as workspace

    store = _store()
    rec = _record(store, task_id)
    base = rec.spec.base
    if base is None or base.mode != workspace.WORKTREE or base.sha is None:
        raise CommandError(
            f"task {task_id!r} did not work on a branch (workspace is "
            f"{base.mode if base else 'unknown'})",
            EXIT_USAGE,
        )
    branch = rec.checkpoint.branch or workspace.branch_name(task_id)
    try:
        if stat:
            click.echo(
                workspace.git("diff", "--stat", f"{base.sha}..{branch}", cwd=base.root), nl=False
            )
        else:
            click.echo(workspace.diff(base.root, base.sha, branch), nl=False)
    except (workspace.GitError, OSError) as exc:
        raise CommandError(f"overnight diff: {exc}", EXIT_USAGE) from None


@click.group("worktrees")
def worktrees_group() -> None:
    """The task worktrees under overnight's state folder."""


@worktrees_group.command("prune")
def worktrees_prune_command() -> None:
    """Remove the worktrees of tasks that ended; their branches stay.

    A locked worktree (a step is running in it), one with uncommitted changes, or one of a
    task still queued, running or paused is left, and said so in one line.
    """
    from overnight.coordinator.workspace.taskspace import prune
    from overnight.coordinator.workspace.worktree import state_dir

    for line in prune(_store(), state_dir()):
        click.echo(line)
