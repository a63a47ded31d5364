"""`up` uses OVERNIGHT_REDIS_URL when it is set and otherwise always its own
Redis (never a server that merely answers on the default address); its first line names
the Redis, password masked, and the namespace."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from overnight.config.settings import load_settings
from tests.helpers import OVERNIGHT


def up(env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    tasks = tmp_path / "tasks"
    tasks.mkdir(exist_ok=True)
    return subprocess.run(
        [
            OVERNIGHT,
            "up",
            "--tasks",
            str(tasks),
            "--workers",
            "1",
            "--exit-when-done",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


@pytest.mark.timeout(120)
def test_unset_url_means_a_private_redis(env: dict[str, str], tmp_path: Path) -> None:
    bare = {k: v for k, v in env.items() if k != "OVERNIGHT_REDIS_URL"}
    proc = up(bare, tmp_path)
    assert proc.returncode == 0, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("overnight up: Redis redis://:****@127.0.0.1:"), first
    assert "started a private redis-server" in first
    assert ":6379/" not in first
    assert f"namespace {env['OVERNIGHT_NAMESPACE']!r}" in first


@pytest.mark.timeout(120)
def test_a_set_url_is_used_and_masked(env: dict[str, str], tmp_path: Path) -> None:
    proc = up(env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    first = proc.stderr.splitlines()[0]
    url = load_settings().redis_url
    password = url.split("@")[0].rsplit(":", 1)[1]
    assert first.endswith("(OVERNIGHT_REDIS_URL)"), first
    assert password not in proc.stderr and ":****@" in first
    assert "private redis-server" not in proc.stderr
