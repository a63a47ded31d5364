"""A per-step Unix socket in front of a gateway that listens on TCP only.

A sandboxed step reaches nothing but a Unix socket bound into its sandbox. When the gateway
has no Unix socket of its own, the supervisor opens one for the step (in a fresh folder it
removes when the step ends) and forwards each connection to the gateway's loopback port.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
from urllib.parse import urlsplit

from overnight.worker.sandbox.bridge import pump


def url_port(url: str) -> int:
    """The TCP port ``url`` names (its scheme's default when it names none)."""
    parts = urlsplit(url)
    if parts.port is not None:
        return parts.port
    return 443 if parts.scheme == "https" else 80


class Relay:
    """A listening Unix socket (``path``) whose every connection is forwarded to
    ``host:port``, served by a daemon thread until :meth:`close`."""

    def __init__(self, lease_id: str, host: str, port: int) -> None:
        self.folder = tempfile.mkdtemp(prefix=f"overnight-gw-{lease_id[:24]}-")
        os.chmod(self.folder, 0o711)
        self.path = os.path.join(self.folder, "gateway.sock")
        self.target = (host, port)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(self.path)
            os.chmod(self.path, 0o666)  # the step's uid connects; only this folder holds it
            self.sock.listen(64)
        except OSError:
            self.close()
            raise
        self.thread = threading.Thread(target=self._serve, daemon=True, name="gateway-relay")
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._pair, args=(conn,), daemon=True).start()

    def _pair(self, conn: socket.socket) -> None:
        from overnight.worker.gateway.peer import tcp_problem

        host, port = self.target
        # Checked per connection: the gateway may die mid-step and a stranger take its port.
        if tcp_problem(f"http://{host}:{port}") is not None:
            conn.close()
            return
        try:
            up = socket.create_connection(self.target, timeout=10)
        except OSError:
            conn.close()
            return
        up.settimeout(None)
        back = threading.Thread(target=pump, args=(up, conn), daemon=True)
        back.start()
        pump(conn, up)
        back.join()
        conn.close()
        up.close()

    def close(self) -> None:
        """Stop listening and remove the folder (connections open now finish on their own)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        shutil.rmtree(self.folder, ignore_errors=True)
