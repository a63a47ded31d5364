"""The one way a Lua script is loaded: a file ``<package>/lua/<name>.lua``, optionally after a
prelude (a shared library file or generated Lua), registered on a client as a redis-py
``Script``.

Every script begins with a header naming its ``KEYS``, its ``ARGV`` and what it returns.
Replies follow one convention: a table (``{1, ...}`` when the script did its work,
``{0, reason, ...}`` when it refused) or, where a reply holds named fields or must be stored
and replayed as is, one JSON object (``cjson.encode``); never a string of joined fields.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    import redis
    import redis.asyncio as aioredis
    from redis.commands.core import AsyncScript, Script

WORKER = "overnight.worker"
COORDINATOR = "overnight.coordinator"


@cache
def source(name: str, package: str = WORKER) -> str:
    """The text of ``<package>/lua/<name>.lua``."""
    return resources.files(package).joinpath("lua", f"{name}.lua").read_text()


def preload(packages: tuple[str, ...] = (WORKER, COORDINATOR)) -> None:
    """Read every script of ``packages`` into :func:`source`'s cache (a process that forks
    work horses reads them once for all of them)."""
    for package in packages:
        for entry in resources.files(package).joinpath("lua").iterdir():
            if entry.name.endswith(".lua"):
                source(entry.name.removesuffix(".lua"), package)


@overload
def register(
    client: redis.Redis, name: str, *, package: str = ..., lib: str | None = ..., prelude: str = ...
) -> Script: ...


@overload
def register(
    client: aioredis.Redis,
    name: str,
    *,
    package: str = ...,
    lib: str | None = ...,
    prelude: str = ...,
) -> AsyncScript: ...


def register(
    client: redis.Redis | aioredis.Redis,
    name: str,
    *,
    package: str = WORKER,
    lib: str | None = None,
    prelude: str = "",
) -> Script | AsyncScript:
    """A ``Script`` running ``name`` after ``prelude`` and the library file ``lib`` (both
    optional). Hold it for the client's life: it re-loads itself after NOSCRIPT (a restarted
    or flushed Redis)."""
    parts = [prelude, source(lib, package) if lib else "", source(name, package)]
    return client.register_script("\n".join(p for p in parts if p))
