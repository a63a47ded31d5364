"""docker-compose.yml as the compose tests read it: the file, compose's variable
substitution, and a service's command as a local process."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tests.helpers import OVERNIGHT, ROOT

COMPOSE = ROOT / "docker-compose.yml"
_VAR = re.compile(r"\$\{(?P<name>[A-Z0-9_]+)(?::(?P<op>[-?])(?P<default>[^}]*))?\}")
# Not a setting: the password compose gives its Redis (OVERNIGHT_REDIS_URL carries it too).
COMPOSE_ONLY = {"REDIS_PASSWORD"}


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${NAME:-default}`` and ``${NAME:?error}`` substitution, for the forms this
    file uses (``:?`` with NAME unset or empty is compose's error: ``KeyError`` here)."""

    def one(m: re.Match[str]) -> str:
        if m["op"] == "?" and not env.get(m["name"]):
            raise KeyError(f"{m['name']}: {m['default']}")
        return env.get(m["name"]) or (m["default"] or "")

    return _VAR.sub(one, value)


def load() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def service_argv(command: list[str], tasks: Path) -> list[str]:
    """A service's command as a local process: our console script, the tasks volume mapped."""
    argv = [OVERNIGHT if command[0] == "overnight" else command[0], *command[1:]]
    return [str(tasks) if a == "/tasks" else a for a in argv]
