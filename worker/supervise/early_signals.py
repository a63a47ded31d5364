"""Keep SIGTERM/SIGINT/SIGHUP that arrive while ``overnight supervise`` is still starting.

The CLI entry point calls :func:`install` before importing anything heavy; the
supervisor's own catcher takes what was kept with :func:`take` and forwards it.
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_kept: list[int] = []


def _keep(signum: int, _frame: object) -> None:
    _kept.append(signum)


def install() -> None:
    """Record the forwarded signals from now on instead of dying of them."""
    for sig in SIGNALS:
        signal.signal(sig, _keep)


def take() -> list[int]:
    """The signals kept so far (each once)."""
    out = list(_kept)
    _kept.clear()
    return out
