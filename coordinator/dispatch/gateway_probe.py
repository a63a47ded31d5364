"""Whether this host wants a metering gateway, and whether overnight's own serves its socket."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from overnight.config.settings import Settings


def gateway_wanted(settings: Settings) -> bool:
    """A host runs a gateway (and steps get its token) once an upstream is configured."""
    return bool(settings.model_url or settings.anthropic_url)


def gateway_answers(settings: Settings, wait: float = 0.0) -> bool:
    """Whether overnight's own gateway serves this namespace here (polled up to ``wait`` s):
    its Unix socket answers, in overnight's folder, from overnight's uid. Whatever answers
    on the TCP port is not asked: a step may have taken it after the gateway died."""
    from overnight.config.runtime import gateway_socket
    from overnight.worker.gateway.peer import socket_problem

    path = gateway_socket(settings.namespace)
    deadline = time.monotonic() + wait
    while True:
        if socket_problem(path, timeout=0.5) is None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
