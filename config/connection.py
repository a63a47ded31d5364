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


ALLOW_VAR = "OVERNIGHT_ALLOW_PASSWORDLESS_REDIS"


def anyone_gets_in(client: redis.Redis) -> bool:
    """Whether the server ``client`` talks to answers a command sent with no credential: a
    fresh connection to the same address (host and port, or socket; TLS as configured) with
    no user name and no password. A server that asks for one (requirepass, or ACLs with the
    default user off or passworded) answers NOAUTH; connection errors are raised."""
    import redis as redis_lib

    pool = client.connection_pool
    kwargs = {
        k: v
        for k, v in pool.connection_kwargs.items()
        if k not in ("username", "password", "credential_provider")
    }
    bare = redis_lib.Redis(
        connection_pool=redis_lib.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    )
    try:
        bare.ping()
    except redis_lib.AuthenticationError:
        return False
    except redis_lib.ResponseError as exc:
        # NOPERM: let in as the default user, only not allowed PING.
        if str(exc).upper().startswith("NOAUTH"):
            return False
        return isinstance(exc, redis_lib.exceptions.NoPermissionError)
    finally:
        bare.close()
    return True


def open_door_line(command: str, where: str, *, allowed: bool) -> str:
    """What ``command`` says of a Redis at ``where`` (masked) that anyone gets into: the one
    refusal line naming the fix (the CLI prefixes it), or, when :data:`ALLOW_VAR` accepts
    it, the warning."""
    if allowed:
        return (
            f"{command}: WARNING: the Redis at {where} has no password ({ALLOW_VAR}=1 "
            "accepts it): any process on this host that reaches it, a step too, can rewrite "
            "budgets, leases and tasks"
        )
    return (
        f"the Redis at {where} answers without a password, so any process that "
        "reaches it (a step too) could rewrite budgets, leases and tasks; give it one "
        "(requirepass, or an ACL user) and put it in OVERNIGHT_REDIS_URL "
        f"(redis://:PASSWORD@host:port/0), or set {ALLOW_VAR}=1 to accept it"
    )


def require_password(client: redis.Redis, settings: Settings, command: str) -> bool:
    """Refuse (``CommandError``, exit 78) a Redis that anyone gets into, unless the setting
    accepts it; then print the warning on stderr. Returns whether the door is open."""
    import sys

    from overnight.config.exits import EXIT_BAD_CONFIG, CommandError
    from overnight.config.validate import mask_url

    if not anyone_gets_in(client):
        return False
    allowed = settings.allow_passwordless_redis
    line = open_door_line(command, mask_url(settings.redis_url), allowed=allowed)
    if not allowed:
        raise CommandError(line, EXIT_BAD_CONFIG)
    print(line, file=sys.stderr, flush=True)
    return True
