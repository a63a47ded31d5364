"""``overnight supervise``, ``overnight beat`` and ``overnight lease show|list``.

Thin commands over :mod:`worker.supervise.supervisor`, :mod:`worker.beat.channel` and
:mod:`worker.lease.store`. ``supervise`` and ``beat`` are on hot paths (beat is called in loops),
so neither imports pydantic: ``beat`` needs no settings at all (only the channel in its
environment), and ``supervise`` reads its few settings with the same rules ``Settings``
uses (:func:`config.validate.read_fast`), falling back to ``Settings`` whenever only it can
decide.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import fields
from typing import TYPE_CHECKING

import click

from overnight.config.exits import EXIT_REDIS_DOWN, EXIT_REFUSED, EXIT_USAGE, CommandError
from overnight.config.validate import NAME_RE, NAME_RULE, QuickSettings, read_fast

if TYPE_CHECKING:
    from collections.abc import Mapping

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def quick_settings(environ: Mapping[str, str] | None = None) -> QuickSettings:
    """Settings for ``supervise``; raises ``ConfigError`` (exit 78) on a bad value."""
    fast = read_fast(os.environ if environ is None else environ)
    if fast is not None:
        return fast
    from overnight.config.context import settings

    s = settings()
    return QuickSettings(**{f.name: getattr(s, f.name) for f in fields(QuickSettings)})


def _seconds(name: str, value: float | None, default: float, *, zero_ok: bool = False) -> float:
    if value is None:
        return default
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        need = ">= 0" if zero_ok else "> 0"
        raise click.BadParameter(f"must be a finite number of seconds {need}", param_hint=name)
    return value


def check_lease_id(value: str) -> str:
    """``value`` if it is a usable lease id, else a usage error (exit 64)."""
    if not NAME_RE.match(value):
        raise click.BadParameter(NAME_RULE, param_hint="lease id")
    return value


def step_env_options(items: tuple[str, ...], environ: Mapping[str, str]) -> dict[str, str]:
    """``--env NAME=VALUE`` / ``--env NAME`` (passed on from here) as variables for the
    child; a credential or a name overnight sets itself is a usage error (exit 64)."""
    from overnight.worker.sandbox.stepenv import declared_problem

    out: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        problem = declared_problem(name) if _ENV_NAME.match(name) else "is not a variable name"
        if problem is not None:
            raise click.BadParameter(f"{name!r} {problem}", param_hint="--env")
        if eq:
            out[name] = value
        elif name in environ:
            out[name] = environ[name]
    return out


_SUPERVISE_HELP = """Run CMD under one lease, on this host, and exit with how it ended.

\b
The lease lapses when CMD is silent for the gap or runs past the deadline; then
its whole tree (process group, session, setsid'd and double-forked escapees) gets
SIGTERM, the grace, then SIGKILL. A beat is an output line (unless
--no-output-beats), `overnight beat` or overnight.pulse run by any descendant, or
with --beat-while-alive the child merely living.

\b
CMD gets no Redis URL, credential or lease token: its environment is PATH, LANG,
LANGUAGE, LC_*, TERM and TZ from here, the --env variables, HOME and TMPDIR in a
scratch folder removed at the end, OVERNIGHT_LEASE_ID and OVERNIGHT_BEAT_SOCKET (the
supervisor's beat channel). Its stdin is /dev/null and its output is passed
through. At the end the lease document is printed as indented JSON (unless --quiet).

\b
Exit: 0 done, N the child's exit N, 128+S child or supervisor got signal S,
2 deadline, 3 heartbeat gap, 4 lease lost (Redis unreachable longer than the gap),
64 bad arguments, 69 Redis unreachable at start, 78 bad configuration.

\b
Example: overnight supervise --gap 10 --deadline 600 -- python agent.py
"""


@click.command(
    "supervise",
    help=_SUPERVISE_HELP,
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
)
@click.option(
    "--deadline",
    type=float,
    metavar="SEC",
    help="Lease budget in seconds [default: OVERNIGHT_DEADLINE, 180].",
)
@click.option(
    "--gap",
    type=float,
    metavar="SEC",
    help="Longest silence in seconds [default: OVERNIGHT_HEARTBEAT_GAP, 30].",
)
@click.option(
    "--grace",
    type=float,
    metavar="SEC",
    help="Seconds between SIGTERM and SIGKILL [default: OVERNIGHT_GRACE, 5].",
)
@click.option("--lease-id", metavar="ID", help="Use this lease id (refused if it exists).")
@click.option(
    "--lease-file",
    metavar="PATH",
    type=click.Path(dir_okay=False),
    help="Mirror the lease document to this JSON file on every transition.",
)
@click.option("--quiet", is_flag=True, help="Do not print the final lease document.")
@click.option("--no-output-beats", is_flag=True, help="Output lines do not count as beats.")
@click.option(
    "--beat-while-alive",
    is_flag=True,
    help="Beat on a timer while CMD lives (the deadline still applies).",
)
@click.option(
    "--env",
    "env_items",
    multiple=True,
    metavar="NAME[=VALUE]",
    help="Give CMD this variable (NAME alone: its value here). Repeatable.",
)
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARG]...")
def supervise_command(
    deadline: float | None,
    gap: float | None,
    grace: float | None,
    lease_id: str | None,
    lease_file: str | None,
    quiet: bool,
    no_output_beats: bool,
    beat_while_alive: bool,
    env_items: tuple[str, ...],
    cmd: tuple[str, ...],
) -> None:
    from overnight.worker.supervise import supervisor

    # First, before any slow start-up: a SIGTERM from now on is kept and forwarded.
    catcher = supervisor.SignalCatcher.install()
    try:
        code = _supervise(
            catcher,
            deadline,
            gap,
            grace,
            lease_id,
            lease_file,
            quiet,
            no_output_beats,
            beat_while_alive,
            env_items,
            list(cmd),
        )
    finally:
        catcher.close()
    raise click.exceptions.Exit(code)


def _supervise(
    catcher: object,
    deadline: float | None,
    gap: float | None,
    grace: float | None,
    lease_id: str | None,
    lease_file: str | None,
    quiet: bool,
    no_output_beats: bool,
    beat_while_alive: bool,
    env_items: tuple[str, ...],
    argv: list[str],
) -> int:
    from overnight.config.keys import Keys
    from overnight.worker.lease.store import LeaseRefused
    from overnight.worker.sandbox import launch
    from overnight.worker.sandbox.stepuser import decide
    from overnight.worker.sandbox.uidpool import held
    from overnight.worker.supervise import supervisor

    assert isinstance(catcher, supervisor.SignalCatcher)
    s = quick_settings()
    user = decide(s.step_user, s.allow_root_steps, os.geteuid(), uids=s.step_uids)  # or exit 78
    sandbox = launch.require(s.sandbox, user)  # exit 78 if one is asked for and cannot start
    if sandbox and lease_file is not None:
        _check_in_tree(lease_file)
    spec = supervisor.StepSpec(
        argv=argv,
        deadline=_seconds("--deadline", deadline, s.deadline),
        gap=_seconds("--gap", gap, s.heartbeat_gap),
        grace=_seconds("--grace", grace, s.grace, zero_ok=True),
        lease_id=check_lease_id(lease_id) if lease_id is not None else None,
        lease_file=lease_file,
        output_beats=not no_output_beats,
        beat_while_alive=beat_while_alive,
        env=step_env_options(env_items, os.environ),
        user=user,
        sandbox=sandbox,
    )
    client = supervisor.client_for_url(s.redis_url, spec.gap)
    try:  # with a range of step uids, the step runs as one held for it alone
        with held(user, spec.lease_id or f"supervise-{os.getpid()}") as step_user:
            spec = dataclasses.replace(spec, user=step_user)
            result = supervisor.run_supervised(client, Keys(s.namespace), spec, signals=catcher)
    except LeaseRefused as exc:
        raise CommandError(str(exc), EXIT_REFUSED) from None
    if not quiet:
        # Said with the result: a call refused before its step starts prints its one line.
        if not sandbox:
            click.echo(
                f"overnight supervise: the step ran WITHOUT a sandbox ({launch.SANDBOX_VAR}=off)",
                err=True,
            )
        click.echo(result.doc.to_json())
    return result.exit_code


def _check_in_tree(lease_file: str) -> None:
    """A sandboxed step sees the current folder and nothing else of the host's files: a
    lease file elsewhere would never be seen by it (its worker would stop at once)."""
    tree = os.path.realpath(os.getcwd())
    folder = os.path.realpath(os.path.dirname(os.path.abspath(lease_file)))
    if folder != tree and not folder.startswith(tree.rstrip("/") + "/"):
        raise CommandError(
            f"--lease-file {lease_file} is outside the current folder {tree}, the only one "
            "a sandboxed step sees: put it there (or run with OVERNIGHT_SANDBOX=off)",
            EXIT_USAGE,
        )


@click.command("beat", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--note", metavar="TEXT", help="Also set the lease's note.")
def beat_command(note: str | None) -> None:
    """Renew the lease this process runs under (for the supervised child and its descendants).

    \b
    Asks the supervisor through its beat channel (OVERNIGHT_LEASE_ID and
    OVERNIGHT_BEAT_SOCKET, which `overnight supervise` hands its child); no Redis.
    Prints nothing. Exit: 0 renewed, 2 refused (the lease is over and never comes
    back, or this process is not of the lease's tree), 64 no lease in the
    environment, 69 the supervisor did not answer.
    """
    from overnight.worker.beat.channel import ChannelDown, NoChannel, send_beat
    from overnight.worker.lease.store import LeaseRefused

    try:
        send_beat(note)
    except NoChannel as exc:
        raise CommandError(f"{exc}; run this under overnight supervise", EXIT_USAGE) from None
    except LeaseRefused as exc:
        raise CommandError(f"beat {exc}", EXIT_REFUSED) from None
    except ChannelDown as exc:
        raise CommandError(str(exc), EXIT_REDIS_DOWN) from None


@click.group("lease", context_settings={"help_option_names": ["-h", "--help"]})
def lease_group() -> None:
    """Show or list the leases of the namespace (OVERNIGHT_NAMESPACE)."""


def _leases() -> object:
    from overnight.config.context import redis_client, settings
    from overnight.config.keys import Keys
    from overnight.worker.lease.store import Leases

    return Leases(redis_client(), Keys(settings().namespace))


@lease_group.command("show")
@click.argument("lease_id")
def lease_show(lease_id: str) -> None:
    """Print one lease document as indented JSON (contract keys first).

    Exit 64 if there is no such lease.
    """
    from overnight.worker.lease.store import LeaseCorrupt, Leases

    check_lease_id(lease_id)
    leases = _leases()
    assert isinstance(leases, Leases)
    try:
        doc = leases.get(lease_id)
    except LeaseCorrupt as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    if doc is None:
        raise CommandError(f"no lease {lease_id} in namespace {leases.keys.namespace}")
    click.echo(doc.to_json())


@lease_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON document per line instead.")
@click.option(
    "--limit",
    type=click.IntRange(1, 100_000),
    default=100,
    show_default=True,
    help="At most this many leases, newest first.",
)
@click.option(
    "--status",
    type=click.Choice(["running", "done", "expired", "killed"]),
    help="Only leases with this status.",
)
def lease_list(as_json: bool, limit: int, status: str | None) -> None:
    """List recent leases, newest first, one line per lease.

    \b
    Each line: LEASE_ID STATUS HOLDER_PID HOST STARTED(UTC) NOTE, separated by
    single spaces (the note last, since it may contain spaces). With --json, each
    line is instead one lease document as compact JSON (JSON lines).
    """
    from datetime import UTC, datetime

    from overnight.worker.lease.store import Leases

    leases = _leases()
    assert isinstance(leases, Leases)
    for doc in leases.recent(limit):
        if status is not None and doc.status != status:
            continue
        if as_json:
            click.echo(json.dumps(doc.public()))
            continue
        started = datetime.fromtimestamp(doc.started_unix, UTC)
        click.echo(
            f"{doc.lease_id} {doc.status} {doc.holder_pid} {doc.host or '-'} "
            f"{started:%Y-%m-%dT%H:%M:%SZ} {doc.note}"
        )
