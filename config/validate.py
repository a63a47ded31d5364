"""Every setting's rule as a plain function, with no pydantic: one source of truth for
:class:`config.settings.Settings` and for the hot commands' fast path (:func:`read_fast`).

Each rule takes the raw value (the environment's string, or a Python value given directly)
and returns the parsed value or raises ``ValueError`` with a message that does not repeat
the value. ``Settings`` runs the same rule before its own type check, so the two readers
cannot disagree on what a value means or whether it is allowed.
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from overnight.config import defaults

ENV_PREFIX = "OVERNIGHT_"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
NAME_RULE = (
    "must be 1-64 characters of letters, digits, '.', '_' or '-', starting with a letter or digit"
)


def name(value: object) -> str:
    """A namespace, queue or lease name."""
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise ValueError(NAME_RULE)
    return value


def redis_url(value: object) -> str:
    """A URL redis-py can connect with (redis://, rediss:// or unix://), or a Sentinel-managed
    primary (redis+sentinel://)."""
    if not isinstance(value, str):
        raise ValueError("must be a URL")
    from overnight.config.connection import is_sentinel, parse_sentinel_url

    if is_sentinel(value):
        parse_sentinel_url(value)
        return value
    parts = urlsplit(value)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError("must start with redis://, rediss://, unix:// or redis+sentinel://")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("a unix:// URL needs a socket path")
        return value
    if not parts.hostname:
        raise ValueError("needs a host name")
    try:
        _ = parts.port
    except ValueError:
        raise ValueError("has an invalid port") from None
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ValueError("database number must be a whole number")
    return value


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``****``."""
    from overnight.config.connection import is_sentinel, mask_sentinel_url

    if is_sentinel(url):
        return mask_sentinel_url(url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    netloc = f"{user}:****@{host}{port}"
    return parts._replace(netloc=netloc).geturl()


def model_url(value: object) -> str | None:
    """An http(s) URL, or None for unset (the echo stub)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError("must be an http:// or https:// URL")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("must be an http:// or https:// URL")
    return value


def text(value: object) -> str:
    """Any text (a model name, a secret)."""
    if not isinstance(value, str):
        raise ValueError("must be text")
    return value


def secret(value: object) -> object:
    """A secret: text, or an already wrapped secret (anything with ``get_secret_value``)."""
    if isinstance(value, str) or hasattr(value, "get_secret_value"):
        return value
    raise ValueError("must be text")


def _number(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError("must be a number")
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise ValueError("must be a number") from None
    else:
        raise ValueError("must be a number")
    if not math.isfinite(number):
        raise ValueError("must be a finite number")
    return number


def positive(value: object) -> float:
    """A finite number of seconds > 0."""
    number = _number(value)
    if number <= 0:
        raise ValueError("must be greater than 0")
    return number


def non_negative(value: object) -> float:
    """A finite number of seconds >= 0."""
    number = _number(value)
    if number < 0:
        raise ValueError("must be greater than or equal to 0")
    return number


def whole(minimum: int) -> Callable[[object], int]:
    """A rule for a whole number >= ``minimum``."""

    def rule(value: object) -> int:
        if isinstance(value, bool):
            raise ValueError("must be a whole number")
        if isinstance(value, int):
            number = value
        elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            number = int(value.strip())
        else:
            raise ValueError("must be a whole number")
        if number < minimum:
            raise ValueError(f"must be greater than or equal to {minimum}")
        return number

    return rule


HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


def host_id(value: object) -> str | None:
    """A host id (unset or empty: None, meaning the host name)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not HOST_RE.match(value):
        raise ValueError(
            "must be 1-253 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


HOST_VAR = ENV_PREFIX + "HOST_ID"


def this_host(environ: Mapping[str, str] | None = None, env_file: str | None = ".env") -> str:
    """This host's id: ``OVERNIGHT_HOST_ID`` if set (and valid), else the host name. Read as
    ``Settings`` reads it: the environment first, then ``env_file`` (``.env`` in the working
    folder), any case, empty meaning unset. A bad value falls back to the host name here;
    ``Settings`` reports it (exit 78)."""
    raw = _setting(os.environ if environ is None else environ, HOST_VAR)
    if raw is None and env_file is not None and os.path.isfile(env_file):
        # The parser Settings reads .env with; imported only when there is one (supervise's
        # fast path has no .env, or it already defers to Settings).
        from dotenv import dotenv_values

        raw = _setting(dotenv_values(env_file), HOST_VAR)
    try:
        chosen = host_id(raw)
    except ValueError:
        chosen = None
    return chosen or socket.gethostname()


def _setting(source: Mapping[str, str | None], variable: str) -> str | None:
    """``variable``'s value in ``source`` as ``Settings`` matches names (any case); None
    when unset or empty."""
    value = source.get(variable)
    if value is None:
        value = next((v for k, v in source.items() if k.upper() == variable), None)
    return value or None


USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?$")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def user_name(value: object) -> str | None:
    """A user name as ``useradd`` accepts it (unset or empty: None)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not USER_RE.match(value):
        raise ValueError("must be a user name (letters, digits, '_', '.', '-')")
    return value


def flag(value: object) -> bool:
    """A yes/no switch: 1/true/yes/on or 0/false/no/off."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError("must be 1, true, yes, on, 0, false, no or off")


SIZE_RE = re.compile(r"^(\d+)\s*([kmgt]?)i?b?$", re.IGNORECASE)
SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def size(value: object) -> int:
    """A number of bytes >= 0, whole or with a binary suffix (``512M``, ``4G``, ``2GiB``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        match = SIZE_RE.match(value.strip()) if isinstance(value, str) else None
        if match is None:
            raise ValueError("must be a number of bytes, or one with K, M, G or T (4G)")
        number = int(match.group(1)) * SIZE_UNITS[match.group(2).lower()]
    if number < 0:
        raise ValueError("must be greater than or equal to 0")
    return number


def uid_range(value: object) -> str:
    """Step uids, ``FIRST-LAST`` (0 < FIRST <= LAST < 2**31 - 1, without 65534-65535), or off."""
    text = value.strip().lower() if isinstance(value, str) else ""
    found = re.fullmatch(r"(\d{1,10})\s*-\s*(\d{1,10})", text)
    first, last = (int(found[1]), int(found[2])) if found else (0, -1)
    if text != "off" and not (0 < first <= last < 2**31 - 1 and (last < 65534 or first > 65535)):
        raise ValueError("must be FIRST-LAST (uids from 1, without 65534 and 65535) or off")
    return text if text == "off" else f"{first}-{last}"


SANDBOX_MODES = ("bwrap", "off")


def sandbox_mode(value: object) -> str:
    """How steps are contained: ``bwrap`` (a sandbox each) or ``off``."""
    if isinstance(value, str) and value.strip().lower() in SANDBOX_MODES:
        return value.strip().lower()
    raise ValueError("must be bwrap or off")


def optional(rule: Callable[[object], object]) -> Callable[[object], object]:
    """``rule``, with None (unset) allowed."""

    def check(value: object) -> object:
        return None if value is None else rule(value)

    return check


def port(value: object) -> int:
    """A TCP port number."""
    number = whole(1)(value)
    if number > 65535:
        raise ValueError("must be a port number (1 to 65535)")
    return number


def stop_at(value: object) -> str | None:
    """When the night ends: a clock time (07:00) or an ISO date-time; None for unset."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError("must be a clock time or an ISO date-time")
    from overnight.config.stopat import check_format

    return check_format(value)


# Every setting: field name -> its rule (a test keeps this in step with Settings' fields).
RULES: dict[str, Callable[[object], object]] = {
    "redis_url": redis_url,
    "allow_passwordless_redis": flag,
    "redis_wait_replicas": optional(whole(0)),
    "redis_wait_timeout": positive,
    "namespace": name,
    "queue": name,
    "heartbeat_gap": positive,
    "deadline": positive,
    "grace": non_negative,
    "budget": optional(whole(0)),
    "model_url": model_url,
    "model_api_key": optional(secret),
    "model_name": text,
    "anthropic_model": text,
    "model_timeout": positive,
    "anthropic_url": model_url,
    "anthropic_api_key": optional(secret),
    "gateway_host": text,
    "gateway_port": whole(1),
    "gateway_url": model_url,
    "gateway_max_output": whole(0),
    "request_id_ttl": whole(1),
    "retention": whole(1),
    "reaper_interval": positive,
    "reaper_host_ttl": positive,
    "max_lost_leases": whole(1),
    "task_claim_ttl": positive,
    "recovery_interval": positive,
    "step_user": user_name,
    "allow_root_steps": flag,
    "step_uids": uid_range,
    "sandbox": sandbox_mode,
    "step_pids": whole(0),
    "step_memory": size,
    "step_open_files": whole(0),
    "step_cpu": whole(0),
    "step_disk": size,
    "host_id": host_id,
    "state_dir": optional(text),
    "stop_at": stop_at,
    "metrics_port": optional(port),
    "notify_url": model_url,
}


@dataclass(frozen=True)
class QuickSettings:
    """The settings ``overnight supervise`` needs (defaults as ``Settings`` declares them)."""

    redis_url: str = defaults.REDIS_URL
    namespace: str = defaults.NAMESPACE
    heartbeat_gap: float = defaults.HEARTBEAT_GAP
    deadline: float = defaults.DEADLINE
    grace: float = defaults.GRACE
    step_user: str | None = None
    allow_root_steps: bool = False
    step_uids: str = defaults.STEP_UIDS
    sandbox: str = defaults.SANDBOX
    step_pids: int = defaults.STEP_PIDS
    step_memory: int = defaults.STEP_MEMORY
    step_open_files: int = defaults.STEP_OPEN_FILES
    step_cpu: int = defaults.STEP_CPU
    step_disk: int = defaults.STEP_DISK


def read_fast(environ: Mapping[str, str], dotenv: bool | None = None) -> QuickSettings | None:
    """:class:`QuickSettings` read from ``environ`` by :data:`RULES`, or None when only the
    full ``Settings`` can decide: a ``.env`` file (it reads that too; ``dotenv`` says whether
    there is one, default: look), a name not in upper case or the ``MODEL_URL`` alias (its
    matching rules), or a bad value of any setting (it words the one-line error).
    """
    if os.path.exists(".env") if dotenv is None else dotenv:
        return None
    values: dict[str, Any] = {}
    for key, raw in environ.items():
        low = key.lower()
        if low == "model_url":
            return None
        if not low.startswith("overnight_"):
            continue
        field = low[len(ENV_PREFIX) :]
        if field not in RULES:
            continue  # not a setting: Settings ignores it too
        if key != key.upper():
            return None
        if raw == "":
            continue  # Settings treats an empty value as unset
        try:
            values[field] = RULES[field](raw)
        except ValueError:
            return None
    return QuickSettings(**{k: v for k, v in values.items() if k in _QUICK})


_QUICK = frozenset(f.name for f in fields(QuickSettings))
