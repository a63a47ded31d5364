"""What a night left, per task or for all: receipts, step logs, the report, a task
branch's diff, and the worktrees of ended tasks. Parsing only."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from overnight.config.exits import EXIT_USAGE, CommandError
from overnight.coordinator.cli.nightopt import night_option
from overnight.coordinator.cli.tasks import task_record, task_store

if TYPE_CHECKING:
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

    store = task_store()
    rec = task_record(store, task_id)
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
        sandbox_lines,
    )

    if html_file is not None:
        from overnight.coordinator.report.view import write_html

        write_html(redis_client(), settings().namespace, html_file)
        click.echo(str(html_file))
        return
    store = task_store()
    records = store.all()
    footer = envelope_lines(redis_client(), settings().namespace, records)
    footer += ledger_lines(redis_client(), settings().namespace)
    footer += redis_notices(redis_client())
    footer += sandbox_lines(redis_client(), settings().namespace)
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

    store = task_store()
    rec = task_record(store, task_id)
    base = rec.spec.base
    if base is None or base.mode != workspace.WORKTREE or base.sha is None:
        raise CommandError(
            f"task {task_id!r} did not work on a branch (workspace is "
            f"{base.mode if base else 'unknown'})",
            EXIT_USAGE,
        )
    branch = rec.checkpoint.branch or workspace.branch_name(task_id)
    sha, root = base.sha, base.root
    try:
        if rec.spec.repo is not None:  # the branch as the remote has it, fetched here
            from overnight.coordinator.workspace import remote

            state = workspace.state_dir()
            here = remote.local_base(base, rec.spec, state)
            root = here.root
            branch = remote.sync(remote.Remote.of(rec.spec, state), here, task_id) or sha
        if stat:
            click.echo(workspace.git("diff", "--stat", f"{sha}..{branch}", cwd=root), nl=False)
        else:
            click.echo(workspace.diff(root, sha, branch), nl=False)
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

    for line in prune(task_store(), state_dir()):
        click.echo(line)
