"""Where overnight keeps host-local state that a step must not write: one function, so the
supervisor and the reaper always agree.

Root uses ``/run/overnight``; anyone else ``$XDG_RUNTIME_DIR/overnight`` when that is set,
else ``/tmp/overnight-<uid>``. Below it, one folder per namespace. Every folder overnight
creates there is mode 0700 and owned by the user it runs as.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote


def runtime_root() -> Path:
    """The base folder for this user's host-local state."""
    if os.geteuid() == 0:
        return Path("/run/overnight")
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "overnight"
    return Path(f"/tmp/overnight-{os.geteuid()}")


def proof_dir(namespace: str) -> Path:
    """The folder of the supervisor's lease proofs for ``namespace`` (see worker.lease.proof)."""
    return runtime_root() / f"ns-{quote(namespace, safe='')}" / "leases"


def gateway_folder() -> Path:
    """The folder of this user's gateway sockets, beside :func:`runtime_root`: this user's
    own and written by no one else (0755: steps, and bubblewrap run as a step's uid, reach
    the socket in it; none can put a socket of its own there)."""
    root = runtime_root()
    return root.with_name(root.name + "-gateway")


def gateway_socket(namespace: str) -> Path:
    """The Unix socket the gateway of ``namespace`` listens on (see :func:`gateway_folder`):
    workers and sandboxed steps reach the gateway through it, never through a TCP port that
    a step could take over."""
    return gateway_folder() / f"{quote(namespace, safe='')}.sock"
