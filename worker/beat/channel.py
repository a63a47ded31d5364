"""The beat channel: how a supervised step beats its own lease without any Redis credential.

Design. The supervisor owns one Unix ``SOCK_SEQPACKET`` socket per lease, bound in a fresh
folder it creates (``overnight-beat-LEASE-XXXX`` under ``$XDG_RUNTIME_DIR`` or the temp
folder) and removes when the step ends (a supervisor killed outright leaves it behind, like
the step's scratch ``HOME``: both carry the lease id in their names). The child gets its
path as ``OVERNIGHT_BEAT_SOCKET``; the listening socket sits in the supervisor's
``select.poll`` loop next to the output pipes. Seqpacket keeps message boundaries and, unlike
a datagram socket, gives every connection its peer's credentials.

One connection carries one request and one reply. A request is a JSON object
``{"lease_id": ID, "note": TEXT or null}`` (at most :data:`MAX_MESSAGE` bytes); the reply is
``ok SECONDS`` (the beat was taken; SECONDS is how long a silent step has from now) or
``refused REASON``. An accepted beat counts exactly like an output line (the keeper
coalesces and writes at most one Redis beat per interval); a note is written to the lease
(latest one wins, retried through a Redis blip).

Who may beat. The socket path is no secret (processes of one user can read each other's
environment), so the supervisor authenticates every peer by the pid the kernel reports for
it (``SO_PEERCRED``): it is accepted only if its ``/proc`` parent chain reaches the child
(same pid and start time), or reaches the supervisor itself through a process started no
earlier than the child that is not another step's child (an orphan of this tree that came
back to us as child subreaper). Everything else, another lease's step included, gets
``refused not-this-lease`` and is logged once per lease. Environment tags are never
trusted here: any process can set ``OVERNIGHT_LEASE_ID`` for itself. The folder and the
socket are reachable by other users (0711 / 0666) so that a step run as another user
(``OVERNIGHT_STEP_USER``) can beat; the peer check is the gate, not the path.

The client side (:func:`send_beat`) needs only the two environment variables and the
standard library, so ``overnight beat`` starts fast.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from overnight.config.errors import OvernightError
from overnight.worker.lease.store import LeaseRefused
from overnight.worker.supervise.procs import Proc, read_proc

log = logging.getLogger("overnight.supervisor")

SOCKET_VAR = "OVERNIGHT_BEAT_SOCKET"
LEASE_VAR = "OVERNIGHT_LEASE_ID"
MAX_MESSAGE = 4096
MAX_NOTE = 1024
MAX_OPEN = 32  # connections waiting for their request; beyond that the oldest is dropped
_SUN_PATH_MAX = 107
_running_roots: set[int] = set()  # children of the steps this process runs now


class NoChannel(OvernightError, LookupError):
    """This process does not run under a lease (no beat channel in its environment)."""


class ChannelDown(OvernightError, OSError):
    """The supervisor did not answer in time."""


# --- who may beat (a pure rule over a process-table reader) ----------------------------------


def in_tree(
    pid: int,
    *,
    root: int,
    root_start: int | None,
    adopter: int,
    other_roots: set[int] | frozenset[int] = frozenset(),
    read: Callable[[int], Proc | None] = read_proc,
) -> bool:
    """True if ``pid`` is the step's child ``root`` (started at ``root_start``), one of its
    descendants by the parent chain, or an orphan of the tree re-parented to ``adopter``
    (the supervisor): a direct child of ``adopter`` started no earlier than the root and not
    in ``other_roots`` (children of other steps run by the same process)."""
    seen: set[int] = set()
    while pid > 0 and pid not in seen:
        seen.add(pid)
        row = read(pid)
        if row is None:
            return False
        if pid == root:
            return root_start is not None and row.start == root_start
        if row.ppid == adopter:
            return pid not in other_roots and root_start is not None and row.start >= root_start
        pid = row.ppid
    return False


# --- the supervisor's side ------------------------------------------------------------------


@dataclass(frozen=True)
class Beat:
    """One accepted beat, and the note it carried (None: leave the note)."""

    note: str | None


def _short_base() -> str:
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg) and len(xdg) < 60:
        return xdg
    base = tempfile.gettempdir()
    return base if len(base) < 60 else "/tmp"


class Channel:
    """The listening socket of one lease, polled by the supervisor's loop.

    ``answer`` decides the reply to a beat from the step's own tree: a number of seconds
    (accepted) or a refusal reason. Call :meth:`attach` once the child exists, then
    :meth:`event` for every poll event on a descriptor :meth:`handles`.
    """

    def __init__(self, lease_id: str) -> None:
        self.lease_id = lease_id
        self.folder = tempfile.mkdtemp(prefix=f"overnight-beat-{lease_id[:16]}-", dir=_short_base())
        self.path = os.path.join(self.folder, "s")
        if len(self.path.encode()) > _SUN_PATH_MAX:
            raise OSError(f"beat socket path too long: {self.path}")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind(self.path)
            os.chmod(self.path, 0o666)
            os.chmod(self.folder, 0o711)
            self.sock.listen(64)
            self.sock.setblocking(False)
        except OSError:
            self.close()
            raise
        self.conns: dict[int, socket.socket] = {}
        self.poller: select.poll | None = None
        self.root = 0
        self.root_start: int | None = None
        self.refused = 0

    def environment(self) -> dict[str, str]:
        """What the child needs to reach this channel."""
        return {SOCKET_VAR: self.path, LEASE_VAR: self.lease_id}

    def attach(self, poller: select.poll, root: int, root_start: int | None) -> None:
        self.poller = poller
        self.root, self.root_start = root, root_start
        _running_roots.add(root)
        poller.register(self.sock.fileno(), select.POLLIN)

    def handles(self, fd: int) -> bool:
        return fd == self.sock.fileno() or fd in self.conns

    def event(self, fd: int, answer: Callable[[Beat], float | str]) -> list[Beat]:
        """Handle one poll event; the beats accepted (and already answered)."""
        if fd == self.sock.fileno():
            self._accept()
            return []
        conn = self.conns.get(fd)
        if conn is None:
            return []
        try:
            data = conn.recv(MAX_MESSAGE + 1)
        except BlockingIOError:
            return []
        except OSError:
            data = b""
        beat = _parse(data, self.lease_id) if data else None
        if beat is None:
            self._close_conn(fd, b"refused bad-request" if data else None)
            return []
        reply = answer(beat)
        if isinstance(reply, str):
            self._close_conn(fd, f"refused {reply}".encode())
            return []
        self._close_conn(fd, f"ok {reply:.3f}".encode())
        return [beat]

    def _accept(self) -> None:
        for _ in range(MAX_OPEN):
            try:
                conn, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("lease=%s: beat channel accept failed: %s", self.lease_id, exc)
                return
            conn.setblocking(False)
            pid = _peer_pid(conn)
            others = _running_roots - {self.root}
            if not in_tree(
                pid,
                root=self.root,
                root_start=self.root_start,
                adopter=os.getpid(),
                other_roots=others,
            ):
                self.refused += 1
                if self.refused == 1:
                    log.warning(
                        "lease=%s: refused a beat from pid %d: not of this lease's "
                        "tree (further refusals are not logged)",
                        self.lease_id,
                        pid,
                    )
                _reply(conn, b"refused not-this-lease")
                conn.close()
                continue
            if len(self.conns) >= MAX_OPEN:
                self._close_conn(next(iter(self.conns)), b"refused busy")
            self.conns[conn.fileno()] = conn
            if self.poller is not None:
                self.poller.register(conn.fileno(), select.POLLIN)

    def _close_conn(self, fd: int, reply: bytes | None) -> None:
        conn = self.conns.pop(fd)
        if self.poller is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.poller.unregister(fd)
        if reply is not None:
            _reply(conn, reply)
        conn.close()

    def close(self) -> None:
        """Stop taking beats (a late client sees the lease as over) and remove the folder."""
        _running_roots.discard(self.root)
        for fd in list(getattr(self, "conns", {})):
            self._close_conn(fd, b"refused not-running: the lease is ending")
        if self.poller is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.poller.unregister(self.sock.fileno())
            self.poller = None
        self.sock.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _peer_pid(conn: socket.socket) -> int:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return 0
    pid, _uid, _gid = struct.unpack("3i", creds)
    return int(pid)


def _queued(sock: socket.socket) -> str:
    """What is waiting to be read on ``sock`` now ("" if nothing)."""
    try:
        return sock.recv(256, socket.MSG_DONTWAIT).decode("utf-8", "replace")
    except OSError:
        return ""


def _reply(conn: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        conn.send(data, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)


def _parse(data: bytes, lease_id: str) -> Beat | None:
    if len(data) > MAX_MESSAGE:
        return None
    try:
        msg = json.loads(data)
    except ValueError:
        return None
    if not isinstance(msg, dict) or msg.get("lease_id") != lease_id:
        return None
    note = msg.get("note")
    if note is not None and (not isinstance(note, str) or len(note) > MAX_NOTE):
        return None
    return Beat(note)


# --- the step's side ------------------------------------------------------------------------


def channel_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(lease id, socket path) from the environment; :class:`NoChannel` if either is unset."""
    env = os.environ if environ is None else environ
    lease_id, path = env.get(LEASE_VAR, ""), env.get(SOCKET_VAR, "")
    if not lease_id or not path:
        raise NoChannel(f"no lease in the environment ({LEASE_VAR}/{SOCKET_VAR} unset)")
    return lease_id, path


def send_beat(
    note: str | None = None, *, environ: Mapping[str, str] | None = None, timeout: float = 5.0
) -> float:
    """Beat the lease this process runs under; returns the seconds a silent step has now.

    Raises :class:`NoChannel` outside a lease, :class:`~worker.lease.store.LeaseRefused` when the
    supervisor refuses (not this lease's tree, or the lease is over and its channel gone),
    and :class:`ChannelDown` if the supervisor does not answer within ``timeout``.
    """
    lease_id, path = channel_from_env(environ)
    if note is not None and len(note) > MAX_NOTE:
        note = note[:MAX_NOTE]
    request = json.dumps({"lease_id": lease_id, "note": note}).encode()
    end = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        closed = LeaseRefused(lease_id, "not-running: its supervisor's channel is closed")
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, BrokenPipeError):
            raise closed from None
        try:
            # A supervisor that refuses at once may close before we send: read its answer.
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                sock.send(request)
            sock.settimeout(max(0.01, end - time.monotonic()))
            reply = sock.recv(256).decode("utf-8", "replace")
        except (ConnectionResetError, BrokenPipeError):
            # A supervisor that answered and closed before reading our request resets the
            # connection; its answer is still queued behind the reset.
            reply = _queued(sock)
            if not reply:
                raise closed from None
        except TimeoutError:
            raise ChannelDown(f"lease {lease_id}: its supervisor did not answer a beat") from None
        if not reply:
            raise closed
    word, _, rest = reply.partition(" ")
    if word == "ok":
        try:
            return float(rest)
        except ValueError:
            return 0.0
    raise LeaseRefused(lease_id, rest or "not-running: its supervisor closed the channel")
