"""Running one step (an agent step or a verifier rule) and capturing what it printed.

The loop sees a step only through :data:`StepRunner`, so its logic is tested with plain
subprocesses; in a worker every step runs under a lease through ``worker.supervisor``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from overnight.worker.signals import SignalCatcher
from overnight.worker.stepenv import step_environment
from overnight.worker.stepuser import StepUser, configured
from overnight.worker.supervisor import StepSpec, run_supervised

if TYPE_CHECKING:
    import redis

    from overnight.config.keys import Keys

TAIL_LINES = 40
TAIL_BYTES = 4000


@dataclass(frozen=True)
class StepRequest:
    """What to run for one step, and its lease limits."""

    task_id: str
    name: str
    argv: list[str]
    cwd: str
    env: dict[str, str]  # added to the step's allowlisted environment (worker.stepenv)
    deadline: float
    gap: float
    grace: float
    beat_while_alive: bool = False
    stdin_data: bytes | None = field(default=None, repr=False)  # settings for the model step
    as_step_user: bool = True  # False for a verifier rule: it runs as overnight's own user


@dataclass(frozen=True)
class StepOutcome:
    """How a step ended: the contract's ``supervise`` exit code and the lease's verdict."""

    exit_code: int
    status: str
    note: str
    lease_id: str | None
    tail: str
    digest: str

    @property
    def passed(self) -> bool:
        return self.exit_code == 0


@dataclass
class OutputCapture:
    """A bounded tail and a running digest of a step's output lines."""

    max_lines: int = TAIL_LINES
    max_bytes: int = TAIL_BYTES
    _lines: deque[bytes] = field(default_factory=deque)
    _hash: hashlib._Hash = field(default_factory=hashlib.sha256)

    def __call__(self, line: bytes) -> None:
        self._hash.update(line if line.endswith(b"\n") else line + b"\n")
        self._lines.append(line.rstrip(b"\r\n")[: self.max_bytes])
        while len(self._lines) > self.max_lines:
            self._lines.popleft()

    def tail(self) -> str:
        text = b"\n".join(self._lines).decode("utf-8", "replace")
        return text[-self.max_bytes :]

    def digest(self, exit_code: int) -> str:
        h = self._hash.copy()
        h.update(f"\0exit={exit_code}".encode())
        return h.hexdigest()[:32]


StepRunner = Callable[[StepRequest], StepOutcome]


def supervised_runner(client: redis.Redis, keys: Keys, user: StepUser | None = None) -> StepRunner:
    """Run each step under a lease, in this process (``worker.supervisor``), as ``user``
    (default: the step user the settings name, :func:`worker.stepuser.configured`; agent
    steps and verifier rules alike)."""
    as_user = user if user is not None else configured()

    def run(req: StepRequest) -> StepOutcome:
        capture = OutputCapture()
        spec = StepSpec(
            argv=req.argv,
            deadline=req.deadline,
            gap=req.gap,
            grace=req.grace,
            lease_id=None,
            cwd=req.cwd,
            env=req.env,
            output_beats=True,
            beat_while_alive=req.beat_while_alive,
            lease_file=None,
            task_id=req.task_id,
            stdin_data=req.stdin_data,
            user=as_user if req.as_step_user else None,
        )
        with alarm_ends_step() as alarm:
            result = run_supervised(client, keys, spec, on_output=capture, signals=alarm)
        doc = result.doc
        return StepOutcome(
            exit_code=result.exit_code,
            status=str(doc.status),
            note=doc.note,
            lease_id=doc.lease_id,
            tail=capture.tail(),
            digest=capture.digest(result.exit_code),
        )

    return run


@contextlib.contextmanager
def alarm_ends_step() -> Iterator[SignalCatcher | None]:
    """While a step runs, a SIGALRM (RQ's job timeout in a work horse) ends it through its
    lease, tree and all, like a SIGTERM to ``overnight supervise``; the handler that was in
    place (RQ's, which raises its timeout exception) runs once the step is over.

    Without a Python SIGALRM handler in place, or off the main thread, this does nothing.
    """
    previous = signal.getsignal(signal.SIGALRM)
    if not callable(previous) or threading.current_thread() is not threading.main_thread():
        yield None
        return
    catcher = SignalCatcher()
    old_fd = signal.set_wakeup_fd(catcher.write_fd, warn_on_full_buffer=False)
    signal.signal(signal.SIGALRM, lambda signum, _frame: catcher.pending.append(signum))
    try:
        yield catcher
    finally:
        signal.signal(signal.SIGALRM, previous)
        signal.set_wakeup_fd(old_fd)
        catcher.close()
        if signal.SIGALRM in catcher.pending:
            previous(signal.SIGALRM, None)


def plain_runner(req: StepRequest) -> StepOutcome:
    """Run a step as a plain subprocess with only its deadline (no lease): for tests."""
    capture = OutputCapture()
    env = step_environment(os.environ, req.env, lease_id=None, task_id=req.task_id)
    env.setdefault("HOME", os.environ.get("HOME", "/"))
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
        return StepOutcome(2, "expired", "budget-exceeded", None, capture.tail(), capture.digest(2))
    except OSError as exc:
        capture(f"cannot start {req.argv[0]!r}: {exc.strerror or exc}".encode())
        return StepOutcome(
            127, "killed", "worker-exit-127", None, capture.tail(), capture.digest(127)
        )
    for line in proc.stdout.splitlines():
        capture(line)
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    status, note = ("done", "worker-complete") if code == 0 else ("killed", f"worker-exit-{code}")
    return StepOutcome(code, status, note, None, capture.tail(), capture.digest(code))
