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
    ("overnight.worker.sandbox.uidpool", "PoolExhausted", Exception),
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
    ("overnight.coordinator.workspace.remote", "PushRefused", Exception),
    ("overnight.coordinator.workspace.taskspace", "WorkspaceError", Exception),
    ("overnight.coordinator.night.embedded_redis", "RedisBinaryMissing", RuntimeError),
    ("overnight.coordinator.tasks.loop", "CallRefused", Exception),
    ("overnight.coordinator.dispatch.job", "TaskNotVerified", Exception),
    ("overnight.coordinator.tasks.runagain", "RerunRefused", Exception),
]


def _project_exceptions() -> list[type[BaseException]]:
    """Every exception class a module of the package defines (not one it imports)."""
    import pkgutil

    found = []
    for info in pkgutil.walk_packages(overnight.__path__, "overnight."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == info.name
            ):
                found.append(value)
    return found


def test_no_exception_class_is_left_outside_the_root() -> None:
    classes = _project_exceptions()
    assert len(classes) >= len(REFUSALS)
    outside = sorted(
        f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, OvernightError)
    )
    assert outside == []
    listed = {getattr(importlib.import_module(m), n) for m, n, _ in REFUSALS}
    unlisted = sorted(
        f"{c.__module__}.{c.__qualname__}"
        for c in classes
        if c not in listed and c is not OvernightError
    )
    assert unlisted == [], "add them to REFUSALS with the base a caller may catch them by"


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
