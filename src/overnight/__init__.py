"""overnight: leases, a reaper, a shared call envelope and verifier-driven tasks on RQ.

The public Python API::

    from overnight import CallEnvelope, EnvelopeEmpty, EnvelopeUnavailable
    from overnight import beat, pulse, run_agent_loop
    from overnight import OvernightError  # every refusal the project raises derives from it

Names load on first use, so ``import overnight`` (and every ``overnight`` command) stays
fast: the supervisor's start-up path never pays for the envelope or RQ.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from overnight.config.errors import OvernightError
    from overnight.worker.beat.pulse import NoLease, beat, pulse
    from overnight.worker.envelope.envelope import (
        CallEnvelope,
        EnvelopeEmpty,
        EnvelopeRefused,
        EnvelopeState,
        EnvelopeUnavailable,
    )
    from overnight.worker.envelope.guards import LoopResult, gated, reserving, run_agent_loop
    from overnight.worker.lease.store import LeaseRefused

_WHERE = {
    "OvernightError": "overnight.config.errors",
    "CallEnvelope": "overnight.worker.envelope.envelope",
    "EnvelopeEmpty": "overnight.worker.envelope.envelope",
    "EnvelopeRefused": "overnight.worker.envelope.envelope",
    "EnvelopeState": "overnight.worker.envelope.envelope",
    "EnvelopeUnavailable": "overnight.worker.envelope.envelope",
    "LoopResult": "overnight.worker.envelope.guards",
    "gated": "overnight.worker.envelope.guards",
    "reserving": "overnight.worker.envelope.guards",
    "run_agent_loop": "overnight.worker.envelope.guards",
    "LeaseRefused": "overnight.worker.lease.store",
    "NoLease": "overnight.worker.beat.pulse",
    "beat": "overnight.worker.beat.pulse",
    "pulse": "overnight.worker.beat.pulse",
}

__all__ = [
    "CallEnvelope",
    "EnvelopeEmpty",
    "EnvelopeRefused",
    "EnvelopeState",
    "EnvelopeUnavailable",
    "LeaseRefused",
    "LoopResult",
    "NoLease",
    "OvernightError",
    "beat",
    "gated",
    "pulse",
    "reserving",
    "run_agent_loop",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'overnight' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
