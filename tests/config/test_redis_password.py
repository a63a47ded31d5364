"""A Redis that answers without a password is refused by `up`, `worker` and `coordinator`
(one line naming the fix, exit 78) unless OVERNIGHT_ALLOW_PASSWORDLESS_REDIS accepts it; then
each says so at start and the report says so too. Each refusal has a twin with a password
that runs."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from overnight.config.connection import ALLOW_VAR, anyone_gets_in, open_door_line
from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from tests.helpers import OVERNIGHT

Factory = Callable[..., EmbeddedRedis]


@pytest.mark.parametrize(
    ("allowed", "words"),
    [
        (False, ("answers without a password", "requirepass", f"{ALLOW_VAR}=1")),
        (True, ("WARNING", "has no password", f"{ALLOW_VAR}=1")),
    ],
)
def test_the_line_names_the_fix_or_the_risk(allowed: bool, words: tuple[str, ...]) -> None:
    line = open_door_line("overnight worker", "redis://h:1/0", allowed=allowed)
    assert "\n" not in line and line.startswith("overnight worker: WARNING" if allowed else "the")
    assert all(w in line for w in words), line


def test_who_gets_in(redis_factory: Factory) -> None:
    open_server = redis_factory(password=None)
    closed = redis_factory()
    with redis.Redis.from_url(open_server.url) as client:
        assert anyone_gets_in(client)
    with redis.Redis.from_url(closed.url) as client:
        assert not anyone_gets_in(client)
    # A URL with a user and password does not close a server whose default user is open.
    with redis.Redis.from_url(open_server.url) as admin:
        admin.execute_command("ACL", "SETUSER", "night", "on", ">pw-1", "~*", "+@all")
    acl = f"redis://night:pw-1@127.0.0.1:{open_server.port}/0"
    with redis.Redis.from_url(acl) as client:
        assert client.ping() and anyone_gets_in(client)
    # ... and one whose default user is off is closed to anyone without a credential.
    with redis.Redis.from_url(acl) as admin:
        admin.execute_command("ACL", "SETUSER", "default", "off")
    with redis.Redis.from_url(acl) as client:
        assert client.ping() and not anyone_gets_in(client)


def _run(
    env: dict[str, str], *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _refused(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 78, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "password" in line]
    assert len(said) == 1 and proc.stderr.strip().splitlines()[-1] == said[0], proc.stderr
    assert said[0].startswith("overnight: the Redis at redis://127.0.0.1:"), said
    assert f"{ALLOW_VAR}=1" in said[0] and "Traceback" not in proc.stderr


def _up(env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "tasks").mkdir(parents=True, exist_ok=True)
    return _run(
        env,
        "up",
        "--tasks",
        str(tmp_path / "tasks"),
        "--workers",
        "1",
        "--exit-when-done",
        "--state-dir",
        str(tmp_path / "state"),
        cwd=tmp_path,
    )


COMMANDS: dict[str, tuple[str, ...]] = {
    "overnight worker": ("worker", "--burst"),
    "overnight coordinator": ("coordinator", "--once"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_worker_and_coordinator_refuse_an_open_redis_unless_told(
    command: str, env: dict[str, str], redis_factory: Factory, tmp_path: Path
) -> None:
    args = (*COMMANDS[command], *(("--state-dir", str(tmp_path)) if "coord" in command else ()))
    # The twin: the session's Redis has a password; the command runs and says nothing of it.
    proc = _run(env, *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "password" not in proc.stderr
    server = redis_factory(password=None)
    open_env = {**env, "OVERNIGHT_REDIS_URL": server.url}
    _refused(_run(open_env, *args, cwd=tmp_path))
    with redis.Redis.from_url(server.url) as client:
        assert not client.keys("*")  # refused before it wrote anything
    proc = _run({**open_env, ALLOW_VAR: "1"}, *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if f"{ALLOW_VAR}=1" in line]
    assert len(warned) == 1 and warned[0].startswith(f"{command}: WARNING: "), proc.stderr


@pytest.mark.timeout(300)
def test_up_refuses_an_open_redis_unless_told_and_the_report_says_so(
    env: dict[str, str], redis_factory: Factory, tmp_path: Path
) -> None:
    server = redis_factory(password=None)
    open_env = {**env, "OVERNIGHT_REDIS_URL": server.url}
    proc = _up(open_env, tmp_path / "refused")
    _refused(proc)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

    allowed = {**open_env, ALLOW_VAR: "1"}
    proc = _up(allowed, tmp_path / "allowed")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0].startswith("overnight up: WARNING: "), proc.stderr
    page = (tmp_path / "allowed" / "state" / "report.html").read_text()
    assert '<section id="notices">' in page and "Redis without a password" in page
    report = _run(allowed, "report", "--plain")
    assert report.returncode == 0, report.stderr
    assert "Redis without a password" in report.stdout

    # The twin: up's own Redis has a generated password; its report has no such notice.
    bare = {k: v for k, v in env.items() if k != "OVERNIGHT_REDIS_URL"}
    proc = _up(bare, tmp_path / "own")
    assert proc.returncode == 0, proc.stderr
    assert "password" not in proc.stderr
    page = (tmp_path / "own" / "state" / "report.html").read_text()
    assert "Redis without a password" not in page and 'id="notices"' not in page
