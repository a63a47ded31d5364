"""Whether this host wants a metering gateway, and whether one answers on its port."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from overnight.config.settings import Settings


def gateway_wanted(settings: Settings) -> bool:
    """A host runs a gateway (and steps get its token) once an upstream is configured."""
    return bool(settings.model_url or settings.anthropic_url)


def gateway_answers(settings: Settings, wait: float = 0.0) -> bool:
    """Whether a gateway answers on this host's gateway port (polled up to ``wait`` s)."""
    import socket

    host = settings.gateway_host if settings.gateway_host not in ("0.0.0.0", "::") else "127.0.0.1"
    deadline = time.monotonic() + wait
    while True:
        try:
            with socket.create_connection((host, settings.gateway_port), timeout=0.5):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
