"""``overnight up``, ``overnight demo`` and ``overnight coordinator``: parsing only."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from overnight.config.exits import EXIT_USAGE, CommandError


@click.command("up")
@click.option(
    "--workers",
    "-w",
    type=click.IntRange(1, 64),
    default=2,
    show_default=True,
    help="RQ workers to start.",
)
@click.option(
    "--tasks",
    "-t",
    "tasks",
    multiple=True,
    type=click.Path(exists=True, path_type=Path),
    metavar="DIR",
    help="Enqueue every task file (*.toml, *.json) under DIR.",
)
@click.option(
    "--budget",
    type=click.IntRange(min=0),
    metavar="N",
    help="Create the shared envelope with N calls if it does not exist "
    "[OVERNIGHT_BUDGET]. An existing envelope is never refilled.",
)
@click.option(
    "--exit-when-done",
    is_flag=True,
    help="Stop once every task of this run has ended or paused (or at --until), and exit "
    "0 only if every one finished verified: 5 if one needs a person (halted, paused, "
    "expired, aborted, agent_failed), 6 if some had not ended by --until.",
)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    default=Path(".overnight"),
    show_default=True,
    help="Embedded Redis data, logs and the lock file.",
)
@click.option(
    "--until",
    metavar="TIME",
    help="End the night at TIME: a clock time (07:00, its next occurrence) or an ISO "
    "date-time [OVERNIGHT_STOP_AT]. No step starts after it; running steps get the grace, "
    "then their tasks go back to queued; the report is written; exit 0 (with "
    "--exit-when-done, the night's status).",
)
def up_command(
    workers: int,
    tasks: tuple[Path, ...],
    budget: int | None,
    exit_when_done: bool,
    state_dir: Path,
    until: str | None,
) -> None:
    """Run the whole system on this machine: Redis, a reaper, workers, the coordinator.

    Unless OVERNIGHT_REDIS_URL is set (in the environment or .env), a private redis-server
    is started with its data under --state-dir (never whatever answers on 6379). Shows one
    row per task (state, turn, calls, lease age, last beat) and the envelope's remaining calls,
    redrawn in place on a terminal, as log lines otherwise. Ctrl-C or SIGTERM stops
    everything it started and leaves no process behind: a running step is ended (its
    tree gets SIGTERM and the grace; a second Ctrl-C skips the grace) and its task goes
    back to queued from its checkpoint, to run that step again. A second `up` on the same
    namespace (or the same --state-dir) refuses to start (exit 2). The HTML report is
    refreshed every minute in --state-dir/report.html and written when the night ends.
    """
    from overnight.coordinator.night.up import UpOptions, run_up

    opts = UpOptions(
        workers=workers,
        tasks=list(tasks),
        budget=budget,
        exit_when_done=exit_when_done,
        state_dir=state_dir,
        until=None if until is None else _until(until),
    )
    sys.exit(run_up(opts).code)


def _until(text: str) -> float:
    from datetime import datetime

    from overnight.config.stopat import StopAtError, parse_stop_at

    try:
        return parse_stop_at(text, datetime.now().astimezone()).timestamp()
    except StopAtError as exc:
        raise CommandError(f"--until: {exc}", EXIT_USAGE) from None


@click.command("demo")
@click.option(
    "--workers",
    "-w",
    type=click.IntRange(1, 16),
    default=2,
    show_default=True,
    help="RQ workers to start.",
)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    default=Path(".overnight"),
    show_default=True,
    help="Where the demo keeps each night: its scratch repository of the example tasks, "
    "its Redis data, logs and report (never in the checkout itself).",
)
def demo_command(workers: int, state_dir: Path) -> None:
    """A one-minute demo on a private Redis, no network.

    Runs the four example tasks shipped with overnight: one verified on turn 1; one whose
    agent stops early, is re-prompted with the unmet rule and passes; one whose step hangs
    and is killed by its heartbeat gap; one halted when the shared envelope runs dry. Then
    prints the report and the path of its HTML report. Exits 0 if every task ended as it is
    meant to.
    """
    from overnight.coordinator.night.demo import run_demo

    sys.exit(run_demo(workers, state_dir))


@click.command("coordinator")
@click.option(
    "--tasks",
    "-t",
    "tasks",
    multiple=True,
    type=click.Path(path_type=Path),
    metavar="DIR",
    help="Enqueue every task file under DIR (new ids only).",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0, min_open=True),
    default=2.0,
    show_default=True,
    metavar="SEC",
    help="Seconds between maintenance passes.",
)
@click.option(
    "--exit-when-done",
    is_flag=True,
    help="Exit once every task it knows has ended or paused, and end any night with its "
    "status, as `up --exit-when-done` does (0 only if every task of the night finished "
    "verified; 5 one needs a person; 6 some had not ended).",
)
@click.option("--once", is_flag=True, help="Submit, make one maintenance pass, exit.")
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    default=Path(".overnight"),
    show_default=True,
    help="Where the HTML report (report.html) is written, as under `up`.",
)
def coordinator_command(
    tasks: tuple[Path, ...], interval: float, exit_when_done: bool, once: bool, state_dir: Path
) -> None:
    """The control-plane process (what docker compose runs as `coordinator`).

    Creates the shared envelope from OVERNIGHT_BUDGET if it does not exist (never refills
    one that does), enqueues the task files under each --tasks DIR whose id is new, then
    every --interval: ends leases of hosts whose reaper is gone and recovers tasks whose
    worker died or whose deadline passed. Like `up`, it refreshes --state-dir/report.html
    every minute and POSTs to OVERNIGHT_NOTIFY_URL when a task pauses. At OVERNIGHT_STOP_AT
    it ends the night: once no step runs (at most the wait `up` allows), it writes the
    report, notifies (reason "until"), asks the RQ workers of its queues to stop (an idle
    `overnight worker` then exits 0) and exits 0, so compose's `restart: on-failure` leaves
    it down. --exit-when-done writes the report and notifies (reason "done") before it exits.
    The night's tasks are those of its folders and any other that changed while it ran.
    SIGTERM exits 0.
    """
    from overnight.config.connection import describe
    from overnight.config.context import settings
    from overnight.coordinator.night.control import run_coordinator

    for folder in tasks:
        if not folder.exists():
            raise CommandError(f"--tasks {folder}: no such file or folder", EXIT_USAGE)
    click.echo(f"overnight coordinator: {describe(settings())}", err=True)
    code = run_coordinator(
        list(tasks), interval, exit_when_done=exit_when_done, once=once, state_dir=state_dir
    )
    sys.exit(code)
