"""How overnight starts its own interpreters."""

from __future__ import annotations

import sys


def python_module(module: str, *args: str) -> list[str]:
    """argv that runs ``python -m module args…`` with this interpreter.

    ``-P`` keeps the working folder off the import path: a step's workdir or the user's
    folder may hold a ``config.py``, a ``worker.py`` or an ``overnight/`` of its own.
    """
    return [sys.executable, "-P", "-m", module, *args]


def overnight_argv(*args: str) -> list[str]:
    """argv that runs this installation's ``overnight`` CLI."""
    return python_module("overnight", *args)
