"""``--state-dir`` of the commands that read a night (status, logs, diff, receipts, report)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

F = TypeVar("F", bound=Callable[..., Any])


def _read_night(ctx: click.Context, param: click.Parameter, value: Path) -> Path:
    if ctx.resilient_parsing:
        return value
    from overnight.coordinator.night.record import use_night

    assert param.name is not None
    use_night(value, ctx.get_parameter_source(param.name) is not ParameterSource.DEFAULT)
    return value


def night_option(command: F) -> F:
    """Add ``--state-dir``: with no Redis configured, read the latest night ``up`` or the
    demo ran with that state folder (default ``.overnight`` here)."""
    return click.option(
        "--state-dir",
        type=click.Path(file_okay=False, readable=False, path_type=Path),
        default=Path(".overnight"),
        show_default=True,
        metavar="DIR",
        expose_value=False,
        callback=_read_night,
        help="Read the latest night `up` or the demo ran with this state folder: the one "
        "here when OVERNIGHT_REDIS_URL is unset, this one whenever given (it wins over "
        "OVERNIGHT_REDIS_URL). One line on stderr says which night and Redis are read.",
    )(command)
