"""The ``overnight`` command: parses, delegates, maps every failure to a contract exit code.

Subcommands live in the modules that own their logic and are imported only when invoked,
so ``overnight supervise`` does not pay for RQ or rich.
"""

from __future__ import annotations

import sys

if sys.argv[1:2] == ["supervise"]:
    # Before the imports below: a SIGTERM during start-up must be forwarded, not fatal.
    from overnight.worker.supervise import early_signals

    early_signals.install()

import importlib
import importlib.util
import json
import traceback
from typing import Any

import click

from overnight.config.exits import (
    EXIT_BAD_CONFIG,
    EXIT_INTERNAL,
    EXIT_REDIS_DOWN,
    EXIT_USAGE,
    CommandError,
)

# command name -> "module:attribute" (under ``overnight.``) of a click command; help text shown
# in the listing.
COMMANDS: dict[str, tuple[str, str]] = {
    "config": ("coordinator.cli.main:config_command", "Print the effective settings as JSON."),
    "supervise": ("coordinator.cli.lease:supervise_command", "Run one command under one lease."),
    "beat": ("coordinator.cli.lease:beat_command", "Renew the current lease (run by a child)."),
    "lease": ("coordinator.cli.lease:lease_group", "Show or list leases."),
    "reaper": ("coordinator.cli.reaper:reaper_command", "Kill trees whose lease lapsed."),
    "envelope": ("coordinator.cli.envelope:envelope_group", "The shared call budget."),
    "gateway": ("coordinator.cli.gateway:gateway_command", "Run the metering model proxy."),
    "submit": ("coordinator.cli.submit:submit_command", "Validate and enqueue task files."),
    "worker": ("coordinator.cli.worker:worker_command", "Run an RQ worker for tasks."),
    "status": ("coordinator.cli.tasks:status_command", "Print a task's state as JSON."),
    "reconcile": ("coordinator.cli.tasks:reconcile_command", "Resume or abort a paused task."),
    "rerun": ("coordinator.cli.tasks:rerun_command", "Run an ended task again."),
    "receipts": ("coordinator.cli.morning:receipts_command", "Print receipts as JSON lines."),
    "logs": ("coordinator.cli.morning:logs_command", "Print what a task's steps printed."),
    "agents": ("coordinator.cli.agents:agents_command", "List agent presets and their CLIs."),
    "report": ("coordinator.cli.morning:report_command", "The morning view of every task."),
    "diff": (
        "coordinator.cli.morning:diff_command",
        "Print a task branch's diff against its base.",
    ),
    "worktrees": ("coordinator.cli.morning:worktrees_group", "Prune the worktrees of ended tasks."),
    "coordinator": ("coordinator.cli.up:coordinator_command", "Run the coordinator process."),
    "up": ("coordinator.cli.up:up_command", "Run the whole system on this machine."),
    "demo": ("coordinator.cli.up:demo_command", "A one-minute demo on an embedded Redis."),
}


def _available(name: str) -> bool:
    module = COMMANDS[name][0].split(":")[0]
    return importlib.util.find_spec(f"overnight.{module}") is not None


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in COMMANDS if _available(name)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS or not _available(cmd_name):
            return None
        module_name, attr = COMMANDS[cmd_name][0].split(":")
        command = getattr(importlib.import_module(f"overnight.{module_name}"), attr)
        assert isinstance(command, click.Command)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for internal errors.")
@click.version_option(package_name="overnight")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """overnight: finite runtime and spend for unattended agent runs.

    Every step runs under a Redis lease that lapses without progress; a reaper kills
    orphaned trees; one call envelope caps model and tool calls across all workers;
    tasks loop agent step -> external verifier on RQ until a machine says "done".

    Configuration comes from OVERNIGHT_* environment variables (see `overnight config`).
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


@click.command("config")
def config_command() -> None:
    """Print the effective settings as JSON (secrets masked)."""
    from overnight.config.context import settings

    click.echo(json.dumps(settings().public_dict(), indent=2))


def _redis_error(exc: BaseException) -> bool:
    redis = sys.modules.get("redis")
    if redis is None:
        return False
    return isinstance(exc, redis.ConnectionError | redis.TimeoutError)


def _redis_permission_error(exc: BaseException) -> bool:
    redis = sys.modules.get("redis")
    return redis is not None and isinstance(exc, redis.exceptions.NoPermissionError)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the CLI and exit with the contract's codes."""
    from overnight.worker.supervise import procs

    # First of all: a step running as this user must not read our environment or memory
    # through /proc or ptrace (exec resets the flag, so the steps we start are dumpable).
    procs.set_dumpable(False)
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        code: Any = cli.main(args=args, prog_name="overnight", standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.exceptions.Abort:
        click.echo("overnight: interrupted", err=True)
        code = 130
    except click.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
        click.echo(f"overnight: {exc.format_message()}{hint}", err=True)
        code = EXIT_USAGE
    except click.ClickException as exc:
        click.echo(f"overnight: {exc.format_message()}", err=True)
        code = EXIT_USAGE
    except CommandError as exc:
        if exc.message:
            click.echo(f"overnight: {exc.message}", err=True)
        code = exc.exit_code
    except Exception as exc:
        from overnight.config.settings import ConfigError

        if isinstance(exc, ConfigError):
            click.echo(f"overnight: bad configuration: {exc}", err=True)
            code = EXIT_BAD_CONFIG
        elif _redis_error(exc):
            click.echo(f"overnight: Redis unreachable: {exc}", err=True)
            code = EXIT_REDIS_DOWN
        elif _redis_permission_error(exc):
            click.echo(
                f"overnight: bad configuration: the Redis user of OVERNIGHT_REDIS_URL "
                f"may not do this ({exc})",
                err=True,
            )
            code = EXIT_BAD_CONFIG
        else:
            if debug:
                traceback.print_exc()
            click.echo(f"overnight: internal error: {type(exc).__name__}: {exc}", err=True)
            code = EXIT_INTERNAL
    sys.exit(code if isinstance(code, int) else 0)
