"""The gateway's command-line surface: the Anthropic key is a masked secret, token caps on
the envelope, and a gateway that cannot reach Redis says so and exits 69."""

from __future__ import annotations

import json
import subprocess

from tests.helpers import OVERNIGHT


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], env=env, capture_output=True, text=True, timeout=30, check=False
    )


def test_config_masks_the_anthropic_key(env: dict[str, str]) -> None:
    env = {
        **env,
        "OVERNIGHT_ANTHROPIC_URL": "https://anthropic.example",
        "OVERNIGHT_ANTHROPIC_API_KEY": "ak-sentinel-123",
    }
    shown = _run(env, "config")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert data["anthropic_api_key"] == "********"
    assert data["anthropic_url"] == "https://anthropic.example"
    assert data["gateway_host"] == "127.0.0.1"
    assert "ak-sentinel-123" not in shown.stdout + shown.stderr
    bad = _run({**env, "OVERNIGHT_ANTHROPIC_URL": "ftp://x"}, "config")
    assert bad.returncode == 78 and "OVERNIGHT_ANTHROPIC_URL" in bad.stderr


def test_envelope_token_caps(env: dict[str, str]) -> None:
    capped = _run(env, "envelope", "reset", "5", "--tokens", "1000")
    assert capped.returncode == 0, capped.stderr
    state = json.loads(capped.stdout)
    assert (state["remaining"], state["max_tokens"], state["consumed_tokens"]) == (5, 1000, 0)
    plain = json.loads(_run(env, "envelope", "reset", "5").stdout)
    assert "max_tokens" not in plain  # no token cap, nothing spent: no token fields
    assert _run(env, "envelope", "reset", "5", "--tokens", "-1").returncode == 64


def test_gateway_without_redis_exits_69(env: dict[str, str]) -> None:
    down = _run({**env, "OVERNIGHT_REDIS_URL": "redis://127.0.0.1:9/0"}, "gateway", "--port", "0")
    assert down.returncode == 69 and "Redis unreachable" in down.stderr
