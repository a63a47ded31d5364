"""``overnight envelope``: reset, inspect and spend the shared call budget from a shell."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn, TypeVar

import click

if TYPE_CHECKING:
    from overnight.worker.envelope.envelope import CallEnvelope, EnvelopeState

T = TypeVar("T")
_NAME_HELP = "Envelope name (every process naming it shares one budget)."


@click.group("envelope")
def envelope_group() -> None:
    """The shared call budget: model and tool calls of every worker count against it."""


# A negative N must reach the argument (and be refused as a value) instead of being read as
# an unknown option.
@envelope_group.command("reset", context_settings={"ignore_unknown_options": True})
@click.argument("n", type=int)
@click.option("--max-model", type=click.IntRange(min=0), help="Cap on model units.")
@click.option("--max-tool", type=click.IntRange(min=0), help="Cap on tool units.")
@click.option(
    "--tokens",
    type=click.IntRange(min=0),
    help="Cap on tokens (input + output) the gateway meters.",
)
@click.option("--name", default="default", show_default=True, help=_NAME_HELP)
def reset_command(
    n: int, max_model: int | None, max_tool: int | None, tokens: int | None, name: str
) -> None:
    """Set the envelope to N calls; consumed counters go back to 0."""
    if n < 0:
        raise click.BadParameter(f"must be 0 or more, not {n}", param_hint="N")
    _print(
        _call(
            name,
            lambda env: env.reset(n, max_model=max_model, max_tool=max_tool, max_tokens=tokens),
        )
    )


@envelope_group.command("status")
@click.option("--name", default="default", show_default=True, help=_NAME_HELP)
def status_command(name: str) -> None:
    """Print what is left and what was spent.

    Exit 2 if the envelope was never created (the state says ``"exists": false``) or its
    record is corrupt.
    """
    from overnight.config.exits import EXIT_REFUSED, CommandError
    from overnight.worker.envelope.envelope import EnvelopeEmpty

    try:
        state = _call(name, lambda env: env.snapshot())
    except EnvelopeEmpty as exc:
        raise CommandError(str(exc), EXIT_REFUSED) from None
    _print(state, indent=2)
    if not state.exists:
        click.echo(
            f"overnight envelope: envelope {name!r} does not exist; create it with "
            "`overnight envelope reset N` (or OVERNIGHT_BUDGET for the coordinator)",
            err=True,
        )
        raise click.exceptions.Exit(EXIT_REFUSED)


@envelope_group.command("consume")
@click.argument("kind", type=click.Choice(["model", "tool"]))
@click.option("--request-id", help="Name this call: a repeat gets the first answer again.")
@click.option("--dry-run", is_flag=True, help="Only say whether it would be allowed.")
@click.option("--name", default="default", show_default=True, help=_NAME_HELP)
def consume_command(kind: str, request_id: str | None, dry_run: bool, name: str) -> None:
    """Take one KIND call from the envelope; exit 2 if refused."""
    from overnight.config.exits import EXIT_REFUSED
    from overnight.worker.envelope.envelope import EnvelopeEmpty

    if request_id is not None and not 1 <= len(request_id) <= 256:
        raise click.BadParameter("must be 1-256 characters", param_hint="--request-id")
    try:
        state = _call(name, lambda env: env.try_consume(kind, request_id, dry_run=dry_run))
    except EnvelopeEmpty as exc:
        click.echo(json.dumps(exc.public()))
        if exc.reason == "unknown":
            click.echo(f"overnight envelope: {exc}", err=True)
        raise click.exceptions.Exit(EXIT_REFUSED) from None
    _print(state)


@envelope_group.command("demo")
@click.option("--budget", type=click.IntRange(min=0), default=3, show_default=True)
@click.option("--name", default="default", show_default=True, help=_NAME_HELP)
def demo_command(budget: int, name: str) -> None:
    """Reset to BUDGET and run five planned steps until the envelope refuses."""
    from overnight.worker.envelope.guards import demo_steps, run_agent_loop

    def run(env: CallEnvelope) -> EnvelopeState | None:
        env.reset(budget)
        return run_agent_loop(env, demo_steps(), echo=click.echo).state

    state = _call(name, run)
    if state is None:
        _unreachable("the state could not be read back")
    else:
        _print(state)


def _call(name: str, action: Callable[[CallEnvelope], T]) -> T:
    from overnight.config.context import redis_client, settings
    from overnight.worker.envelope.envelope import CallEnvelope, EnvelopeUnavailable

    cfg = settings()
    try:
        env = CallEnvelope(redis_client(), name, cfg.namespace, request_ttl=cfg.request_id_ttl)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--name") from None
    try:
        return action(env)
    except EnvelopeUnavailable as exc:
        _unreachable(exc.detail)
    except ValueError as exc:  # a count the envelope's scripts cannot hold exactly (> 2**53)
        raise click.UsageError(str(exc)) from None


def _unreachable(detail: str) -> NoReturn:
    from overnight.config.exits import EXIT_REDIS_DOWN, CommandError

    raise CommandError(f"Redis unreachable: {detail}", EXIT_REDIS_DOWN)


def _print(state: EnvelopeState, indent: int | None = None) -> None:
    click.echo(json.dumps(state.model_dump(), indent=indent))
