"""The one settings object: every knob is an ``OVERNIGHT_*`` environment variable (or ``.env``)."""

from __future__ import annotations

from typing import Any

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from overnight.config import defaults, validate
from overnight.config.errors import OvernightError
from overnight.config.validate import ENV_PREFIX, NAME_RE, RULES, mask_url

__all__ = ["NAME_RE", "ConfigError", "Settings", "check_redis_url", "load_settings", "mask_url"]
_SECRET_FIELDS = {"model_api_key", "anthropic_api_key", "redis_url"}
_ENV_NAMES = {"model_url": "OVERNIGHT_MODEL_URL (or MODEL_URL)"}


class ConfigError(OvernightError):
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

    redis_url: str = defaults.REDIS_URL
    # `up`, `worker` and `coordinator` refuse a Redis that answers without a password (exit
    # 78) unless this accepts it; then they say so at start and the report says so too.
    allow_passwordless_redis: bool = False
    # Replicas that must acknowledge an envelope spend (WAIT) before its call goes ahead;
    # unset: 1 for a redis+sentinel:// URL, else 0 (no wait).
    redis_wait_replicas: int | None = Field(None, ge=0)
    redis_wait_timeout: float = Field(1.0, gt=0)
    namespace: str = defaults.NAMESPACE
    queue: str = "overnight"
    heartbeat_gap: float = Field(defaults.HEARTBEAT_GAP, gt=0)
    deadline: float = Field(defaults.DEADLINE, gt=0)
    grace: float = Field(defaults.GRACE, ge=0)
    budget: int | None = Field(None, ge=0)
    model_url: str | None = Field(
        None, validation_alias=AliasChoices("OVERNIGHT_MODEL_URL", "MODEL_URL", "model_url")
    )
    model_api_key: SecretStr | None = None
    model_name: str = defaults.MODEL_NAME
    model_timeout: float = Field(defaults.MODEL_TIMEOUT, gt=0)
    # The gateway's Anthropic-compatible upstream (the OpenAI-compatible one is model_url).
    anthropic_url: str | None = None
    # The model the "claude" preset asks for (the OpenAI-wire presets use model_name).
    anthropic_model: str = "claude-sonnet-4-5"
    anthropic_api_key: SecretStr | None = None
    # Where `overnight gateway` listens, and the URL steps are pointed at (default: that).
    gateway_host: str = "127.0.0.1"
    gateway_port: int = Field(4680, ge=1, le=65535)
    gateway_url: str | None = None
    # The output cap the gateway gives a non-streaming model request that names none (so its
    # hold covers what it can cost); 0: such a request is refused.
    gateway_max_output: int = Field(8192, ge=0)
    # How long an envelope remembers a request id, so a retried call is answered, not re-charged.
    request_id_ttl: int = Field(defaults.REQUEST_ID_TTL, gt=0)
    # How often the reaper passes, and how long a reaper's host heartbeat lives without renewal.
    reaper_interval: float = Field(2.0, gt=0)
    reaper_host_ttl: float = Field(defaults.REAPER_HOST_TTL, gt=0)
    max_lost_leases: int = Field(defaults.MAX_LOST_LEASES, ge=1)
    # A task's claim lapses this long after its worker stopped renewing it (the worker died);
    # recovery passes (in every `overnight worker`) look for such tasks this often.
    task_claim_ttl: float = Field(defaults.TASK_CLAIM_TTL, gt=0)
    recovery_interval: float = Field(5.0, gt=0)
    # Seconds everything a finished task leaves (record, receipts, RQ job and result, lease
    # documents) is kept; receipts older than this are trimmed.
    retention: int = Field(defaults.RETENTION, gt=0)
    # Who steps run as when overnight runs as root; running them as root needs the opt-in.
    step_user: str | None = None
    allow_root_steps: bool = False
    # As root without a step user: each task runs as a uid of its own from this range
    # ("FIRST-LAST"; "off": none, and root without a step user is refused).
    step_uids: str = defaults.STEP_UIDS
    # Each step in a bubblewrap sandbox of its own ("bwrap"), or only the older containment
    # ("off", said at start); "bwrap" where no sandbox can start is exit 78.
    sandbox: str = defaults.SANDBOX
    # Each step's limits, 0 for none (a task's `limits` overrides them): processes in its
    # tree, memory in bytes (4G), open files and CPU seconds per process, bytes written
    # into its worktree, HOME and tmp. Over one, the tree is killed and the limit named.
    step_pids: int = Field(defaults.STEP_PIDS, ge=0)
    step_memory: int = Field(defaults.STEP_MEMORY, ge=0)
    step_open_files: int = Field(defaults.STEP_OPEN_FILES, ge=0)
    step_cpu: int = Field(defaults.STEP_CPU, ge=0)
    step_disk: int = Field(defaults.STEP_DISK, ge=0)
    # This host's id in leases, reaper heartbeats, receipts and proofs (unset: the host name).
    host_id: str | None = None
    # overnight's own folder on this host: task worktrees, verifier checkouts, snapshots
    # (unset: $XDG_STATE_HOME/overnight, else ~/.local/state/overnight). Never inside a task's tree.
    state_dir: str | None = None
    # When the night ends (as `up --until`): an ISO date-time, or a clock time meaning its
    # next occurrence. From then on no step starts; running ones end as a requested stop.
    stop_at: str | None = None
    # Serve Prometheus /metrics on this port (`up` and `coordinator`; `up` gives its
    # workers the next ports, worker N on port + N; a lone `overnight worker` uses the port).
    metrics_port: int | None = Field(None, ge=1, le=65535)
    # Where the end-of-night summary (and a task's pause) is POSTed as JSON.
    notify_url: str | None = None

    @field_validator(*RULES, mode="before")
    @classmethod
    def _rule(cls, value: Any, info: ValidationInfo) -> Any:
        # The same rule as the fast path's (config.validate), before pydantic's type check.
        assert info.field_name is not None
        return RULES[info.field_name](value)

    def public_dict(self) -> dict[str, Any]:
        """Settings as JSON-ready data, with every secret masked."""
        data = self.model_dump(mode="json")
        data["model_api_key"] = "********" if self.model_api_key else None
        data["anthropic_api_key"] = "********" if self.anthropic_api_key else None
        data["redis_url"] = mask_url(self.redis_url)
        return data


def gateway_base(settings: Settings) -> str:
    """The gateway's base URL as steps reach it (no trailing slash)."""
    if settings.gateway_url:
        return settings.gateway_url.rstrip("/")
    host = settings.gateway_host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{settings.gateway_port}"


def check_redis_url(value: str) -> None:
    """Raise ``ValueError`` unless ``value`` is a URL redis-py can connect with."""
    validate.redis_url(value)


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
