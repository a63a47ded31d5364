"""The private redis-server overnight starts: a password that never shows on a command line."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from overnight.coordinator.night.embedded_redis import EmbeddedRedis


def test_password_is_required_and_never_on_the_command_line(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "r", password="s3cretpass42", appendonly=True)
    server.start()
    try:
        assert server.url.startswith("redis://:s3cretpass42@127.0.0.1:")
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, protocol=2).ping()
        assert server.proc is not None
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        assert b"s3cretpass42" not in cmdline
        assert (tmp_path / "r").stat().st_mode & 0o077 == 0
        # A restart keeps the password and the data.
        redis.Redis.from_url(server.url).set("k", "v")
        server.stop()
        server.start()
        assert redis.Redis.from_url(server.url).get("k") == b"v"
    finally:
        server.stop()


def test_a_password_that_could_break_the_config_line_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        EmbeddedRedis(tmp_path, password="two words\nrequirepass x")
