"""Running one step (an agent step or a verifier rule) and capturing what it printed.

The loop sees a step only through :data:`StepRunner`, so its logic is tested with plain
subprocesses; in a worker every step runs under a lease through ``worker.supervise.supervisor``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from overnight.coordinator.agents import Said
from overnight.coordinator.tasks.judge import CANNOT_START
from overnight.worker.gateway.grant import Grant
from overnight.worker.sandbox import launch, uidpool
from overnight.worker.sandbox.bwrap import Network
from overnight.worker.sandbox.limits import Limits
from overnight.worker.sandbox.nofollow import open_append
from overnight.worker.sandbox.stepenv import make_home, remove_home, step_environment
from overnight.worker.sandbox.stepuser import StepUser, configured
from overnight.worker.supervise.signals import SignalCatcher
from overnight.worker.supervise.supervisor import StepSpec, run_supervised

if TYPE_CHECKING:
    import redis

    from overnight.config.keys import Keys

log = logging.getLogger("overnight.steps")
TAIL_LINES = 40
TAIL_BYTES = 4000
# The most of one step's output its log file keeps; past it, one line says what was dropped.
LOG_CAP_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class StepRequest:
    """What to run for one step, and its lease limits."""

    task_id: str
    name: str
    argv: list[str]
    cwd: str
    env: dict[str, str]  # added to the step's allowlisted environment (worker.sandbox.stepenv)
    deadline: float
    gap: float
    grace: float
    beat_while_alive: bool = False
    stdin_data: bytes | None = field(default=None, repr=False)  # settings for the model step
    grant: Grant | None = None  # what the step may spend through the gateway
    log_path: Path | None = None  # where the step's whole output is kept (up to LOG_CAP_BYTES)
    lease_id: str | None = None  # chosen by the caller (the worktree lock names it); else new
    user: StepUser | None = None  # the task's own uid (from the pool); None: the runner's
    home_files: dict[str, str] | None = None  # written into the step's scratch HOME first
    # In a sandbox (OVERNIGHT_SANDBOX): the tree bound read-write (default: cwd) and the
    # paths it may read besides the system folders (the task's prompt folder).
    worktree: str | None = None
    readable: tuple[str, ...] = ()
    network: Network = "none"  # "host": the sandbox's network opt-out (the task's key)
    allow_hosts: tuple[str, ...] = ()  # reached through the step's proxy (the task's key)
    limits: Limits | None = None  # the step's limits (None: the settings')
    # Sees every output line too (an agent preset reading the CLI's structured output).
    on_line: Callable[[bytes], None] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class StepOutcome:
    """How a step ended: the contract's ``supervise`` exit code and the lease's verdict."""

    exit_code: int
    status: str
    note: str
    lease_id: str | None
    tail: str
    digest: str
    limit: float = 0.0  # the step's own deadline, in seconds
    survivors: int = 0  # processes of the step's tree still alive after its lease ended
    said: Said | None = None  # an agent preset's CLI's own account of the step
    started: bool = True  # False: the command never ran (not found, not executable)

    @property
    def passed(self) -> bool:
        return self.exit_code == 0


@dataclass
class OutputCapture:
    """A bounded tail and a running digest of a step's output lines."""

    max_lines: int = TAIL_LINES
    max_bytes: int = TAIL_BYTES
    log: IO[bytes] | None = None  # the whole output goes here too, up to log_cap bytes
    log_cap: int = LOG_CAP_BYTES
    also: Callable[[bytes], None] | None = None  # sees every line as well
    _lines: deque[bytes] = field(default_factory=deque)
    _hash: hashlib._Hash = field(default_factory=hashlib.sha256)
    _logged: int = 0
    _dropped: int = 0

    def __call__(self, line: bytes) -> None:
        whole = line if line.endswith(b"\n") else line + b"\n"
        if self.also is not None:
            self.also(line)
        self._hash.update(whole)
        self._lines.append(line.rstrip(b"\r\n")[: self.max_bytes])
        while len(self._lines) > self.max_lines:
            self._lines.popleft()
        if self.log is not None:
            if self._logged + len(whole) <= self.log_cap:
                self.log.write(whole)
                self._logged += len(whole)
            else:
                self._dropped += len(whole)

    def close(self) -> None:
        """Finish the log file (saying how much was dropped past its cap) and close it."""
        if self.log is None:
            return
        if self._dropped:
            cap = self.log_cap
            self.log.write(
                f"[overnight: output capped at {cap} bytes; "
                f"{self._dropped} more bytes dropped]\n".encode()
            )
        self.log.close()
        self.log = None

    def tail(self) -> str:
        text = b"\n".join(self._lines).decode("utf-8", "replace")
        return text[-self.max_bytes :]

    def digest(self, exit_code: int) -> str:
        h = self._hash.copy()
        h.update(f"\0exit={exit_code}".encode())
        return h.hexdigest()[:32]


StepRunner = Callable[[StepRequest], StepOutcome]


def open_capture(req: StepRequest) -> OutputCapture:
    """A capture for ``req``, writing its log file when the request names one (a log that
    cannot be opened costs the log, not the step)."""
    fh = None
    if req.log_path is not None:
        try:  # never through a link or into a folder a step could have planted
            fh = os.fdopen(open_append(req.log_path), "ab")
        except OSError:
            fh = None
    return OutputCapture(log=fh, also=req.on_line)


def start_problem(argv: list[str], cwd: str, path: str | None) -> str | None:
    """Why ``argv`` cannot be started in ``cwd`` with ``PATH`` = ``path`` (None: it can).
    A command with a slash is looked up from ``cwd``; a bare name on ``path``."""
    if not argv or not argv[0]:
        return "the agent command is empty"
    cmd = argv[0]
    if "/" in cmd:
        where = Path(cwd, cmd)
        if not where.exists():
            return f"agent command {cmd!r} does not exist"
        if where.is_dir() or not os.access(where, os.X_OK):
            return f"agent command {cmd!r} is not executable"
        return None
    if shutil.which(cmd, path=path if path is not None else os.defpath) is None:
        return f"agent command {cmd!r} was not found on PATH"
    return None


def trusted_socket(namespace: str) -> str | None:
    """The gateway's Unix socket for a sandbox to bind in, if overnight's own gateway answers
    there (None: the step reaches the TCP port through a relay that checks who holds it)."""
    from overnight.config.runtime import gateway_socket
    from overnight.worker.gateway.peer import socket_problem

    path = gateway_socket(namespace)
    return str(path) if socket_problem(path) is None else None


def supervised_runner(
    client: redis.Redis,
    keys: Keys,
    user: StepUser | None = None,
    stop_signals: tuple[int, ...] = (),
) -> StepRunner:
    """Run each step under a lease, in this process (``worker.supervise.supervisor``), as ``user``
    (default: the step user the settings name, :func:`worker.sandbox.stepuser.configured`; agent
    steps and verifier rules alike), unless the request names its task's own uid. A user
    that stands for a pool of uids runs a request naming none as a uid held for that step
    alone. Each of ``stop_signals`` (a work horse's SIGTERM: a stop asked for) ends a
    running step as SIGALRM does (:func:`alarm_ends_step`)."""
    as_user = user if user is not None else configured()
    sandboxed = launch.configured(as_user)

    def run(req: StepRequest) -> StepOutcome:
        with uidpool.held(req.user or as_user, req.task_id) as step_user:
            return run_as(req, step_user)

    def run_as(req: StepRequest, step_user: StepUser | None) -> StepOutcome:
        capture = open_capture(req)
        spec = StepSpec(
            argv=req.argv,
            deadline=req.deadline,
            gap=req.gap,
            grace=req.grace,
            lease_id=req.lease_id,
            cwd=req.cwd,
            env=req.env,
            output_beats=True,
            beat_while_alive=req.beat_while_alive,
            lease_file=None,
            task_id=req.task_id,
            stdin_data=req.stdin_data,
            grant=req.grant,
            user=step_user,
            home_files=req.home_files,
            sandbox=sandboxed,
            worktree=req.worktree,
            readable=req.readable,
            network=req.network,
            allow_hosts=req.allow_hosts,
            limits=req.limits,
            gateway_socket=trusted_socket(keys.namespace) if sandboxed and req.grant else None,
        )
        if sandboxed and req.network == "host":
            line = (
                f"overnight: task {req.task_id}: network = host: the step shares the host's network"
            )
            log.warning("%s", line)
            capture(line.encode())
        if not sandboxed and req.allow_hosts:
            line = f"overnight: task {req.task_id}: allow_hosts is not enforced without a sandbox"
            log.warning("%s", line)
            capture(line.encode())
        try:
            with alarm_ends_step(stop_signals) as alarm:
                result = run_supervised(client, keys, spec, on_output=capture, signals=alarm)
            started = result.returncode is not None
            if not started and result.exit_code in CANNOT_START:
                capture(cannot_start_line(req.argv[0], result.exit_code).encode())
        finally:
            capture.close()
        doc = result.doc
        return StepOutcome(
            exit_code=result.exit_code,
            status=str(doc.status),
            note=doc.note,
            lease_id=doc.lease_id,
            tail=capture.tail(),
            digest=capture.digest(result.exit_code),
            limit=req.deadline,
            survivors=len(result.kill.survivors) if result.kill is not None else 0,
            started=started,
        )

    return run


def cannot_start_line(command: str, code: int) -> str:
    """What a step's output says when its command never ran."""
    why = "not found" if code == 127 else "not executable (or not permitted)"
    return f"overnight: command {command!r} could not start: {why} (exit {code})"


@contextlib.contextmanager
def alarm_ends_step(also: tuple[int, ...] = ()) -> Iterator[SignalCatcher | None]:
    """While a step runs, a SIGALRM (RQ's job timeout in a work horse), and each signal of
    ``also`` (a stop asked of the work horse), ends it through its lease, tree and all, like a
    SIGTERM to ``overnight supervise``; the handler that was in place for each signal caught
    runs once the step is over (SIGALRM's last: RQ's raises its timeout exception).

    A signal without a Python handler in place is left alone; off the main thread, this does
    nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    wanted = {sig: signal.getsignal(sig) for sig in (*also, signal.SIGALRM)}
    previous = {sig: handler for sig, handler in wanted.items() if callable(handler)}
    if not previous:
        yield None
        return
    catcher = SignalCatcher()
    old_fd = signal.set_wakeup_fd(catcher.write_fd, warn_on_full_buffer=False)
    for sig in previous:
        signal.signal(sig, lambda signum, _frame: catcher.pending.append(signum))
    try:
        yield catcher
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(old_fd)
        catcher.close()
        for sig, handler in previous.items():
            if sig in catcher.pending:
                handler(sig, None)


def plain_runner(req: StepRequest) -> StepOutcome:
    """Run a step as a plain subprocess with only its deadline (no lease): for tests."""
    capture = open_capture(req)
    try:
        return _plain(req, capture)
    finally:
        capture.close()


def _plain(req: StepRequest, capture: OutputCapture) -> StepOutcome:
    limit = req.deadline
    env = step_environment(os.environ, req.env, lease_id=None, task_id=req.task_id)
    env.setdefault("HOME", os.environ.get("HOME", "/"))
    home = None
    if req.home_files:
        home = make_home(f"plain-{req.task_id}", None, req.home_files)
        env["HOME"], env["TMPDIR"] = home, os.path.join(home, "tmp")
    try:
        return _plain_run(req, capture, env, limit)
    finally:
        if home is not None:
            remove_home(home)


def _plain_run(
    req: StepRequest, capture: OutputCapture, env: dict[str, str], limit: float
) -> StepOutcome:
    try:
        proc = subprocess.run(
            req.argv,
            cwd=req.cwd,
            env=env,
            stdin=subprocess.DEVNULL if req.stdin_data is None else None,
            input=req.stdin_data,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=req.deadline,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        for line in (exc.output or b"").splitlines():
            capture(line)
        tail, digest = capture.tail(), capture.digest(2)
        return StepOutcome(2, "expired", "budget-exceeded", None, tail, digest, limit)
    except OSError as exc:
        capture(f"cannot start {req.argv[0]!r}: {exc.strerror or exc}".encode())
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        tail, digest = capture.tail(), capture.digest(code)
        note = f"worker-exit-{code}"
        return StepOutcome(code, "killed", note, None, tail, digest, limit, started=False)
    for line in proc.stdout.splitlines():
        capture(line)
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    status, note = ("done", "worker-complete") if code == 0 else ("killed", f"worker-exit-{code}")
    return StepOutcome(code, status, note, None, capture.tail(), capture.digest(code), limit)
