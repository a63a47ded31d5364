"""How each host's steps are contained, recorded in Redis for status and the report.

Every worker records at start the mode its steps run under (``bwrap`` or ``off``) against
its host id, so ``overnight status`` and ``overnight report`` can say which hosts ran steps
without a sandbox. The words are pure functions of the recorded map.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from overnight.config.keys import Keys

BWRAP = "bwrap"
OFF = "off"


def record(client: Any, keys: Keys, host: str, mode: str, ttl: int) -> None:
    """Record that ``host``'s steps run under ``mode`` (kept ``ttl`` seconds past the last
    worker start, as long as what the report reads)."""
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.sandbox_modes, host, mode)
    pipe.expire(keys.sandbox_modes, ttl)
    pipe.execute()


def read(client: Any, keys: Keys) -> dict[str, str]:
    """Host id -> mode, as recorded (empty if no worker has started in the namespace)."""
    raw = client.hgetall(keys.sandbox_modes)
    return {_text(k): _text(v) for k, v in sorted(raw.items(), key=lambda kv: _text(kv[0]))}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def line(modes: Mapping[str, str]) -> str:
    """One line saying how steps were contained: ``sandbox: bwrap`` when every host ran one
    mode, else the mode of each host; ``sandbox: unknown`` before any worker recorded."""
    if not modes:
        return "sandbox: unknown (no worker has recorded one)"
    kinds = sorted(set(modes.values()))
    where = ", ".join(sorted(modes))
    if len(kinds) == 1:
        return f"sandbox: {kinds[0]} (host{'s' if len(modes) > 1 else ''} {where})"
    weakest_first = sorted(modes.items(), key=lambda hm: (hm[1] == BWRAP, hm[0]))
    return "sandbox: " + "; ".join(f"{mode} on {host}" for host, mode in weakest_first)


def notices(modes: Mapping[str, str]) -> list[str]:
    """The report's warning for hosts whose steps ran without a sandbox, or none."""
    bare = sorted(host for host, mode in modes.items() if mode != BWRAP)
    if not bare:
        return []
    return [
        f"a sandbox on {', '.join(bare)} (OVERNIGHT_SANDBOX=off): steps there ran with the "
        "step user and cgroup alone: the host's network and files that user can reach"
    ]
