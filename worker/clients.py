"""The supervisor's Redis clients: short timeouts so a lost Redis shows within the gap, and
one client per caller pool shared by the steps of a process. (A supervised child gets no
Redis URL: it beats through worker.beatchannel.)"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis


def io_timeout(gap: float) -> float:
    """Socket timeout for a supervisor's Redis calls: well under the gap, so loss shows fast."""
    return max(0.05, min(1.0, gap / 4))


def client_for_url(url: str, gap: float) -> redis.Redis:
    """A text client with short timeouts and one immediate retry (for a stale connection)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    t = io_timeout(gap)
    return redis.Redis.from_url(
        url,
        socket_timeout=t,
        socket_connect_timeout=t,
        retry=Retry(NoBackoff(), 1),
        decode_responses=True,
    )


# Per caller pool and timeout, the supervisor's own client: steps run one after another in
# a work horse share its connection instead of opening one each.
_private: weakref.WeakKeyDictionary[Any, dict[float, redis.Redis]] = weakref.WeakKeyDictionary()
_private_lock = threading.Lock()


def supervisor_client(client: redis.Redis, gap: float) -> redis.Redis:
    """A copy of ``client`` with the supervisor's short timeouts (the original if it cannot);
    made once per pool and timeout, then shared."""
    import redis

    pool = client.connection_pool
    if type(pool) is not redis.ConnectionPool or "fakeredis" in type(client).__module__:
        return client
    t = io_timeout(gap)
    with _private_lock:
        mine = _private.setdefault(pool, {})
        if t not in mine:
            mine[t] = _copy_client(pool, t) or client
        return mine[t]


def _copy_client(pool: redis.ConnectionPool, t: float) -> redis.Redis | None:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kwargs = dict(pool.connection_kwargs)
    kwargs.update(socket_timeout=t, retry=Retry(NoBackoff(), 1), decode_responses=True)
    if "socket_connect_timeout" in kwargs:
        kwargs["socket_connect_timeout"] = t
    try:
        new_pool = redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    except TypeError:
        return None
    return redis.Redis(connection_pool=new_pool)


def url_of(client: redis.Redis) -> str:
    """A redis-py URL that reaches the same server as ``client``, credentials included (so
    never for a step's environment)."""
    from urllib.parse import quote, urlencode

    kw = client.connection_pool.connection_kwargs
    auth = ""
    if kw.get("password"):
        auth = f"{quote(str(kw.get('username') or ''), safe='')}:"
        auth += f"{quote(str(kw['password']), safe='')}@"
    elif kw.get("username"):
        auth = f"{quote(str(kw['username']), safe='')}@"
    db = kw.get("db") or 0
    if kw.get("path"):
        return f"unix://{auth}{kw['path']}?db={db}"
    scheme = "rediss" if "SSL" in client.connection_pool.connection_class.__name__ else "redis"
    url = f"{scheme}://{auth}{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{db}"
    # The TLS options redis-py reads from a URL, so the child trusts the same certificates.
    tls = {k: str(v) for k, v in kw.items() if k in _TLS_QUERY and v not in (None, "")}
    tls.update({k: str(kw[k]) for k, usual in _TLS_USUAL.items() if kw.get(k, usual) != usual})
    return f"{url}?{urlencode(tls)}" if scheme == "rediss" and tls else url


_TLS_QUERY = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile")
_TLS_USUAL = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}  # redis-py's defaults


def redis_errors() -> tuple[type[BaseException], ...]:
    """What a lost or unreachable Redis raises (redis-py imported only when asked)."""
    import redis

    return (redis.ConnectionError, redis.TimeoutError, OSError)
