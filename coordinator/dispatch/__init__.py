"""Tasks on RQ: the job function, the worker class, recovery of tasks whose worker died.

``overnight.coordinator.dispatch.perform_task`` and ``...dispatch.OvernightWorker`` are the
paths RQ jobs and ``rq worker -w`` name, so they stay importable from here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OvernightWorker", "perform_task"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from overnight.coordinator.dispatch import core

        return getattr(core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
