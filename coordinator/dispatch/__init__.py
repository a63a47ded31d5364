"""Tasks on RQ: enqueueing (``enqueue``), the job function (``job``), recovery of tasks
whose worker died (``recovery``, led by ``lead``), the worker class (``worker``), and the
gateway a worker keeps up (``gateway_probe``, ``gateway_watch``).

``overnight.coordinator.dispatch.perform_task`` and ``...dispatch.OvernightWorker`` are the
paths RQ jobs and ``rq worker -w`` name, so they stay importable from here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OvernightWorker", "perform_task"]


def __getattr__(name: str) -> Any:
    if name == "perform_task":
        from overnight.coordinator.dispatch.job import perform_task

        return perform_task
    if name == "OvernightWorker":
        from overnight.coordinator.dispatch.worker import OvernightWorker

        return OvernightWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
