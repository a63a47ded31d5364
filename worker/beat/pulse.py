"""Beats from inside a supervised step: ``beat()`` and the :func:`pulse` context manager.

Both reach the step's own supervisor through its beat channel
(:mod:`worker.beat.channel`: ``OVERNIGHT_LEASE_ID`` and ``OVERNIGHT_BEAT_SOCKET`` in the
environment), never Redis, so any descendant of the child can use them and no credential is
involved. The supervisor accepts a beat only from its own tree, only while the lease runs.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping

from overnight.worker.beat.channel import ChannelDown, NoChannel, channel_from_env, send_beat
from overnight.worker.lease.store import LeaseRefused

log = logging.getLogger("overnight.pulse")

NoLease = NoChannel  # the public name (``from overnight import NoLease``)


def beat(note: str | None = None, *, environ: Mapping[str, str] | None = None) -> float:
    """Beat the current lease (and set its note); returns the seconds a step that stays
    silent from now still has.

    Raises :class:`NoLease` outside a lease, :class:`~worker.lease.store.LeaseRefused` if the
    supervisor refuses (the lease is over, or this process is not of its tree), and
    :class:`~worker.beat.channel.ChannelDown` if the supervisor does not answer.
    """
    return send_beat(note, environ=environ)


class Pulse:
    """A background thread that beats the current lease every ``interval`` seconds.

    Once a beat is refused the lease is over for good: the thread stops and keeps the
    refusal in :attr:`refused`. A supervisor slow to answer is retried at the next tick.
    """

    def __init__(
        self, interval: float, note: str | None = None, environ: Mapping[str, str] | None = None
    ) -> None:
        self.lease_id, _path = channel_from_env(environ)
        self.environ = environ
        self.interval = interval
        self.note = note
        self.beats = 0
        self.refused: LeaseRefused | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"overnight-pulse-{self.lease_id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop beating; returns once the thread is gone (at most one beat later)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def alive(self) -> bool:
        """True while the thread still beats."""
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                send_beat(self.note, environ=self.environ, timeout=max(1.0, self.interval))
                self.beats += 1
            except LeaseRefused as exc:
                self.refused = exc
                log.warning("lease=%s: pulse stopped: %s", self.lease_id, exc.reason)
                return
            except (ChannelDown, OSError) as exc:  # a busy supervisor: the next tick tries again
                log.warning("lease=%s: pulse beat failed: %s", self.lease_id, exc)


@contextlib.contextmanager
def pulse(
    interval: float | None = None,
    note: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> Iterator[Pulse]:
    """Beat the current lease from a thread for the duration of the block.

    The first beat is made before the block starts (so a dead lease raises
    :class:`~worker.lease.store.LeaseRefused` at once). ``interval`` defaults to a third of what
    that beat says a silent step has left (the gap), so one lost beat never lapses it. Use
    it only around work that is known to progress: a pulse keeps a lease alive even if the
    block hangs.
    """
    left = beat(note, environ=environ)
    if interval is None:
        interval = max(0.05, left / 3)
    p = Pulse(interval, note, environ)
    p.start()
    try:
        yield p
    finally:
        p.stop()
