"""The supervised child's output: read as it comes, split into lines, handed on or passed
through, without ever letting a slow reader of our own output stall the supervision."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import time
from collections.abc import Callable

log = logging.getLogger("overnight.supervisor")

LINE_MAX = 65536  # a longer run of bytes without a newline is handed on as one line
POLL_IN = select.POLLIN | select.POLLHUP | select.POLLERR


class Pipes:
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
            poller.register(fd, POLL_IN)

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
            poller.register(fd, POLL_IN)
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
                self.poller.register(fd, POLL_IN)

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
