"""Running one command under one lease: beats, lapse detection, fail-closed, and the tree kill.

The loop waits on everything at once (``select.poll``): the child's pidfd, its output pipes,
the signal wakeup pipe, and a timer for the next moment the lease could lapse, a beat is
due or a Redis retry is due. Nothing here polls by sleeping. Usable in-process (an RQ work
horse) as well as from ``overnight supervise``; signal handlers only when asked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import select
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from config.exits import EXIT_HEARTBEAT_GAP, EXIT_LEASE_LOST, EXIT_REFUSED
from config.keys import Keys
from worker import procs, tree
from worker.lease import (
    LeaseCorrupt,
    LeaseDoc,
    LeaseRefused,
    Leases,
    Status,
    lapsed_reason,
    status_for,
)

if TYPE_CHECKING:
    import redis

log = logging.getLogger("overnight.supervisor")

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
LINE_MAX = 65536  # a longer run of bytes without a newline is handed on as one line
_POLL_IN = select.POLLIN | select.POLLHUP | select.POLLERR


@dataclass
class StepSpec:
    """One command to run under one lease.

    ``deadline`` is the lease budget, ``gap`` the longest silence allowed, ``grace`` the
    time between SIGTERM and SIGKILL, all in seconds. ``env`` is merged over this process's
    environment. ``redis_url`` is what the child gets as ``OVERNIGHT_REDIS_URL`` (default:
    rebuilt from the client). ``install_signals`` makes SIGTERM/SIGINT/SIGHUP to this
    process end the step (main thread only; the CLI uses it, an RQ horse does not).
    """

    argv: list[str]
    deadline: float = 180.0
    gap: float = 30.0
    grace: float = 5.0
    lease_id: str | None = None
    cwd: str | None = None
    env: dict[str, str] | None = None
    output_beats: bool = True
    beat_while_alive: bool = False
    lease_file: str | None = None
    task_id: str | None = None
    install_signals: bool = False
    redis_url: str | None = None
    note: str = "boot"


@dataclass
class SupervisedResult:
    """How a step ended.

    ``exit_code`` is the contract's ``supervise`` exit; ``doc`` the final lease document
    (as Redis holds it, or as the supervisor last knew it if Redis was lost); ``reason`` the
    note the supervisor ended the lease with; ``returncode`` the child's own status (negative
    for a signal, None if it never ran); ``ended_here`` is False when another writer (the
    reaper) ended the lease first.
    """

    exit_code: int
    doc: LeaseDoc
    reason: str
    returncode: int | None = None
    lease_lost: bool = False
    ended_here: bool = True
    seconds: float = 0.0
    kill: tree.KillReport | None = None


class SignalCatcher:
    """Records SIGTERM/SIGINT/SIGHUP and wakes a poll loop through ``set_wakeup_fd``.

    Install it before any slow start-up work, so an early signal is kept, not lost.
    """

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self.pending: list[int] = []
        self._old: dict[int, Any] = {}
        self._old_fd: int | None = None

    @classmethod
    def install(cls) -> SignalCatcher:
        """Catch the forwarded signals from now on (main thread only)."""
        catcher = cls()
        catcher._old_fd = signal.set_wakeup_fd(catcher.write_fd, warn_on_full_buffer=False)
        for sig in FORWARDED:
            catcher._old[sig] = signal.signal(sig, catcher._handle)
        from worker import early_signals

        catcher.pending.extend(early_signals.take())
        if catcher.pending:
            os.write(catcher.write_fd, b"\0")
        return catcher

    def _handle(self, signum: int, frame: object) -> None:
        self.pending.append(signum)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self.read_fd, 512):
                pass

    def close(self) -> None:
        """Put the previous handlers back and close the pipe."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if self._old_fd is not None:
            signal.set_wakeup_fd(self._old_fd)
        self._old.clear()
        self._old_fd = None
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def io_timeout(gap: float) -> float:
    """Socket timeout for a supervisor's Redis calls: well under the gap, so loss shows fast."""
    return max(0.05, min(1.0, gap / 4))


def client_for_url(url: str, gap: float) -> redis.Redis:
    """A text client with short timeouts and one immediate retry (for a stale connection)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    t = io_timeout(gap)
    return redis.Redis.from_url(
        url,
        socket_timeout=t,
        socket_connect_timeout=t,
        retry=Retry(NoBackoff(), 1),
        decode_responses=True,
    )


# Per caller pool and timeout, the supervisor's own client: steps run one after another in
# a work horse share its connection instead of opening one each.
_private: weakref.WeakKeyDictionary[Any, dict[float, redis.Redis]] = weakref.WeakKeyDictionary()
_private_lock = threading.Lock()


def _private_client(client: redis.Redis, gap: float) -> redis.Redis:
    """A copy of ``client`` with the supervisor's short timeouts (the original if it cannot);
    made once per pool and timeout, then shared."""
    import redis

    pool = client.connection_pool
    if type(pool) is not redis.ConnectionPool or "fakeredis" in type(client).__module__:
        return client
    t = io_timeout(gap)
    with _private_lock:
        mine = _private.setdefault(pool, {})
        if t not in mine:
            mine[t] = _copy_client(pool, t) or client
        return mine[t]


def _copy_client(pool: redis.ConnectionPool, t: float) -> redis.Redis | None:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kwargs = dict(pool.connection_kwargs)
    kwargs.update(socket_timeout=t, retry=Retry(NoBackoff(), 1), decode_responses=True)
    if "socket_connect_timeout" in kwargs:
        kwargs["socket_connect_timeout"] = t
    try:
        new_pool = redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    except TypeError:
        return None
    return redis.Redis(connection_pool=new_pool)


def url_of(client: redis.Redis) -> str:
    """A redis-py URL that reaches the same server as ``client`` (for the child's env)."""
    from urllib.parse import quote, urlencode

    kw = client.connection_pool.connection_kwargs
    auth = ""
    if kw.get("password"):
        auth = f"{quote(str(kw.get('username') or ''), safe='')}:"
        auth += f"{quote(str(kw['password']), safe='')}@"
    elif kw.get("username"):
        auth = f"{quote(str(kw['username']), safe='')}@"
    db = kw.get("db") or 0
    if kw.get("path"):
        return f"unix://{auth}{kw['path']}?db={db}"
    scheme = "rediss" if "SSL" in client.connection_pool.connection_class.__name__ else "redis"
    url = f"{scheme}://{auth}{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{db}"
    # The TLS options redis-py reads from a URL, so the child trusts the same certificates.
    tls = {k: str(v) for k, v in kw.items() if k in _TLS_QUERY and v not in (None, "")}
    tls.update({k: str(kw[k]) for k, usual in _TLS_USUAL.items() if kw.get(k, usual) != usual})
    return f"{url}?{urlencode(tls)}" if scheme == "rediss" and tls else url


_TLS_QUERY = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile")
_TLS_USUAL = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}  # redis-py's defaults


_subreaper_lock = threading.Lock()
_subreaper_users: dict[int, tuple[int, bool]] = {}  # pid -> (steps running, was before)


@contextlib.contextmanager
def _subreaper() -> Iterator[None]:
    """Be a child subreaper while at least one step of this process runs, then restore the
    previous state, so a long-lived caller does not collect strangers' orphans for ever."""
    pid = os.getpid()  # a forked horse starts its own count
    with _subreaper_lock:
        count, before = _subreaper_users.get(pid, (0, False))
        if count == 0:
            before = tree.is_child_subreaper()
            if not tree.set_child_subreaper():
                log.warning("host=%s: cannot become a child subreaper", procs.hostname())
        _subreaper_users[pid] = (count + 1, before)
    try:
        yield
    finally:
        with _subreaper_lock:
            count, before = _subreaper_users[pid]
            _subreaper_users[pid] = (count - 1, before)
            if count == 1 and not before:
                tree.set_child_subreaper(False)


@dataclass
class _Outcome:
    status: Status
    note: str
    exit_code: int
    receipt_kind: str = "lease_ended"
    first_signal: int = signal.SIGTERM
    write: bool = True  # False when someone else already ended the lease
    lost: bool = False


def _redis_errors() -> tuple[type[BaseException], ...]:
    import redis

    return (redis.ConnectionError, redis.TimeoutError, OSError)


def run_supervised(
    client: redis.Redis,
    keys: Keys,
    spec: StepSpec,
    on_output: Callable[[bytes], None] | None = None,
    *,
    signals: SignalCatcher | None = None,
) -> SupervisedResult:
    """Run ``spec.argv`` under a new lease and block until the step and its tree have ended.

    ``on_output`` gets every output line of the child (stdout and stderr, bytes, with its
    line ending); None passes output through to this process's stdout/stderr as it comes.
    ``signals`` is an already installed :class:`SignalCatcher` (the CLI installs one
    first thing). Raises :class:`~worker.lease.LeaseRefused` if ``spec.lease_id`` exists and
    redis errors if Redis is unreachable before the child starts; after that, every end is
    a result (contract section 2's table).
    """
    own = None
    if signals is None and spec.install_signals:
        own = signals = SignalCatcher.install()
    try:
        return _Run(client, keys, spec, on_output, signals).run()
    finally:
        if own is not None:
            own.close()


class _Pipes:
    """The child's stdout and stderr: read as they come, split into lines, handed on.

    Passed-through output is written without ever blocking the loop: while our own
    stdout/stderr cannot take more, the child's pipe is not read (back-pressure), so a
    stuck reader stalls the child, never the supervision.
    """

    def __init__(
        self,
        sources: dict[int, int],
        on_output: Callable[[bytes], None] | None,
        describe: str,
    ) -> None:
        self.target = dict(sources)  # child pipe fd -> our fd (1 or 2); -1 once ours is gone
        self.lines = {fd: bytearray() for fd in sources}
        self.open = set(sources)
        self.pending: dict[int, bytearray] = {}  # our fd -> bytes it could not take yet
        self.on_output = on_output
        self.describe = describe
        self.poller: select.poll | None = None

    def attach(self, poller: select.poll) -> None:
        self.poller = poller
        for fd in self.open:
            poller.register(fd, _POLL_IN)

    def handles(self, fd: int) -> bool:
        return fd in self.open or fd in self.pending

    def event(self, fd: int, mask: int) -> bool:
        """Handle a poll event; True if a line (or a carriage-return update) completed."""
        if fd in self.pending:
            self._resume(fd, mask)
            return False
        data = self._read(fd)
        if data is None:
            return False
        self._take(fd, data, wait=0.0, pause=True)
        return b"\n" in data or b"\r" in data

    def drain(self, timeout: float) -> None:
        """Read until both pipes reach EOF or ``timeout`` passes; then flush partial lines."""
        end = time.monotonic() + timeout
        for target in list(self.pending):
            self._write(target, bytes(self.pending.pop(target)), max(0.0, end - time.monotonic()))
        poller = select.poll()
        for fd in self.open:
            poller.register(fd, _POLL_IN)
        while self.open:
            events = poller.poll(max(0, math.ceil((end - time.monotonic()) * 1000)))
            for fd, _ in events:
                data = self._read(fd, poller)
                if data:
                    self._take(fd, data, wait=max(0.0, end - time.monotonic()), pause=False)
            if not events or time.monotonic() >= end:
                break
        for buf in self.lines.values():
            if buf and self.on_output is not None:
                self._emit(bytes(buf))
            buf.clear()

    def _read(self, fd: int, poller: select.poll | None = None) -> bytes | None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return None
        except OSError:
            data = b""
        if not data:
            self.open.discard(fd)
            with contextlib.suppress(KeyError, ValueError):
                (poller or self.poller or select.poll()).unregister(fd)
            return None
        return data

    def _take(self, fd: int, data: bytes, wait: float, pause: bool) -> None:
        if self.on_output is None:
            target = self.target[fd]
            rest = self._write(target, data, wait) if target >= 0 else b""
            if rest and pause and self.poller is not None:
                # Our side is full: stop reading the child until it drains.
                self.pending[target] = bytearray(rest)
                self.poller.unregister(fd)
                self.poller.register(target, select.POLLOUT)
            return
        buf = self.lines[fd]
        buf += data
        while (cut := buf.find(b"\n")) >= 0:
            self._emit(bytes(buf[: cut + 1]))
            del buf[: cut + 1]
        if len(buf) >= LINE_MAX:
            self._emit(bytes(buf))
            buf.clear()

    def _resume(self, target: int, mask: int) -> None:
        assert self.poller is not None
        if mask & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
            self._gone(target)
            rest = b""
        else:
            rest = self._write(target, bytes(self.pending[target]), 0.0)
        if rest:
            self.pending[target] = bytearray(rest)
            return
        del self.pending[target]
        self.poller.unregister(target)
        for fd, t in self.target.items():
            if t == target and fd in self.open:
                self.poller.register(fd, _POLL_IN)

    def _write(self, target: int, data: bytes, wait: float) -> bytes:
        """Write what ``target`` takes within ``wait`` seconds; return the rest."""
        view = memoryview(data)
        end = time.monotonic() + wait
        check = select.poll()
        check.register(target, select.POLLOUT)
        while view:
            ready = check.poll(max(0, math.ceil((end - time.monotonic()) * 1000)))
            if not ready:
                return bytes(view)
            if ready[0][1] & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                self._gone(target)
                return b""
            try:
                # At most PIPE_BUF at a time: a pipe that polls writable takes that much.
                view = view[os.write(target, view[:4096]) :]
            except BlockingIOError:
                continue
            except OSError:
                self._gone(target)
                return b""
        return b""

    def _gone(self, target: int) -> None:
        # Our own output is gone (reader closed): keep supervising, drop what would go there.
        for fd, t in self.target.items():
            if t == target:
                self.target[fd] = -1

    def _emit(self, line: bytes) -> None:
        assert self.on_output is not None
        try:
            self.on_output(line)
        except Exception:
            log.exception("%s: on_output failed", self.describe)


class _Run:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        spec: StepSpec,
        on_output: Callable[[bytes], None] | None,
        signals: SignalCatcher | None,
    ) -> None:
        if not spec.argv:
            raise ValueError("argv is empty")
        if not (spec.gap > 0 and spec.deadline > 0 and spec.grace >= 0):
            raise ValueError("gap and deadline must be > 0 and grace >= 0")
        self.client = _private_client(client, spec.gap)
        self.keys = keys
        self.spec = spec
        self.on_output = on_output
        self.signals = signals
        self.leases = Leases(self.client, keys)
        self.errors = _redis_errors()
        self.host = procs.hostname()
        self.min_interval = min(0.25, spec.gap / 4)
        self.alive_interval = max(0.05, min(spec.gap / 4, 10.0))
        self.retry_interval = max(0.02, min(0.1, spec.gap / 10))
        self.proc: subprocess.Popen[bytes] | None = None
        self.pidfd = -1
        self.ticks: int | None = None
        self.pipes: _Pipes | None = None
        self.beat_pending = False
        self.last_beat = 0.0
        self.lapse_at = 0.0
        self.unreachable_since: float | None = None
        self.retry_at = 0.0
        self.doc: LeaseDoc
        self.lease_id = ""
        self.token = 0

    # --- the whole step ----------------------------------------------------------------

    def run(self) -> SupervisedResult:
        started = time.monotonic()
        spec = self.spec
        t0 = time.monotonic()
        self.doc = self.leases.acquire(
            budget_sec=spec.deadline,
            gap_sec=spec.gap,
            lease_id=spec.lease_id,
            supervisor_pid=os.getpid(),
            task_id=spec.task_id,
            note=spec.note,
        )
        self.lease_id, self.token = self.doc.lease_id, self.doc.token
        self.last_beat = t0
        self.lapse_at = t0 + min(spec.gap, spec.deadline)
        self._mirror(self.doc)
        log.info("lease=%s host=%s task=%s: acquired", self.lease_id, self.host, spec.task_id)
        with _subreaper():
            try:
                return self._finish(self._start_and_wait(), started)
            except BaseException as exc:
                # Whatever went wrong here, the tree must not outlive the step.
                self._abort(exc)
                raise

    def _start_and_wait(self) -> _Outcome:
        early = self._pending_signal()
        if early is not None:
            return self._signal_outcome(early)
        try:
            self._spawn()
        except OSError as exc:
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            log.warning("lease=%s host=%s: cannot start %r: %s", self.lease_id, self.host,
                        self.spec.argv[0], exc)  # fmt: skip
            return _Outcome("killed", f"worker-exit-{code}", code)
        self._attach()
        return self._loop()

    def _spawn(self) -> None:
        spec = self.spec
        env = dict(os.environ)
        env.update(spec.env or {})
        env.update(
            OVERNIGHT_LEASE_ID=self.lease_id,
            OVERNIGHT_LEASE_TOKEN=str(self.token),
            OVERNIGHT_REDIS_URL=spec.redis_url or url_of(self.client),
            OVERNIGHT_NAMESPACE=self.keys.namespace,
        )
        proc = subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=spec.cwd,
            env=env,
            start_new_session=True,
            bufsize=0,
        )
        self.proc = proc
        self.pidfd = os.pidfd_open(proc.pid)
        row = tree.read_proc(proc.pid)
        self.ticks = row.start if row is not None else None
        assert proc.stdout is not None and proc.stderr is not None
        sources = {proc.stdout.fileno(): 1, proc.stderr.fileno(): 2}
        for fd in sources:
            os.set_blocking(fd, False)
        self.pipes = _Pipes(sources, self.on_output, f"lease={self.lease_id} host={self.host}")

    def _attach(self) -> None:
        assert self.proc is not None
        pid = self.proc.pid
        self.doc.holder_pid, self.doc.pgid, self.doc.child_start_ticks = pid, pid, self.ticks
        try:
            self.leases.attach(self.lease_id, self.token, pid=pid, pgid=pid, start=self.ticks)
        except LeaseRefused as exc:
            log.warning("lease=%s host=%s: attach refused: %s", self.lease_id, self.host,
                        exc.reason)  # fmt: skip
        except self.errors:
            self._unreachable(time.monotonic())
        self._mirror(self.doc)

    # --- the loop -------------------------------------------------------------------------

    def _loop(self) -> _Outcome:
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        if self.signals is not None:
            poller.register(self.signals.read_fd, select.POLLIN)
        assert self.pipes is not None
        self.pipes.attach(poller)
        while True:
            now = time.monotonic()
            wait = max(0.0, self._next_wake() - now)
            events = poller.poll(math.ceil(wait * 1000))
            fds = {fd for fd, _ in events}
            if self.pidfd in fds:
                return self._child_exit()
            if self.signals is not None and self.signals.read_fd in fds:
                self.signals.drain()
                sig = self._pending_signal()
                if sig is not None:
                    return self._signal_outcome(sig)
            for fd, mask in events:
                if self.pipes.handles(fd) and self.pipes.event(fd, mask):
                    self.beat_pending = self.beat_pending or self.spec.output_beats
            outcome = self._tick(time.monotonic())
            if outcome is not None:
                return outcome

    def _next_wake(self) -> float:
        wake = self.lapse_at
        if self.beat_pending:
            wake = min(wake, self.last_beat + self.min_interval)
        if self.spec.beat_while_alive:
            wake = min(wake, self.last_beat + self.alive_interval)
        if self.unreachable_since is not None:
            wake = min(wake, self.retry_at, self.unreachable_since + self.spec.gap)
        return wake

    def _tick(self, now: float) -> _Outcome | None:
        if self.spec.beat_while_alive and now >= self.last_beat + self.alive_interval:
            self.beat_pending = True
        if self.unreachable_since is not None:
            if now - self.unreachable_since >= self.spec.gap:
                return self._lost(f"Redis unreachable for {now - self.unreachable_since:.1f}s")
            if now < self.retry_at:
                return None
            # Retry whatever is owed; a probe doubles as the reachability check.
            if self.beat_pending:
                return self._beat(now)
            return self._probe()
        if self.beat_pending and now >= self.last_beat + self.min_interval:
            outcome = self._beat(now)
            if outcome is not None or self.unreachable_since is not None:
                return outcome
        if time.monotonic() >= self.lapse_at:
            return self._probe()
        return None

    def _beat(self, now: float) -> _Outcome | None:
        t = time.monotonic()
        try:
            secs = self.leases.beat(self.lease_id, self.token)
        except LeaseRefused as exc:
            return self._refused(exc.reason)
        except self.errors:
            self._unreachable(t)
            return None
        self._reachable()
        self.beat_pending = False
        self.last_beat = t
        self.lapse_at = t + secs
        return None

    def _probe(self) -> _Outcome | None:
        t = time.monotonic()
        try:
            pttl, doc, server_now = self.leases.probe(self.lease_id)
        except LeaseCorrupt as exc:
            return self._lost(str(exc))
        except self.errors:
            self._unreachable(t)
            return None
        self._reachable()
        if doc is None or doc.token != self.token:
            return self._lost("the lease record is gone")
        if doc.status != "running":
            return self._ended_elsewhere(doc.status)
        if pttl >= 0:
            self.lapse_at = t + max(pttl, 1) / 1000
            return None
        if pttl == -1:  # no TTL: cannot happen through our scripts; look again in a gap
            self.lapse_at = t + self.spec.gap
            return None
        self.doc = doc
        reason = lapsed_reason(doc, server_now)
        status = status_for(reason)
        code = EXIT_REFUSED if status == "expired" else EXIT_HEARTBEAT_GAP
        log.warning("lease=%s host=%s: lapsed (%s); ending the tree", self.lease_id, self.host,
                    reason)  # fmt: skip
        return _Outcome(status, reason, code, receipt_kind="subprocess_lease_expired")

    def _refused(self, reason: str) -> _Outcome | None:
        if reason in ("lapsed", "deadline"):
            # The key is gone or about to be: the probe names the reason (or re-arms).
            return self._probe()
        if reason.startswith("not-running:"):
            return self._ended_elsewhere(reason.split(":", 1)[1])
        return self._lost(f"beat refused: {reason}")

    def _ended_elsewhere(self, status: str) -> _Outcome:
        log.warning("lease=%s host=%s: already ended (%s) by another writer; ending the tree",
                    self.lease_id, self.host, status)  # fmt: skip
        code = EXIT_REFUSED if status == "expired" else EXIT_HEARTBEAT_GAP
        return _Outcome("killed", f"ended-elsewhere:{status}", code, write=False)

    def _lost(self, why: str) -> _Outcome:
        log.error("lease=%s host=%s: lease lost (%s); killing the tree", self.lease_id,
                  self.host, why)  # fmt: skip
        return _Outcome("killed", "lease-lost", EXIT_LEASE_LOST, lost=True)

    def _unreachable(self, t: float) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = t
            log.warning("lease=%s host=%s: Redis unreachable; the child keeps running for "
                        "up to %.1fs", self.lease_id, self.host, self.spec.gap)  # fmt: skip
        self.retry_at = time.monotonic() + self.retry_interval

    def _reachable(self) -> None:
        if self.unreachable_since is not None:
            log.warning("lease=%s host=%s: Redis reachable again after %.2fs", self.lease_id,
                        self.host, time.monotonic() - self.unreachable_since)  # fmt: skip
            self.unreachable_since = None

    def _pending_signal(self) -> int | None:
        if self.signals is None or not self.signals.pending:
            return None
        return self.signals.pending[0]

    def _signal_outcome(self, sig: int) -> _Outcome:
        log.warning("lease=%s host=%s: got signal %d; ending the tree", self.lease_id,
                    self.host, sig)  # fmt: skip
        return _Outcome("killed", f"supervisor-signal-{sig}", 128 + sig, first_signal=sig)

    def _child_exit(self) -> _Outcome:
        assert self.proc is not None
        info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
        assert info is not None
        if info.si_code == os.CLD_EXITED:
            if info.si_status == 0:
                return _Outcome("done", "worker-complete", 0)
            return _Outcome("killed", f"worker-exit-{info.si_status}", info.si_status)
        return _Outcome("killed", f"worker-signal-{info.si_status}", 128 + info.si_status)

    # --- the end ----------------------------------------------------------------------------

    def _kill_tree(self, outcome: _Outcome) -> tree.KillReport | None:
        if self.proc is None:
            return None
        seen = len(self.signals.pending) if self.signals is not None else 0

        def hurry() -> bool:
            # A second signal while we wait out the grace means: kill now.
            if self.signals is None:
                return False
            self.signals.drain()
            return len(self.signals.pending) > seen

        target = tree.Tree(
            root=self.proc.pid,
            root_start=self.ticks,
            lease_id=self.lease_id,
            adopter=os.getpid(),
            group_safe=self.proc.returncode is None,  # unreaped: its pgid cannot be reused
            keep_unreaped={self.proc.pid},
        )
        wake = [self.signals.read_fd] if self.signals is not None else []
        report = tree.end_tree(
            target, self.spec.grace, first_signal=outcome.first_signal, hurry=hurry, wake_fds=wake
        )
        if report.signalled or report.killed:
            log.warning("lease=%s host=%s: ended %d process(es) of the tree in %.2fs",
                        self.lease_id, self.host, len(report.signalled | report.killed),
                        report.seconds)  # fmt: skip
        return report

    def _finish(self, outcome: _Outcome, started: float) -> SupervisedResult:
        if self.pipes is not None:
            self.pipes.drain(0.0)
        report = self._kill_tree(outcome)
        returncode = None
        if self.proc is not None:
            returncode = self.proc.wait()
            if self.pipes is not None:
                self.pipes.drain(0.5)
            self._close_child()
        ended_here, ended = False, None
        if outcome.write:
            ended_here, outcome, ended = self._write_end(outcome)
        doc = ended if ended is not None else self._final_doc(outcome)
        self._mirror(doc)
        log.info("lease=%s host=%s task=%s: ended %s/%s, exit %d", self.lease_id, self.host,
                 self.spec.task_id, doc.status, doc.note, outcome.exit_code)  # fmt: skip
        return SupervisedResult(
            exit_code=outcome.exit_code,
            doc=doc,
            reason=outcome.note,
            returncode=returncode,
            lease_lost=outcome.lost,
            ended_here=ended_here,
            seconds=time.monotonic() - started,
            kill=report,
        )

    def _write_end(self, outcome: _Outcome) -> tuple[bool, _Outcome, LeaseDoc | None]:
        """End the lease, retrying through a Redis outage no longer than the gap; with the
        ended document when this wrote the end."""
        now = time.monotonic()
        since = self.unreachable_since if self.unreachable_since is not None else now
        give_up = max(since + self.spec.gap, now + (max(self.spec.gap, 1.0) if outcome.lost else 0))
        while True:
            try:
                doc = self.leases.end(self.lease_id, self.token, outcome.status, outcome.note,
                                      exit_code=outcome.exit_code,
                                      receipt_kind=outcome.receipt_kind, fetch=True)  # fmt: skip
                return True, outcome, doc
            except LeaseRefused as exc:
                log.warning("lease=%s host=%s: end refused: %s", self.lease_id, self.host,
                            exc.reason)  # fmt: skip
                return False, outcome, None
            except LeaseCorrupt as exc:
                log.warning("lease=%s host=%s: ended, but the record reads back wrong: %s",
                            self.lease_id, self.host, exc)  # fmt: skip
                return True, outcome, None
            except self.errors:
                if time.monotonic() >= give_up:
                    break
                time.sleep(self.retry_interval)
        log.error("lease=%s host=%s: could not record the end (%s); lease lost",
                  self.lease_id, self.host, outcome.note)  # fmt: skip
        if outcome.lost:
            return False, outcome, None
        return False, _Outcome("killed", "lease-lost", EXIT_LEASE_LOST, lost=True), None

    def _final_doc(self, outcome: _Outcome) -> LeaseDoc:
        with contextlib.suppress(*self.errors, LeaseCorrupt):
            doc = self.leases.get(self.lease_id)
            if doc is not None and doc.token == self.token:
                return doc
        doc = self.doc
        if doc.status == "running":
            doc.status = outcome.status
            doc.note = outcome.note
            doc.exit_code = outcome.exit_code
            doc.ended_unix = time.time()
        return doc

    def _close_child(self) -> None:
        assert self.proc is not None
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if self.pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = -1

    def _abort(self, exc: BaseException) -> None:
        log.error("lease=%s host=%s: supervisor failed (%s: %s); ending the tree",
                  self.lease_id, self.host, type(exc).__name__, exc)  # fmt: skip
        with contextlib.suppress(Exception):
            outcome = _Outcome("killed", f"supervisor-error:{type(exc).__name__}", 1)
            self._kill_tree(outcome)
            if self.proc is not None:
                self.proc.wait()
                self._close_child()
            self.leases.end(self.lease_id, self.token, "killed", outcome.note, exit_code=1)

    def _mirror(self, doc: LeaseDoc) -> None:
        path = self.spec.lease_file
        if not path:
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as fh:
                json.dump(doc.public(), fh, indent=2)
                fh.write("\n")
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("lease=%s host=%s: cannot write %s: %s", self.lease_id, self.host,
                        path, exc)  # fmt: skip


__all__ = ["SignalCatcher", "StepSpec", "SupervisedResult", "run_supervised"]
