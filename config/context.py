"""Per-invocation singletons for CLI commands: settings and Redis clients, built once."""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis

    from overnight.config.settings import Settings


@cache
def settings() -> Settings:
    """Settings from the environment; raises ``ConfigError`` (exit 78) on a bad value."""
    from overnight.config.settings import load_settings

    return load_settings()


@cache
def redis_client() -> redis.Redis:
    """A text client (``decode_responses=True``) for overnight's own keys."""
    from overnight.config.connection import connect

    return connect(settings())


@cache
def rq_connection() -> redis.Redis:
    """A bytes client, as RQ requires."""
    from overnight.config.connection import connect

    return connect(settings(), decode_responses=False)
