"""Shared fixtures: a private redis-server per session, a fresh namespace per test."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import fakeredis
import pytest
import redis

from overnight.coordinator.night.embedded_redis import (
    EmbeddedRedis,
    RedisBinaryMissing,
    find_redis_server,
)
from overnight.worker.sandbox.stepuser import StepUser, lookup
from tests.helpers import lacking, scripted_upstream

# Tests run steps as whoever runs pytest (root in CI) unless they ask for the step user
# (the `step_user` fixture): pytest's own tmp folders are root's and 0700, which a step
# user could not enter. The containment tests use the step user.
ROOT_OPT_IN = {"OVERNIGHT_ALLOW_ROOT_STEPS": "1"} if os.geteuid() == 0 else {}
STEP_USER = "overnight-step"


def pytest_sessionstart(session: pytest.Session) -> None:
    try:
        find_redis_server()
    except RedisBinaryMissing as exc:
        pytest.exit(str(exc), returncode=3)
    os.environ.update(ROOT_OPT_IN)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "capability(missing): needs a capability; missing (a reason, or None) skips the "
        "test locally and fails it under CI=true (tests.helpers.capability)",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("capability"):
        if mark.args and mark.args[0]:
            lacking(str(mark.args[0]))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """One private redis-server for the whole session; tests isolate by namespace. It
    requires a password (in its URL), as `overnight up`'s does: a step can reach its port
    but must never get in."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), password=uuid.uuid4().hex)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def step_user() -> StepUser:
    """The unprivileged user steps run as (``overnight-step``, created once if missing, as
    `.ci/run` and the Dockerfile do); skips the test unless pytest runs as root."""
    if os.geteuid() != 0:
        pytest.skip("running steps as another user needs root")
    if lookup(STEP_USER) is None and shutil.which("useradd"):
        add = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin"]
        subprocess.run([*add, STEP_USER], check=False, capture_output=True)
    found = lookup(STEP_USER) or lookup("nobody")
    if found is None:
        pytest.skip(f"no {STEP_USER} or nobody user on this host")
    return found


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[..., EmbeddedRedis]]:
    """Start extra private servers (for tests that kill or restart Redis); all stopped after.
    Each requires a fresh password (in its ``url``), as the session's does, unless the test
    names its own (``password=``, or ``--requirepass`` in ``extra_args``) or asks for none
    (``password=None``: a Redis anyone gets into)."""
    started: list[EmbeddedRedis] = []

    def make(**kwargs: object) -> EmbeddedRedis:
        extra = kwargs.get("extra_args") or []
        if "password" not in kwargs and "--requirepass" not in extra:  # type: ignore[operator]
            kwargs["password"] = uuid.uuid4().hex
        server = EmbeddedRedis(tmp_path / f"redis-{len(started)}", **kwargs)  # type: ignore[arg-type]
        server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop(kill=True)


@pytest.fixture
def namespace() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def r(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    """A text client on the private server."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def fake() -> fakeredis.FakeRedis:
    """A fakeredis client with Lua, for logic tests."""
    return fakeredis.FakeRedis(decode_responses=True)


@pytest.fixture
def env(
    redis_server: EmbeddedRedis, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> dict[str, str]:
    """Environment pointing at the private server and this test's namespace.

    It is applied to this process too (for in-process settings) and returned for subprocesses.
    """
    values = {
        "OVERNIGHT_REDIS_URL": redis_server.url,
        "OVERNIGHT_NAMESPACE": namespace,
        **ROOT_OPT_IN,
    }
    for key in list(os.environ):
        if key.startswith("OVERNIGHT_") or key == "MODEL_URL":
            monkeypatch.delenv(key)
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    full = {k: v for k, v in os.environ.items()}
    full["PYTHONUNBUFFERED"] = "1"
    return full


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    """The scripted upstream, one per test module."""
    with scripted_upstream() as url:
        yield url
