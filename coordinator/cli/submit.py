"""``overnight submit``: validate task files and enqueue them. Parsing only."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from overnight.config.exits import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, CommandError
from overnight.coordinator.cli.tasks import task_store

if TYPE_CHECKING:
    from overnight.coordinator.tasks.store import TaskStore


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
    store = task_store()
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
