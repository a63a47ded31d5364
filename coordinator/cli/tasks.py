"""Commands on one task or all of them: status, reconcile, rerun; and the helpers every task
command shares (the store, a record or a usage error, the status JSON). Parsing only; the
logic lives in tasks, dispatch and report, imported when a command runs."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from overnight.config.exits import EXIT_REFUSED, EXIT_USAGE, CommandError
from overnight.coordinator.cli.nightopt import night_option

if TYPE_CHECKING:
    from overnight.coordinator.tasks.store import TaskRecord, TaskStore


def task_store() -> TaskStore:
    """The task store of the namespace the settings name."""
    from overnight.config.context import redis_client, settings
    from overnight.config.keys import Keys
    from overnight.coordinator.tasks.store import TaskStore

    return TaskStore(redis_client(), Keys(settings().namespace))


def task_record(store: TaskStore, task_id: str) -> TaskRecord:
    """The task, or a usage error (exit 2) naming why there is none."""
    from overnight.coordinator.tasks.store import TaskCorrupt

    try:
        rec = store.get(task_id)
    except TaskCorrupt as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    if rec is None:
        raise CommandError(f"no task {task_id!r} in namespace {store.keys.namespace!r}", EXIT_USAGE)
    return rec


def statuses(store: TaskStore, records: list[TaskRecord]) -> list[dict[str, Any]]:
    """``overnight status`` JSON of each record, token fields included, and ``sandbox``: how
    the host of its worker contains steps (``bwrap``, ``off``; null before it ran)."""
    from overnight.coordinator.report.tokens import token_fields, with_tokens
    from overnight.coordinator.report.view import status_dict
    from overnight.worker.sandbox import modes

    tokens = token_fields(store.client, store.keys, records)
    hosts = modes.read(store.client, store.keys)
    out = []
    for rec in records:
        found = with_tokens(status_dict(rec, store.claim_alive(rec.id)), tokens[rec.id])
        found["sandbox"] = hosts.get(rec.runner.host) if rec.runner else None
        out.append(found)
    return out


def status_json(store: TaskStore, rec: TaskRecord) -> str:
    """``overnight status TASK``'s JSON."""
    return json.dumps(statuses(store, [rec])[0], indent=2)


@click.command("status")
@night_option
@click.argument("task_id", required=False)
def status_command(task_id: str | None) -> None:
    """Print a task's state as JSON (state, calls_used, turns, last_verdict, ...).

    tokens_used is what the gateway charged the task (held against max_tokens);
    input_tokens and output_tokens are the upstream's figures from the ledger.

    sandbox is how the host that ran it contains steps (bwrap, or off).

    With no TASK, prints a JSON array with every task of the namespace.
    """
    store = task_store()
    if task_id is not None:
        click.echo(status_json(store, task_record(store, task_id)))
        return
    click.echo(json.dumps(statuses(store, store.all()), indent=2))


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
    store = task_store()
    rec = task_record(store, task_id)
    if rec.state == RUNNING and not store.claim_alive(task_id):
        recover(redis_client(), rq_connection(), store.keys, settings())
        rec = task_record(store, task_id)
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
        enqueue(rq_connection(), [task_record(store, task_id)], settings().namespace)
    click.echo(status_json(store, task_record(store, task_id)))


@click.command("rerun")
@night_option
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
    has no calls left. Prints the task's status JSON. With no Redis configured, it works on
    the latest night `up` ran here (--state-dir), which the next `up` there runs.
    """
    from overnight.config.context import rq_connection
    from overnight.coordinator.tasks.runagain import RerunRefused, run_again

    store = task_store()
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
    click.echo(status_json(store, task_record(store, task_id)))


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
