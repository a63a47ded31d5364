"""Settings: defaults, validation with one line and exit 78, secrets masked."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from overnight.config.settings import ConfigError, load_settings
from tests.helpers import OVERNIGHT


def run_config(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith("OVERNIGHT_") and k != "MODEL_URL"
    }
    clean.update(env)
    return subprocess.run(
        [OVERNIGHT, "config"], env=clean, cwd=tmp_path, capture_output=True, text=True, timeout=30
    )


def test_defaults_match_the_contract(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for key in list(os.environ):
        if key.startswith("OVERNIGHT_") or key == "MODEL_URL":
            monkeypatch.delenv(key)
    s = load_settings()
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    assert (s.namespace, s.queue) == ("overnight", "overnight")
    assert (s.heartbeat_gap, s.deadline, s.grace) == (30, 180, 5)
    assert s.budget is None and s.model_url is None and s.model_api_key is None


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("OVERNIGHT_HEARTBEAT_GAP", "-1"),
        ("OVERNIGHT_HEARTBEAT_GAP", "soon"),
        ("OVERNIGHT_DEADLINE", "0"),
        ("OVERNIGHT_GRACE", "-0.5"),
        ("OVERNIGHT_BUDGET", "lots"),
        ("OVERNIGHT_REDIS_URL", "http://localhost:6379"),
        ("OVERNIGHT_REDIS_URL", "redis://localhost:notaport/0"),
        ("OVERNIGHT_NAMESPACE", "a b"),
        ("OVERNIGHT_MODEL_URL", "ftp://model"),
    ],
)
def test_bad_value_is_one_line_exit_78(tmp_path: Path, var: str, value: str) -> None:
    proc = run_config(tmp_path, **{var: value})
    assert proc.returncode == 78
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert var in lines[0]
    assert "Traceback" not in proc.stderr


def test_config_masks_secrets(tmp_path: Path) -> None:
    proc = run_config(
        tmp_path,
        OVERNIGHT_MODEL_API_KEY="sk-very-secret",
        OVERNIGHT_REDIS_URL="redis://alice:hunter2@127.0.0.1:6380/2",
        MODEL_URL="http://127.0.0.1:9/v1",
    )
    assert proc.returncode == 0, proc.stderr
    assert "sk-very-secret" not in proc.stdout and "hunter2" not in proc.stdout
    data = json.loads(proc.stdout)
    assert data["model_api_key"] == "********"
    assert data["redis_url"] == "redis://alice:****@127.0.0.1:6380/2"
    assert data["model_url"] == "http://127.0.0.1:9/v1"


def test_dotenv_file_is_read(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("OVERNIGHT_NAMESPACE=from-dotenv\nOVERNIGHT_BUDGET=7\n")
    proc = run_config(tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["namespace"], data["budget"]) == ("from-dotenv", 7)


def test_secret_value_never_echoed_in_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERNIGHT_REDIS_URL", "http://bob:topsecret@host/0")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "topsecret" not in str(info.value)
    assert info.value.variable == "OVERNIGHT_REDIS_URL"


def test_usage_error_exits_64(tmp_path: Path) -> None:
    proc = subprocess.run(
        [OVERNIGHT, "no-such-command"], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 64
    assert len(proc.stderr.strip().splitlines()) == 1
