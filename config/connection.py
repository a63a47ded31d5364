"""Building Redis clients from settings: every client overnight makes comes from here.

``OVERNIGHT_REDIS_URL`` is a redis-py URL (``redis://``, ``rediss://``, ``unix://``) or a
Sentinel-managed primary::

    redis+sentinel://[[user]:password@]host1[:port1][,host2[:port2]...]/service[?query]

with ``db``, ``sentinel_username`` and ``sentinel_password`` in the query (the password in
front of the hosts is the primary's). A client for it asks the sentinels where the primary
is on every (re)connect, so it follows a failover without a restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

if TYPE_CHECKING:
    import redis
    import redis.asyncio as aioredis

    from overnight.config.settings import Settings

SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
_SENTINEL_QUERY = ("db", "sentinel_username", "sentinel_password")


# A plain dataclass, not a pydantic model: every supervisor imports this module, and
# pydantic would add some 9 MB to its peak resident size (bench.supervise).
@dataclass(frozen=True)
class SentinelUrl:
    """A ``redis+sentinel://`` URL taken apart (:func:`parse_sentinel_url` checks it)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None


def is_sentinel(url: str) -> bool:
    return url.lower().startswith(SENTINEL_SCHEME + "://")


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Take a ``redis+sentinel://`` URL apart; ``ValueError`` names what is wrong."""
    parts = urlsplit(url)
    if parts.scheme.lower() != SENTINEL_SCHEME:
        raise ValueError(f"must start with {SENTINEL_SCHEME}://")
    auth, _, hosts = parts.netloc.rpartition("@")
    user, colon, password = auth.partition(":")
    sentinels = tuple(_host_port(item) for item in hosts.split(","))
    service = unquote(parts.path.strip("/"))
    if not service or "/" in service:
        raise ValueError("needs the service name as its path (/mymaster)")
    query: dict[str, str] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key not in _SENTINEL_QUERY:
            raise ValueError(
                f"unknown query parameter {key!r} (known: {', '.join(_SENTINEL_QUERY)})"
            )
        query[key] = value
    db = query.get("db", "0") or "0"
    if not db.isdigit():
        raise ValueError("database number must be a whole number")
    return SentinelUrl(
        sentinels=sentinels,
        service=service,
        db=int(db),
        username=unquote(user) or None,
        password=unquote(password) if colon and password else None,
        sentinel_username=query.get("sentinel_username") or None,
        sentinel_password=query.get("sentinel_password") or None,
    )


def _host_port(item: str) -> tuple[str, int]:
    if not item:
        raise ValueError("needs one or more sentinels, host:port separated by commas")
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise ValueError(f"bad sentinel address {item!r}")
    else:
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
    if not host:
        raise ValueError(f"bad sentinel address {item!r}: no host")
    if port and (not port.isdigit() or not 0 < int(port) < 65536):
        raise ValueError(f"bad sentinel address {item!r}: invalid port")
    return host, int(port) if port else SENTINEL_PORT


def mask_sentinel_url(url: str) -> str:
    """``url`` with the primary's and the sentinels' passwords replaced by ``****``."""
    parts = urlsplit(url)
    auth, _, hosts = parts.netloc.rpartition("@")
    user, colon, _ = auth.partition(":")
    netloc = f"{user}:****@{hosts}" if colon else parts.netloc
    query = [
        (k, "****" if k == "sentinel_password" and v else v)
        for k, v in parse_qsl(parts.query, keep_blank_values=True)
    ]
    return parts._replace(netloc=netloc, query=urlencode(query, safe="*")).geturl()


def sentinel_url(target: SentinelUrl) -> str:
    """The URL :func:`parse_sentinel_url` takes apart into ``target``."""
    auth = ""
    if target.password:
        auth = f"{quote(target.username or '', safe='')}:{quote(target.password, safe='')}@"
    elif target.username:
        auth = f"{quote(target.username, safe='')}@"
    hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in target.sentinels)
    query = {"db": str(target.db)}
    if target.sentinel_username:
        query["sentinel_username"] = target.sentinel_username
    if target.sentinel_password:
        query["sentinel_password"] = target.sentinel_password
    return f"{SENTINEL_SCHEME}://{auth}{hosts}/{quote(target.service, safe='')}?{urlencode(query)}"


def _sentinel_kwargs(target: SentinelUrl, timeout: float) -> dict[str, Any]:
    """How overnight talks to the sentinels themselves (their own user and password)."""
    return {
        "username": target.sentinel_username,
        "password": target.sentinel_password,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
    }


def client_from_url(
    url: str, *, timeout: float, decode_responses: bool = True, **options: Any
) -> redis.Redis:
    """A client for ``url`` with ``timeout`` on every socket operation; ``options`` go to
    redis-py's client (``retry``, ``retry_on_timeout``). For a Sentinel URL, the client of
    the primary the sentinels name, asked again on every reconnect."""
    import redis

    common = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "decode_responses": decode_responses,
        **options,
    }
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **common)
    from redis.sentinel import Sentinel

    target = parse_sentinel_url(url)
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, timeout))
    client = sentinel.master_for(
        target.service,
        redis_class=redis.Redis,
        db=target.db,
        username=target.username,
        password=target.password,
        **common,
    )
    return cast("redis.Redis", client)


def async_client_from_url(
    url: str, *, timeout: float, max_connections: int, decode_responses: bool = True
) -> aioredis.Redis:
    """The asyncio twin of :func:`client_from_url` (the gateway's): at most
    ``max_connections``, a caller waiting up to ``timeout`` for a free one."""
    import redis.asyncio as aioredis

    common: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "decode_responses": decode_responses,
        "max_connections": max_connections,
    }
    if not is_sentinel(url):
        pool = aioredis.BlockingConnectionPool.from_url(url, timeout=timeout, **common)
        return aioredis.Redis(connection_pool=pool)
    from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

    class BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
        """The primary's pool, waiting for a free connection as the plain one does."""

    target = parse_sentinel_url(url)
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, timeout))
    client = sentinel.master_for(
        target.service,
        redis_class=aioredis.Redis,
        connection_pool_class=BlockingSentinelPool,
        timeout=timeout,
        db=target.db,
        username=target.username,
        password=target.password,
        **common,
    )
    return cast("aioredis.Redis", client)


def same_server(client: redis.Redis, *, drop: tuple[str, ...] = (), **options: Any) -> redis.Redis:
    """A new client (a pool of its own) for the server ``client`` talks to, with ``options``
    changed and the connection options named in ``drop`` left out; one of a Sentinel-managed
    primary follows a failover as ``client`` does."""
    import redis
    from redis.sentinel import SentinelConnectionPool

    pool = client.connection_pool
    kwargs = {
        k: v for k, v in pool.connection_kwargs.items() if k not in drop and k != "connection_pool"
    }
    kwargs.update(options)
    if isinstance(pool, SentinelConnectionPool):
        new: redis.ConnectionPool = SentinelConnectionPool(  # type: ignore[no-untyped-call]
            pool.service_name, pool.sentinel_manager, **kwargs
        )
    else:
        new = redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    return redis.Redis(connection_pool=new)


def connect(
    settings: Settings, *, timeout: float = 5.0, decode_responses: bool = True
) -> redis.Redis:
    """A client for ``settings.redis_url`` (redis://, rediss://, unix://, ACL users, or a
    Sentinel-managed primary).

    Connecting is lazy: the first command raises ``redis.ConnectionError`` if the server
    cannot be reached. Timeouts are bounded so an unreachable server never hangs a caller.
    """
    return client_from_url(
        settings.redis_url,
        timeout=timeout,
        decode_responses=decode_responses,
        retry_on_timeout=False,
    )


def wait_replicas(settings: Settings) -> int:
    """How many replicas must acknowledge an envelope spend before its call goes ahead:
    ``OVERNIGHT_REDIS_WAIT_REPLICAS``, or unset, 1 for a Sentinel URL and 0 (no wait) else."""
    if settings.redis_wait_replicas is not None:
        return settings.redis_wait_replicas
    return 1 if is_sentinel(settings.redis_url) else 0


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

    bare = same_server(client, drop=("username", "password", "credential_provider"))
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


def open_sentinels(url: str, timeout: float = 2.0) -> list[str]:
    """The sentinels of a ``redis+sentinel://`` URL that answer PING with no password (an
    unreachable one is left out): anyone who reaches one can point overnight at a primary of
    their own, which overnight would then send the primary's password."""
    import redis

    open_ones = []
    for host, port in parse_sentinel_url(url).sentinels:
        bare = redis.Redis(host=host, port=port, socket_timeout=timeout)
        try:
            bare.ping()
        except (redis.AuthenticationError, redis.ConnectionError, redis.TimeoutError):
            continue
        except redis.ResponseError as exc:
            if str(exc).upper().startswith("NOAUTH"):
                continue
            raise
        finally:
            bare.close()
        open_ones.append(f"{host}:{port}")
    return open_ones


def require_password(client: redis.Redis, settings: Settings, command: str) -> bool:
    """Refuse (``CommandError``, exit 78) a Redis that anyone gets into, or a sentinel that
    anyone gets into, unless the setting accepts it; then print the warning on stderr.
    Returns whether the door is open."""
    import sys

    from overnight.config.exits import EXIT_BAD_CONFIG, CommandError
    from overnight.config.validate import mask_url

    allowed = settings.allow_passwordless_redis
    if is_sentinel(settings.redis_url):
        sentinels = open_sentinels(settings.redis_url)
        if sentinels:
            line = open_sentinel_line(command, sentinels[0], allowed=allowed)
            if not allowed:
                raise CommandError(line, EXIT_BAD_CONFIG)
            print(line, file=sys.stderr, flush=True)
    if not anyone_gets_in(client):
        return False
    line = open_door_line(command, mask_url(settings.redis_url), allowed=allowed)
    if not allowed:
        raise CommandError(line, EXIT_BAD_CONFIG)
    print(line, file=sys.stderr, flush=True)
    return True


def open_sentinel_line(command: str, where: str, *, allowed: bool) -> str:
    """What ``command`` says of a sentinel at ``where`` that anyone gets into."""
    if allowed:
        return (
            f"{command}: WARNING: the sentinel at {where} has no password ({ALLOW_VAR}=1 "
            "accepts it): any process that reaches it, a step too, can point overnight at a "
            "primary of its own"
        )
    return (
        f"the sentinel at {where} answers without a password, so any process that reaches "
        "it (a step too) could point overnight at a primary of its own and be sent its "
        "password; give every sentinel one (requirepass and sentinel sentinel-pass) and put "
        f"it in OVERNIGHT_REDIS_URL (?sentinel_password=...), or set {ALLOW_VAR}=1 to accept it"
    )
