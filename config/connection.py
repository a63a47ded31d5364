"""Building Redis clients from settings."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis

    from overnight.config.settings import Settings


def connect(
    settings: Settings, *, timeout: float = 5.0, decode_responses: bool = True
) -> redis.Redis:
    """A client for ``settings.redis_url`` (redis://, rediss://, unix://, ACL users).

    Connecting is lazy: the first command raises ``redis.ConnectionError`` if the server
    cannot be reached. Timeouts are bounded so an unreachable server never hangs a caller.
    """
    import redis

    return redis.Redis.from_url(
        settings.redis_url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        decode_responses=decode_responses,
        retry_on_timeout=False,
    )


def describe(settings: Settings) -> str:
    """Which Redis and namespace ``settings`` name, password masked: the first line every
    long-running command prints ("Redis redis://:****@host:6379/0, namespace 'overnight'")."""
    from overnight.config.validate import mask_url

    return f"Redis {mask_url(settings.redis_url)}, namespace {settings.namespace!r}"
