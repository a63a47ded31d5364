"""Fixtures of the agent preset tests: a proxy trap, scripted upstreams, where a task's files
go and who runs its steps, and the bench that runs a preset as a task."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from overnight.worker.sandbox.stepuser import StepUser
from tests.agent_tasks import Bench, Scripted, Trap


@pytest.fixture
def trap() -> Iterator[Trap]:
    t = Trap()
    yield t
    t.sock.close()


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[Scripted]:
    with contextlib.ExitStack() as stack:
        yield Scripted(tmp_path, stack)


@pytest.fixture(params=[False, True], ids=["root", "step-user"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, StepUser | None]]:
    """Where a task's files go and who its steps run as: root (the suite's default) in
    tmp_path, or the step user, as in production, in a folder it can enter."""
    if not request.param:
        yield tmp_path, None
        return
    user = request.getfixturevalue("step_user")
    base = Path(tempfile.mkdtemp(prefix="overnight-agent-", dir="/tmp"))
    os.chmod(base, 0o711)
    yield base, user
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def bench(
    r: redis.Redis,
    namespace: str,
    env: dict[str, str],
    tmp_path: Path,
    trap: Trap,
    scripted: Scripted,
) -> Bench:
    return Bench(r, namespace, env, tmp_path, trap, scripted)
