"""The network bridge started inside a step's sandbox, before the step: it listens on the
loopback port the step's ``base_url`` names and forwards each connection to the gateway's
Unix socket bound into the sandbox. The network namespace has nothing else.

Run as ``python3 -I -S -c SOURCE PORT SOCKET -- ARGV...`` (standard library only, so any
system Python runs it and nothing of overnight needs to be visible inside): it listens,
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


def main(args: list[str]) -> None:
    """``PORT SOCKET -- ARGV...``: start the bridge, then become ARGV."""
    if len(args) < 4 or args[2] != "--":
        sys.stderr.write("overnight bridge: usage: PORT SOCKET -- ARGV...\n")
        os._exit(125)
    port, path, argv = int(args[0]), args[1], args[3:]
    try:
        listeners = _listeners(port)
    except OSError as exc:
        sys.stderr.write(f"overnight bridge: cannot listen on 127.0.0.1:{port}: {exc}\n")
        os._exit(125)
    first = os.fork()
    if first == 0:
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            for extra in listeners[1:]:
                threading.Thread(target=_serve, args=(extra, path), daemon=True).start()
            _serve(listeners[0], path)
        os._exit(0)
    os.waitpid(first, 0)
    for listener in listeners:
        listener.close()
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"overnight bridge: cannot run {argv[0]!r}: {exc.strerror}\n")
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)


if __name__ == "__main__":
    main(sys.argv[1:])
