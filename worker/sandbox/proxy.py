"""The HTTP proxy through which a sandboxed step reaches its task's ``allow_hosts``, and
the rules it keeps (pure functions, first).

A rule is ``host`` or ``host:port`` (port 443 by default): a DNS name, an IP literal (IPv6
in brackets) or ``*.domain`` (every name under ``domain``, not ``domain`` itself, never an
IP). Names compare without case and one trailing dot. A request names its target the same
way; userinfo, a numeric or hex "name" a resolver reads as an address, or a scheme other
than ``http`` is refused.

The proxy runs in the supervisor (as overnight, outside the sandbox), one per step, on a
Unix socket in a fresh folder only overnight writes; the sandbox binds it in and the bridge
serves it on a loopback port (:func:`inside_port`). It accepts ``CONNECT host:port`` and
plain-HTTP requests with an absolute ``http://`` URI for listed hosts only
(:func:`allowed`), resolves the name itself, and answers every other request 403. Each
refusal is a line in the step's output and overnight's log (the first :data:`SAID_EACH`;
then only counted), and the count is said when the step ends.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from overnight.worker.sandbox.bridge import pump

DEFAULT_PORT = 443
HTTP_PORT = 80
_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
_NUMERIC = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")
# Headers a plain-HTTP request loses on its way upstream (hop-by-hop, or for the proxy).
_DROPPED = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "host", "te"}


@dataclass(frozen=True)
class HostRule:
    """One entry of ``allow_hosts``: a normalized host (or the domain under a wildcard)."""

    host: str
    port: int
    wildcard: bool = False


def normal_host(text: str) -> str | None:
    """``text`` as a host compares (lower case, no trailing dot, an IP in its canonical
    form, an IPv6 literal without brackets), or None when it is not a host name or IP."""
    host = text.lower()
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            return None
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    host = host.removesuffix(".")
    labels = host.split(".")
    if not host or len(host) > 253 or not all(_LABEL.match(label) for label in labels):
        return None
    if _NUMERIC.match(labels[-1]):  # "127.1", "0x7f.1", "2130706433": an address in disguise
        return None
    return host


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def split_authority(text: str, default_port: int | None) -> tuple[str, int]:
    """``host[:port]`` (IPv6 in brackets) as (normalized host, port); raises ``ValueError``.
    Without a port, ``default_port`` (None: a port is required)."""
    if "@" in text or any(c.isspace() or ord(c) < 32 or c in "/\\?#%" for c in text):
        raise ValueError(f"not a host[:port]: {text!r}")
    if text.startswith("["):
        end = text.find("]")
        head, rest = text[: end + 1], text[end + 1 :]
        if end < 0 or (rest and not rest.startswith(":")):
            raise ValueError(f"not a host[:port]: {text!r}")
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        head, port_text = text.split(":")
    elif ":" in text:
        raise ValueError(f"an IPv6 address must be in brackets: {text!r}")
    else:
        head, port_text = text, None
    host = normal_host(head)
    if host is None:
        raise ValueError(f"not a host name or IP address: {head!r}")
    if port_text is None:
        if default_port is None:
            raise ValueError(f"no port: {text!r}")
        return host, default_port
    if not re.fullmatch(r"[0-9]{1,5}", port_text) or not 0 < int(port_text) < 65536:
        raise ValueError(f"not a port (1-65535): {port_text!r}")
    return host, int(port_text)


def parse_rule(text: str) -> HostRule:
    """One ``allow_hosts`` entry as a rule; raises ``ValueError`` saying what is wrong."""
    wildcard = text.startswith("*.")
    host, port = split_authority(text[2:] if wildcard else text, DEFAULT_PORT)
    if wildcard and (is_ip(host) or "." not in host):
        raise ValueError(f"a wildcard needs a domain of two labels or more: {text!r}")
    return HostRule(host, port, wildcard)


def allowed(host: str, port: int, rules: Sequence[HostRule]) -> bool:
    """Whether a request for ``host:port`` may pass: some rule names that port and that
    host exactly, or a domain above it (a wildcard; never for an IP)."""
    name = normal_host(host) if not is_ip(host) else str(ipaddress.ip_address(host))
    return name is not None and any(
        rule.port == port
        and (
            name.endswith("." + rule.host) and not is_ip(name)
            if rule.wildcard
            else name == rule.host
        )
        for rule in rules
    )


def address_problem(address: str, host: str) -> str | None:
    """Why the proxy must not connect to ``address``, which ``host`` resolved to (None: it
    may): a name must not lead to this host's own services or link-local neighbours; an
    address the task lists as itself may be anything it lists."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if is_ip(host) and ip == ipaddress.ip_address(host):
        return None
    if ip.is_loopback or ip.is_unspecified or ip.is_link_local or ip.is_multicast:
        return f"{host} resolves to {ip}, which only an allow_hosts entry naming it may reach"
    return None


@dataclass(frozen=True)
class Request:
    """What a client asked the proxy for: a tunnel (``connect``) or one plain-HTTP request
    (``head`` is then what goes upstream, with the client's bytes after it)."""

    host: str
    port: int
    connect: bool
    head: bytes = b""


def parse_request(head: bytes) -> Request:
    """A request's head (up to and including its blank line) as a :class:`Request`;
    raises ``ValueError`` saying why it is refused."""
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("a request head that is not ASCII") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise ValueError("not an HTTP/1 request line")
    method, target, _version = parts
    if method == "CONNECT":
        host, port = split_authority(target, None)
        return Request(host, port, connect=True)
    if not re.match(r"^[A-Z]{1,20}$", method):
        raise ValueError("not an HTTP method")
    if not target.lower().startswith("http://"):
        raise ValueError("only CONNECT, or an absolute http:// URI")
    rest = target[len("http://") :]
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    host, port = split_authority(rest[:cut], HTTP_PORT)
    path = rest[cut:] or "/"
    if path.startswith("?"):
        path = "/" + path
    kept = [h for h in lines[1:] if ":" in h and h.split(":")[0].strip().lower() not in _DROPPED]
    authority = show(host, port) if port != HTTP_PORT else show(host, None)
    out = [f"{method} {path} HTTP/1.1", f"Host: {authority}", *kept, "Connection: close"]
    return Request(host, port, connect=False, head=("\r\n".join(out) + "\r\n\r\n").encode())


def show(host: str, port: int | None) -> str:
    """``host:port`` as a URL writes it (an IPv6 address in brackets)."""
    shown = f"[{host}]" if ":" in host else host
    return shown if port is None else f"{shown}:{port}"


def inside_port(gateway_port: int | None) -> int:
    """The loopback port the step's proxy listens on inside its sandbox."""
    return 3129 if gateway_port == 3128 else 3128


def proxy_env(port: int) -> dict[str, str]:
    """The variables that point a step's HTTP clients at its proxy; loopback (its gateway)
    is reached directly."""
    url = f"http://127.0.0.1:{port}"
    env = dict.fromkeys(("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"), url)
    return env | dict.fromkeys(("NO_PROXY", "no_proxy"), "localhost,127.0.0.1,::1")


log = logging.getLogger("overnight.proxy")
HEAD_MAX = 16 * 1024
HEAD_TIMEOUT = 15.0
CONNECT_TIMEOUT = 10.0
MAX_OPEN = 64  # connections served at once; more wait in the listen queue
SAID_EACH = 20  # refusals said one by one; past them, only counted


def _stderr(line: bytes) -> None:
    sys.stderr.buffer.write(line)
    sys.stderr.buffer.flush()


def _reply(conn: socket.socket, status: str, why: str) -> None:
    body = f"overnight proxy: {why}\n".encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with contextlib.suppress(OSError):
        conn.sendall(head.encode() + body)


def read_head(conn: socket.socket) -> tuple[bytes, bytes]:
    """A request's head (through its blank line) and the bytes read past it; raises
    ``ValueError`` for a head too long or cut short."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > HEAD_MAX:
            raise ValueError("a request head over 16 KiB")
        chunk = conn.recv(4096)
        if not chunk:
            raise ValueError("the request ended before its head did")
        data += chunk
    end = data.index(b"\r\n\r\n") + 4
    return data[:end], data[end:]


class Proxy:
    """A listening Unix socket (``path``) serving the proxy for one step until :meth:`close`.
    ``say`` gets each line for the step's output (None: this process's stderr)."""

    def __init__(
        self,
        rules: Sequence[HostRule],
        *,
        lease_id: str,
        task_id: str | None,
        say: Callable[[bytes], None] | None = None,
    ) -> None:
        self.rules = tuple(rules)
        self.lease_id, self.task_id = lease_id, task_id
        self.say = say or _stderr
        self.refused: Counter[str] = Counter()
        self.passed = 0
        self.tunnels: set[socket.socket] = set()  # ended by close(), whoever holds them open
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(MAX_OPEN)
        self.folder = tempfile.mkdtemp(prefix=f"overnight-proxy-{lease_id[:24]}-")
        os.chmod(self.folder, 0o711)
        self.path = os.path.join(self.folder, "proxy.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(self.path)
            os.chmod(self.path, 0o666)  # the step's uid connects; only this folder holds it
            self.sock.listen(64)
        except OSError:
            self.close()
            raise
        self.thread = threading.Thread(target=self._serve, daemon=True, name="step-proxy")
        self.thread.start()

    def _serve(self) -> None:
        while True:
            self.slots.acquire()
            try:
                conn, _ = self.sock.accept()
            except OSError:
                self.slots.release()
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn, contextlib.suppress(OSError):
                conn.settimeout(HEAD_TIMEOUT)
                self._serve_one(conn)
        finally:
            self.slots.release()

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            head, extra = read_head(conn)
            request = parse_request(head)
        except ValueError as exc:
            self._refuse(conn, "a malformed request", str(exc))
            return
        target = show(request.host, request.port)
        if not allowed(request.host, request.port, self.rules):
            self._refuse(conn, target, "not in allow_hosts")
            return
        up, problem = self._connect(request.host, request.port)
        if up is None:
            if problem is not None:
                self._refuse(conn, target, problem)
            else:
                _reply(conn, "502 Bad Gateway", f"cannot reach {target}")
            return
        with self.lock:
            self.passed += 1
            self.tunnels |= {conn, up}
        with up:
            conn.settimeout(None)
            if request.connect:
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                up.sendall(request.head)
            if extra:
                up.sendall(extra)
            back = threading.Thread(target=pump, args=(up, conn), daemon=True)
            back.start()
            pump(conn, up)
            back.join()
        with self.lock:
            self.tunnels -= {conn, up}

    def _connect(self, host: str, port: int) -> tuple[socket.socket | None, str | None]:
        # The name is resolved here, once: the address connected to is the one checked.
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            return None, None
        problem = None
        for family, kind, proto, _name, address in found:
            problem = address_problem(str(address[0]), host)
            if problem is not None:
                continue
            up = socket.socket(family, kind, proto)
            up.settimeout(CONNECT_TIMEOUT)
            try:
                up.connect(address)
            except OSError:
                up.close()
                continue
            up.settimeout(None)
            return up, None
        return None, problem

    def _refuse(self, conn: socket.socket, target: str, why: str) -> None:
        with self.lock:  # counted and said before the step sees its answer
            self.refused[target] += 1
            said = sum(self.refused.values()) <= SAID_EACH
        if said:
            task = self.task_id or "-"
            log.warning("lease=%s task=%s: proxy refused %s: %s", self.lease_id, task, target, why)
            self.say(f"overnight: task {task}: proxy refused {target}: {why}\n".encode())
        _reply(conn, "403 Forbidden", f"refused {target}: {why}")

    def summary(self) -> str | None:
        """One line counting what was refused (None: nothing was)."""
        with self.lock:
            if not self.refused:
                return None
            total, passed, most = (
                sum(self.refused.values()),
                self.passed,
                self.refused.most_common(),
            )
        top = ", ".join(f"{target} x{n}" for target, n in most[:10])
        rest = f", and {len(most) - 10} more" if len(most) > 10 else ""
        return (
            f"overnight: task {self.task_id or '-'}: proxy refused {total} connection(s) "
            f"({top}{rest}); {passed} let through"
        )

    def close(self) -> None:
        """Stop listening, end the open tunnels, remove the folder, say what was refused."""
        with self.lock:
            ending = [self.sock, *self.tunnels]
        for sock in ending:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        line = self.summary()
        if line is not None:
            log.warning("lease=%s %s", self.lease_id, line.removeprefix("overnight: "))
            with contextlib.suppress(Exception):
                self.say(line.encode() + b"\n")
