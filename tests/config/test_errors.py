"""Every refusal the project raises on purpose is an OvernightError, and keeps the base a
caller may already catch it by."""

from __future__ import annotations

import importlib

import pytest

import overnight
from overnight.config.errors import OvernightError

REFUSALS = [
    ("overnight.config.stopat", "StopAtError", ValueError),
    ("overnight.config.settings", "ConfigError", Exception),
    ("overnight.config.exits", "CommandError", Exception),
    ("overnight.config.folders", "FolderUnusable", Exception),
    ("overnight.worker.sandbox.launch", "SandboxUnavailable", Exception),
    ("overnight.worker.sandbox.stepuser", "StepUserRefused", Exception),
    ("overnight.worker.lease.store", "LeaseRefused", Exception),
    ("overnight.worker.lease.store", "LeaseCorrupt", ValueError),
    ("overnight.worker.gateway.meter", "Refused", Exception),
    ("overnight.worker.envelope.envelope", "EnvelopeRefused", Exception),
    ("overnight.worker.envelope.envelope", "EnvelopeEmpty", Exception),
    ("overnight.worker.envelope.envelope", "EnvelopeUnavailable", Exception),
    ("overnight.worker.envelope.envelope", "ReservationLost", Exception),
    ("overnight.worker.beat.channel", "NoChannel", LookupError),
    ("overnight.worker.beat.channel", "ChannelDown", OSError),
    ("overnight.coordinator.tasks.model_step", "ModelError", Exception),
    ("overnight.coordinator.tasks.record", "TaskCorrupt", ValueError),
    ("overnight.coordinator.tasks.taskfile", "TaskFileError", Exception),
    ("overnight.coordinator.tasks.store", "TaskRefused", Exception),
    ("overnight.coordinator.tasks.store", "TaskIdTaken", Exception),
    ("overnight.coordinator.workspace.worktree", "GitError", Exception),
    ("overnight.coordinator.workspace.taskspace", "WorkspaceError", Exception),
    ("overnight.coordinator.night.embedded_redis", "RedisBinaryMissing", RuntimeError),
]


@pytest.mark.parametrize(("module", "name", "base"), REFUSALS)
def test_every_refusal_is_an_overnight_error(module: str, name: str, base: type) -> None:
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, OvernightError)
    assert issubclass(cls, base)


def test_the_root_is_public() -> None:
    assert overnight.OvernightError is OvernightError
    assert "OvernightError" in dir(overnight)


def test_an_os_error_refusal_still_carries_errno() -> None:
    from overnight.worker.beat.channel import ChannelDown

    err = ChannelDown(110, "timed out")
    assert (err.errno, err.strerror) == (110, "timed out")
    assert isinstance(err, OvernightError)
