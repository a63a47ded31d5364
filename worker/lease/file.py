"""The ``--lease-file`` mirror: written by the supervisor, and read back for the child's beats.

The file sits where the child can write (that is its point: a worker that knows only
``lease.json`` beats by rewriting ``heartbeat_unix`` in it, and may set ``note``). What the
child writes there is read as a request, never as the lease: a changed ``heartbeat_unix``
is one beat, a changed ``note`` one note, and every other field (``status``,
``deadline_unix``, ``exit_code``…) is ignored; the supervisor alone ends the lease, and a
beat never moves its deadline. The file is read without following a link, only if it is a
regular file, and only its first :data:`MAX_BYTES`, so a FIFO, a link or a huge file costs
the child its beats and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from overnight.worker.lease.doc import LeaseDoc

MAX_BYTES = 64 * 1024
MAX_NOTE = 1024  # as the beat channel's


@dataclass(frozen=True)
class FileBeat:
    """What one rewrite of the lease file by the child asks for."""

    beat: bool
    note: str | None = None


def write(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` as indented JSON in one rename; the temporary file is
    created fresh (never through a link the child may have left in its place). Raises
    OSError."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)


def read(path: str) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None if it is not a regular file (a link, a FIFO),
    is too big, or does not hold one. Never blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_BYTES:
            return None
        raw = os.read(fd, MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _beat_value(doc: dict[str, Any]) -> float | None:
    value = doc.get("heartbeat_unix")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _note_value(doc: dict[str, Any]) -> str | None:
    value = doc.get("note")
    return value[:MAX_NOTE] if isinstance(value, str) else None


def asked(seen: dict[str, Any], now: dict[str, Any]) -> FileBeat | None:
    """What the file's content ``now`` asks for, against the content last ``seen`` there:
    a beat if ``heartbeat_unix`` changed (to a number), a note if ``note`` changed (to a
    string); None if neither did. Every other field is not read."""
    beat_now, note_now = _beat_value(now), _note_value(now)
    beat = beat_now is not None and beat_now != _beat_value(seen)
    note = note_now if note_now is not None and note_now != _note_value(seen) else None
    if not beat and note is None:
        return None
    return FileBeat(beat=beat, note=note)


class LeaseFileWatch:
    """Polls the lease file's identity (inode, size, mtime) every ``interval`` seconds, and
    reads it only when that changed: one ``stat`` a poll."""

    def __init__(self, path: str, interval: float, seen: dict[str, Any], now: float) -> None:
        self.path = path
        self.interval = interval
        self.seen = seen
        self.next_check = now + interval
        self._identity: tuple[int, int, int] | None = None

    def wrote(self, doc: dict[str, Any]) -> None:
        """The supervisor wrote ``doc``: what the child changes is measured from it."""
        self.seen = doc

    def poll(self, now: float) -> FileBeat | None:
        """If a check is due at ``now``: what the child's rewrite, if any, asks for."""
        if now < self.next_check:
            return None
        self.next_check = now + self.interval
        try:
            info = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return None
        identity = (info.st_ino, info.st_size, info.st_mtime_ns)
        if identity == self._identity:
            return None
        self._identity = identity
        doc = read(self.path)
        if doc is None:
            return None
        found = asked(self.seen, doc)
        self.seen = doc
        return found


def mirror(path: str | None, doc: LeaseDoc, watch: LeaseFileWatch | None, *, host: str) -> None:
    """Write ``doc`` to the lease file at ``path`` (nothing without one) and tell ``watch``
    what was written, so the supervisor's own write is not read back as the child's beat; a
    file that cannot be written is logged, never fatal."""
    if not path:
        return
    public = doc.public()
    try:
        write(path, public)
        if watch is not None:
            watch.wrote(public)
    except OSError as exc:
        logging.getLogger("overnight.supervisor").warning(
            "lease=%s host=%s: cannot write %s: %s", doc.lease_id, host, path, exc
        )
