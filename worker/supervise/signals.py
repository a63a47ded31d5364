"""Signals to a supervisor: SIGTERM/SIGINT/SIGHUP end the step, and wake its poll loop.

:mod:`worker.supervise.early_signals` keeps the ones that arrive while ``overnight supervise`` is
still importing; :meth:`SignalCatcher.install` takes them over, so none is lost.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

from overnight.worker.supervise import early_signals

FORWARDED = early_signals.SIGNALS


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
