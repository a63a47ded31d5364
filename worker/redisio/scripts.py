"""Loading the Lua scripts that live in ``worker/lua/`` (one file per transition)."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis
    from redis.commands.core import Script


@cache
def source(name: str) -> str:
    """The text of ``worker/lua/<name>.lua``."""
    return resources.files("overnight.worker").joinpath("lua", f"{name}.lua").read_text()


def register(client: redis.Redis, name: str) -> Script:
    """A redis-py ``Script`` for ``name``; it re-loads itself after NOSCRIPT (Redis restart)."""
    return client.register_script(source(name))
