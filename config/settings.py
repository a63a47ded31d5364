"""The one settings object: every knob is an ``OVERNIGHT_*`` environment variable (or ``.env``)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "OVERNIGHT_"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_SECRET_FIELDS = {"model_api_key", "redis_url"}
_ENV_NAMES = {"model_url": "OVERNIGHT_MODEL_URL (or MODEL_URL)"}


class ConfigError(Exception):
    """A setting is unusable. ``str()`` is one line naming the variable and the problem."""

    def __init__(self, variable: str, problem: str) -> None:
        super().__init__(f"{variable}: {problem}")
        self.variable = variable
        self.problem = problem


class Settings(BaseSettings):
    """Effective configuration. Build it with :func:`load_settings` to get clean errors."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        extra="ignore",
        populate_by_name=True,
        # compose writes `${OVERNIGHT_BUDGET:-}` as an empty string: treat it as unset.
        env_ignore_empty=True,
    )

    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "overnight"
    queue: str = "overnight"
    heartbeat_gap: float = Field(30.0, gt=0)
    deadline: float = Field(180.0, gt=0)
    grace: float = Field(5.0, ge=0)
    budget: int | None = Field(None, ge=0)
    model_url: str | None = Field(
        None, validation_alias=AliasChoices("OVERNIGHT_MODEL_URL", "MODEL_URL", "model_url")
    )
    model_api_key: SecretStr | None = None
    model_name: str = "gpt-4o-mini"
    model_timeout: float = Field(60.0, gt=0)
    # How long an envelope remembers a request id, so a retried call is answered, not re-charged.
    request_id_ttl: int = Field(86_400, gt=0)
    # How often the reaper passes, and how long a reaper's host heartbeat lives without renewal.
    reaper_interval: float = Field(2.0, gt=0)
    reaper_host_ttl: float = Field(30.0, gt=0)
    max_lost_leases: int = Field(3, ge=1)
    # A task's claim lapses this long after its worker stopped renewing it (the worker died);
    # recovery passes (in every `overnight worker`) look for such tasks this often.
    task_claim_ttl: float = Field(15.0, gt=0)
    recovery_interval: float = Field(5.0, gt=0)

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        check_redis_url(value)
        return value

    @field_validator("namespace", "queue")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not NAME_RE.match(value):
            raise ValueError(
                "must be 1-64 characters of letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        return value

    @field_validator("model_url")
    @classmethod
    def _check_model_url(cls, value: str | None) -> str | None:
        if value in (None, ""):
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError("must be an http:// or https:// URL")
        return value

    def public_dict(self) -> dict[str, Any]:
        """Settings as JSON-ready data, with every secret masked."""
        data = self.model_dump(mode="json")
        data["model_api_key"] = "********" if self.model_api_key else None
        data["redis_url"] = mask_url(self.redis_url)
        return data


def check_redis_url(value: str) -> None:
    """Raise ``ValueError`` unless ``value`` is a URL redis-py can connect with."""
    parts = urlsplit(value)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError("must start with redis://, rediss:// or unix://")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("a unix:// URL needs a socket path")
        return
    if not parts.hostname:
        raise ValueError("needs a host name")
    try:
        _ = parts.port
    except ValueError:
        raise ValueError("has an invalid port") from None
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ValueError("database number must be a whole number")


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``****``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    netloc = f"{user}:****@{host}{port}"
    return parts._replace(netloc=netloc).geturl()


def env_name(field: str) -> str:
    """The environment variable that sets ``field``."""
    return _ENV_NAMES.get(field, ENV_PREFIX + field.upper())


def load_settings(**overrides: Any) -> Settings:
    """Read the environment (and ``.env``); raise :class:`ConfigError` on the first bad value."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "?"
        field = "model_url" if field in ("OVERNIGHT_MODEL_URL", "MODEL_URL") else field
        message = str(err["msg"]).removeprefix("Value error, ")
        if field not in _SECRET_FIELDS and "input" in err:
            message = f"{message} (got {err['input']!r})"
        raise ConfigError(env_name(field), message) from None
