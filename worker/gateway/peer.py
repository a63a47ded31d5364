"""Who is listening where the gateway should be, checked before a token is sent there.

The gateway's Unix socket is trusted by where it is (a folder only overnight's user writes,
:func:`config.runtime.gateway_folder`) and by its peer's credentials (``SO_PEERCRED``). Its
loopback TCP port, kept for clients that cannot speak to a Unix socket, is trusted only
while every listening socket on it belongs to overnight's uid (``/proc/net/tcp``): a step
that binds the port after the gateway died is another uid, and is never sent a token.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

LISTEN = "0A"
# Local addresses a connection to loopback can land on (hex as /proc/net/tcp{,6} writes them).
_REACHED_FROM_LOOPBACK = {
    "0100007F",  # 127.0.0.1
    "00000000",  # 0.0.0.0
    "00000000000000000000000001000000",  # ::1
    "00000000000000000000000000000000",  # ::
    "0000000000000000FFFF00000100007F",  # ::ffff:127.0.0.1
}


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket: its local address (hex), port and owner."""

    address: str
    port: int
    uid: int


def listeners(lines: Iterable[str]) -> list[Listener]:
    """The listening sockets of a ``/proc/net/tcp`` or ``tcp6`` table (header included)."""
    out = []
    for line in lines:
        cols = line.split()
        if len(cols) < 8 or cols[3] != LISTEN or ":" not in cols[1]:
            continue
        address, port = cols[1].rsplit(":", 1)
        try:
            out.append(Listener(address.upper(), int(port, 16), int(cols[7])))
        except ValueError:
            continue
    return out


def port_problem(found: Iterable[Listener], port: int, uid: int) -> str | None:
    """Why a loopback connection to ``port`` may not reach uid ``uid``'s listener: nothing
    listens there, or another uid does (None: only ``uid`` listens)."""
    owners = {f.uid for f in found if f.port == port and f.address in _REACHED_FROM_LOOPBACK}
    if not owners:
        return f"nothing listens on loopback port {port}"
    strangers = sorted(owners - {uid})
    if strangers:
        who = ", ".join(str(u) for u in strangers)
        return f"loopback port {port} is held by uid {who}, not by overnight's uid {uid}"
    return None


def tcp_problem(url: str, uid: int | None = None) -> str | None:
    """Why the loopback TCP gateway ``url`` names may not be sent a token (None: it is
    overnight's). A URL that is not on loopback is not checked here (None)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    found: list[Listener] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as fh:
                found += listeners(fh)
        except OSError:
            continue
    return port_problem(found, port, os.geteuid() if uid is None else uid)


def socket_problem(path: Path, uid: int | None = None, timeout: float = 1.0) -> str | None:
    """Why the gateway socket at ``path`` may not be trusted (None: it is overnight's, in
    overnight's folder, and the process that answers is overnight's uid)."""
    me = os.geteuid() if uid is None else uid
    try:
        folder = os.lstat(path.parent)
        info = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    if not stat.S_ISDIR(folder.st_mode) or folder.st_uid != me or folder.st_mode & 0o022:
        return f"{path.parent} is not a folder only uid {me} writes"
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != me:
        return f"{path} is not a socket of uid {me}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    finally:
        sock.close()
    _pid, peer_uid, _gid = struct.unpack("3i", raw)
    if peer_uid != me:
        return f"{path} is answered by uid {peer_uid}, not by overnight's uid {me}"
    return None
