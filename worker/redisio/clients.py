"""The supervisor's Redis clients: short timeouts so a lost Redis shows within the gap, and
one client per caller pool shared by the steps of a process. (A supervised child gets no
Redis URL: it beats through worker.beat.channel.)"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import redis

T = TypeVar("T")


def io_timeout(gap: float) -> float:
    """Socket timeout for a supervisor's Redis calls: well under the gap, so loss shows fast."""
    return max(0.05, min(1.0, gap / 4))


def client_for_url(url: str, gap: float) -> redis.Redis:
    """A text client with short timeouts and one immediate retry (for a stale connection);
    one of a Sentinel-managed primary follows a failover."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from overnight.config.connection import client_from_url

    return client_from_url(url, timeout=io_timeout(gap), retry=Retry(NoBackoff(), 1))


# Per caller pool and timeout, the supervisor's own client: steps run one after another in
# a work horse share its connection instead of opening one each.
_private: weakref.WeakKeyDictionary[Any, dict[float, redis.Redis]] = weakref.WeakKeyDictionary()
_private_lock = threading.Lock()


def supervisor_client(client: redis.Redis, gap: float) -> redis.Redis:
    """A copy of ``client`` with the supervisor's short timeouts (the original if it cannot);
    made once per pool and timeout, then shared."""
    import redis
    from redis.sentinel import SentinelConnectionPool

    pool = client.connection_pool
    plain = type(pool) in (redis.ConnectionPool, SentinelConnectionPool)
    if not plain or "fakeredis" in type(client).__module__:
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

    from overnight.config.connection import same_server

    options: dict[str, Any] = {
        "socket_timeout": t,
        "retry": Retry(NoBackoff(), 1),
        "decode_responses": True,
    }
    if "socket_connect_timeout" in pool.connection_kwargs:
        options["socket_connect_timeout"] = t
    try:
        return same_server(redis.Redis(connection_pool=pool), **options)
    except TypeError:
        return None


def url_of(client: redis.Redis) -> str:
    """A redis-py URL that reaches the same server as ``client``, credentials included (so
    never for a step's environment)."""
    from urllib.parse import quote, urlencode

    from redis.sentinel import SentinelConnectionPool

    kw = client.connection_pool.connection_kwargs
    if isinstance(client.connection_pool, SentinelConnectionPool):
        return _sentinel_url_of(client.connection_pool)
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


def _sentinel_url_of(pool: Any) -> str:
    from overnight.config.connection import SentinelUrl, sentinel_url

    kw = pool.connection_kwargs
    watchers = [s.connection_pool.connection_kwargs for s in pool.sentinel_manager.sentinels]
    return sentinel_url(
        SentinelUrl(
            sentinels=tuple((str(w["host"]), int(w["port"])) for w in watchers),
            service=pool.service_name,
            db=int(kw.get("db") or 0),
            username=kw.get("username"),
            password=kw.get("password"),
            sentinel_username=watchers[0].get("username") if watchers else None,
            sentinel_password=watchers[0].get("password") if watchers else None,
        )
    )


_TLS_QUERY = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile")
_TLS_USUAL = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}  # redis-py's defaults


def redis_errors() -> tuple[type[BaseException], ...]:
    """What a lost, unreachable or momentarily unwritable Redis raises (redis-py imported
    only when asked): connection loss, LOADING, OOM (maxmemory), READONLY, MASTERDOWN,
    TRYAGAIN. MISCONF has no class of its own: :func:`transient` knows it by its text."""
    import redis
    from redis import exceptions as ex

    return (
        redis.ConnectionError,
        redis.TimeoutError,
        OSError,
        ex.OutOfMemoryError,
        ex.ReadOnlyError,
        ex.MasterDownError,
        ex.TryAgainError,
    )


# Error replies of a server that is there but cannot take the command now (a script's
# error text carries the reply of the command inside it, hence the search, not a prefix).
_TRANSIENT_REPLIES = ("OOM ", "MISCONF ", "LOADING ", "READONLY ", "MASTERDOWN ", "TRYAGAIN ")


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a Redis error that passes on its own: every long-running loop
    logs it once, backs off and retries, and never exits on it."""
    import redis

    if isinstance(exc, redis_errors()):
        return True
    if isinstance(exc, redis.ResponseError):
        text = str(exc)
        return text.startswith(_TRANSIENT_REPLIES) or any(
            f"-{word}" in text or f": {word}" in text for word in _TRANSIENT_REPLIES
        )
    return False


def not_run(exc: BaseException) -> bool:
    """Whether ``exc`` is a refusal the server gave before running the command (so running
    it again cannot do it twice): OOM, MISCONF, LOADING, READONLY, MASTERDOWN, TRYAGAIN.
    A lost connection is not one: the command may have run."""
    import redis
    from redis import exceptions as ex

    refusals = (
        ex.OutOfMemoryError,
        ex.ReadOnlyError,
        ex.BusyLoadingError,
        ex.MasterDownError,
        ex.TryAgainError,
    )
    if isinstance(exc, refusals):
        return True
    return isinstance(exc, redis.ResponseError) and str(exc).startswith(_TRANSIENT_REPLIES)


class Backoff:
    """Retry pacing for one loop: the first failure of a run of failures is logged (one
    line), the waits double from ``first`` to ``cap``, and the first success after failures
    says so once."""

    def __init__(
        self, what: str, logger: logging.Logger, *, first: float = 0.1, cap: float = 5.0
    ) -> None:
        self.what, self.log, self.first, self.cap = what, logger, first, cap
        self.failures = 0
        self.since = 0.0

    @property
    def failing(self) -> bool:
        return self.failures > 0

    def failed(self, exc: BaseException) -> float:
        """Record a transient failure; returns how long to wait before the next try."""
        if self.failures == 0:
            self.since = time.monotonic()
            self.log.warning(
                "%s: Redis unavailable (%s: %s); retrying with backoff",
                self.what,
                type(exc).__name__,
                _short(exc),
            )
        self.failures += 1
        return float(min(self.cap, self.first * 2.0 ** (self.failures - 1)))

    def ok(self) -> None:
        """Record a success: ends a run of failures (logged once)."""
        if self.failures:
            self.log.warning(
                "%s: Redis available again after %.1fs (%d failed tries)",
                self.what,
                time.monotonic() - self.since,
                self.failures,
            )
        self.failures = 0


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return text[:200]


def retry_transient(
    fn: Callable[[], T],
    what: str,
    logger: logging.Logger,
    *,
    stop: threading.Event | None = None,
    patience: float | None = None,
    first: float = 0.1,
    cap: float = 5.0,
    when: Callable[[BaseException], bool] = transient,
) -> T:
    """``fn()``, retried with :class:`Backoff` while it raises an error ``when`` accepts (by
    default a :func:`transient` one).

    Gives up (re-raising the last error) once ``patience`` seconds passed or ``stop`` is set;
    any other error is raised at once."""
    backoff = Backoff(what, logger, first=first, cap=cap)
    began = time.monotonic()
    while True:
        try:
            result = fn()
        except Exception as exc:
            if not when(exc):
                raise
            wait = backoff.failed(exc)
            out_of_time = patience is not None and time.monotonic() - began + wait > patience
            if out_of_time or (stop is not None and stop.is_set()):
                raise
            if stop is not None:
                stop.wait(wait)
            else:
                time.sleep(wait)
            continue
        backoff.ok()
        return result


# How long a starting long-running command (worker, reaper) waits for its Redis (restarting,
# loading, or not up yet under compose) before it exits 69: retry_transient's patience.
STARTUP_WAIT = 30.0
