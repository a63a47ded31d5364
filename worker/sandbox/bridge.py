"""The network bridge started inside a step's sandbox, before the step: it listens on the
loopback port the step's ``base_url`` names and forwards each connection to the gateway's
Unix socket bound into the sandbox (and, for a task with ``allow_hosts``, on the proxy's
port to the proxy's socket). The network namespace has nothing else.

Run as ``python3 -I -S -c SOURCE PORT SOCKET [PORT SOCKET]... -- ARGV...`` (standard
library only, so any system Python runs it and nothing of overnight needs to be visible
inside): it listens,
leaves a server process behind (reparented to the sandbox's init, so the step never waits
for it), then becomes the step by ``exec``. The server dies with the sandbox's pid
namespace when the step ends.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading


def pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def _pair(conn: socket.socket, path: str) -> None:
    up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        up.connect(path)
    except OSError:
        conn.close()
        up.close()
        return
    back = threading.Thread(target=pump, args=(up, conn), daemon=True)
    back.start()
    pump(conn, up)
    back.join()
    conn.close()
    up.close()


def _serve(listener: socket.socket, path: str) -> None:
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_pair, args=(conn, path), daemon=True).start()


def _listeners(port: int) -> list[socket.socket]:
    found = [socket.create_server(("127.0.0.1", port))]
    with contextlib.suppress(OSError):  # a host without IPv6 loopback
        found.append(socket.create_server(("::1", port), family=socket.AF_INET6))
    return found


def _forwards(args: list[str]) -> tuple[list[tuple[int, str]], list[str]] | None:
    if "--" not in args:
        return None
    cut = args.index("--")
    pairs, argv = args[:cut], args[cut + 1 :]
    if not pairs or len(pairs) % 2 or not argv or not all(p.isdigit() for p in pairs[::2]):
        return None
    return [(int(pairs[i]), pairs[i + 1]) for i in range(0, len(pairs), 2)], argv


def main(args: list[str]) -> None:
    """``PORT SOCKET [PORT SOCKET]... -- ARGV...``: start the bridge, then become ARGV."""
    parsed = _forwards(args)
    if parsed is None:
        sys.stderr.write("overnight bridge: usage: PORT SOCKET [PORT SOCKET]... -- ARGV...\n")
        os._exit(125)
    forwards, argv = parsed
    served: list[tuple[socket.socket, str]] = []
    for port, path in forwards:
        try:
            served += [(listener, path) for listener in _listeners(port)]
        except OSError as exc:
            sys.stderr.write(f"overnight bridge: cannot listen on 127.0.0.1:{port}: {exc}\n")
            os._exit(125)
    first = os.fork()
    if first == 0:
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            for listener, path in served[1:]:
                threading.Thread(target=_serve, args=(listener, path), daemon=True).start()
            _serve(*served[0])
        os._exit(0)
    os.waitpid(first, 0)
    for listener, _path in served:
        listener.close()
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"overnight bridge: cannot run {argv[0]!r}: {exc.strerror}\n")
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)


if __name__ == "__main__":
    main(sys.argv[1:])
