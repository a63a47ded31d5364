"""The gateway a plain ``overnight worker`` starts for its host, kept running.

``overnight up`` restarts its members itself; a worker on its own has nobody else, so it
watches the gateway it started and starts it again when it exits, after a backoff that grows
while it keeps dying young. Requests in flight when it died fail (their steps fail closed); the
next request finds the new one on the same port, and the tokens it checks live in Redis.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from overnight.config.spawn import overnight_argv
from overnight.worker.supervise import procs

if TYPE_CHECKING:
    from overnight.config.settings import Settings

log = logging.getLogger("overnight.worker")

FIRST_DELAY = 0.5
MAX_DELAY = 30.0
# A gateway that stayed up this long was healthy: its next restart waits FIRST_DELAY again.
STEADY = 60.0
POLL = 0.25


def restart_delay(quick_exits: int) -> float:
    """Seconds to wait before starting the gateway again after ``quick_exits`` exits in a row
    that each came within ``STEADY`` seconds of its start (this one included)."""
    return min(MAX_DELAY, FIRST_DELAY * 2.0 ** min(max(0, quick_exits - 1), 16))


def spawn_gateway() -> subprocess.Popen[bytes]:
    """``overnight gateway`` as a child that gets SIGTERM when the thread that started it
    exits (the kernel ties the death signal to the thread): the worker's main thread, or the
    watcher, which lives until the worker stops the gateway itself."""
    return subprocess.Popen(
        overnight_argv("gateway"),
        stdin=subprocess.DEVNULL,
        preexec_fn=lambda: procs.set_pdeathsig(signal.SIGTERM),
    )


class GatewayWatch:
    """One gateway child, started again whenever it exits until :meth:`stop`."""

    def __init__(
        self,
        where: str,
        answers: Callable[[float], bool],
        spawn: Callable[[], subprocess.Popen[bytes]] = spawn_gateway,
        poll: float = POLL,
    ) -> None:
        self.where = where  # host:port, for the log lines
        self.answers = answers
        self.spawn = spawn
        self.poll = poll
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._started = 0.0
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def start_for(cls, cfg: Settings) -> GatewayWatch | None:
        """Start and watch this host's gateway; None when no upstream is configured or a
        gateway already answers on its port (one per host: another worker's, or ``up``'s,
        which its starter watches)."""
        from overnight.coordinator.dispatch.gateway_probe import gateway_answers, gateway_wanted

        if not gateway_wanted(cfg) or gateway_answers(cfg):
            return None
        watch = cls(
            f"{procs.hostname()} ({cfg.gateway_host}:{cfg.gateway_port})",
            lambda wait: gateway_answers(cfg, wait=wait),
        )
        watch.start()
        return watch

    def start(self) -> None:
        self._launch()
        self.answers(10.0)  # the first step's first request finds it up
        self._thread = threading.Thread(target=self._watch, name="gateway-watch", daemon=True)
        self._thread.start()

    def stop(self, wait: float = 30.0) -> None:
        """Stop watching, then end the gateway (SIGTERM, SIGKILL after ``wait``)."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join(wait)
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _launch(self) -> None:
        self.proc = self.spawn()
        self._started = time.monotonic()

    def _watch(self) -> None:
        quick = 0
        while not self._halt.wait(self.poll):
            proc = self.proc
            code = None if proc is None else proc.poll()
            if code is None:
                continue
            quick = quick + 1 if time.monotonic() - self._started < STEADY else 1
            delay = restart_delay(quick)
            if self._halt.wait(delay) or not self._restart(code, delay):
                return

    def _restart(self, code: int, delay: float) -> bool:
        """Start the gateway that exited with ``code`` again; False: stop watching."""
        said = f"gateway on {self.where} exited (code {code})"
        if self.answers(0.0):
            log.warning("%s; another gateway answers on its port, so it is not restarted", said)
            self.proc = None
            return False
        try:
            self._launch()
        except OSError as exc:  # retried after the next backoff: the dead proc is still ours
            log.warning("%s; starting it again failed: %s", said, exc)
            self._started = time.monotonic()
            return True
        self.restarts += 1
        assert self.proc is not None
        log.warning(
            "%s; restarted as pid %d after %.1fs (restart %d)",
            said,
            self.proc.pid,
            delay,
            self.restarts,
        )
        return True
