"""A night that can be read afterwards: ``up`` (and the demo) leave ``night.json`` in their
state folder, beside the embedded Redis's data; ``status``, ``logs``, ``diff``, ``receipts``
and ``report`` run in that folder with no Redis configured read the latest night there, by
starting a private redis-server on its data again (or, while ``up`` still runs, through the
address it left for its own user), and say in one line which night and Redis they read.

:func:`latest` is the rule (which record is the latest night); :func:`open_night` does the
I/O around it for one command.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from pydantic import BaseModel, ValidationError

from overnight.config.exits import EXIT_USAGE, CommandError

NIGHT_FILE = "night.json"
# The running night's Redis address, password included: mode 0600, removed when ``up`` ends.
LIVE_URL = "live-url"
LOCK_FILE = "up.lock"


class NightRecord(BaseModel):
    """What ``night.json`` says: the night's namespace, when it started, where its Redis
    keeps its data."""

    namespace: str
    started: float
    redis_dir: str


@dataclass(frozen=True)
class Found:
    """A night on disk: the state folder holding its ``night.json``, and the record."""

    state_dir: Path
    record: NightRecord


def record_night(state_dir: Path, namespace: str, redis_dir: Path, url: str) -> None:
    """Leave the record of a night that starts now on an embedded Redis at ``url`` (its
    address for readers while it runs, readable by this user alone)."""
    rec = NightRecord(namespace=namespace, started=time.time(), redis_dir=str(redis_dir.resolve()))
    _write(state_dir / NIGHT_FILE, rec.model_dump_json() + "\n", 0o644)
    _write(state_dir / LIVE_URL, url + "\n", 0o600)


def night_over(state_dir: Path) -> None:
    """The night's Redis is stopped: its address is no use any more."""
    with contextlib.suppress(FileNotFoundError):
        (state_dir / LIVE_URL).unlink()


def _write(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def candidates(root: Path) -> list[Path]:
    """The state folders under ``root`` a night may have left its record in: ``root`` (an
    ``up`` there), ``root/state`` (one demo night's folder) and every demo night's."""
    demo = sorted(p / "state" for p in (root / "demo").glob("*") if p.is_dir())
    return [root, root / "state", *demo]


def latest(found: list[Found]) -> Found | None:
    """The night that started last (the later folder on a tie), or None."""
    if not found:
        return None
    return max(found, key=lambda f: (f.record.started, str(f.state_dir)))


def read_nights(root: Path) -> list[Found]:
    out = []
    for folder in candidates(root):
        try:
            text = (folder / NIGHT_FILE).read_text(encoding="utf-8")
            out.append(Found(folder, NightRecord.model_validate_json(text)))
        except (OSError, ValidationError):
            continue
    return out


@dataclass
class Opened:
    """The Redis a reading command uses for a night, and the line that says so."""

    url: str
    namespace: str
    line: str


_held: list[object] = []  # the lock and server of the night this process reads, kept open


def open_night(found: Found) -> Opened:
    """Reach ``found``'s Redis: the running one (its ``up`` holds the lock), or a private
    redis-server started on its data for this process (stopped when it exits; the lock is
    held meanwhile, so no ``up`` starts on the same data)."""
    from overnight.config.validate import mask_url
    from overnight.coordinator.night.embedded_redis import EmbeddedRedis

    state, rec = found.state_dir, found.record
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(rec.started))
    try:
        fh = open(state / LOCK_FILE, "a+")  # noqa: SIM115 - held while this process reads
    except OSError as exc:
        raise CommandError(_unreadable(state, exc.strerror or str(exc)), EXIT_USAGE) from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        try:
            url = (state / LIVE_URL).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise CommandError(
                f"the night in {state} is running but its Redis address cannot be read "
                f"({exc.strerror}); run this as the user who started it",
                EXIT_USAGE,
            ) from None
        line = f"the night started {when} in {state} (running), Redis {mask_url(url)}"
        return Opened(url, rec.namespace, line)
    server = EmbeddedRedis(Path(rec.redis_dir), appendonly=True, password=secrets.token_hex(24))
    try:
        server.start()
    except (OSError, RuntimeError) as exc:
        fh.close()
        raise CommandError(_unreadable(state, str(exc)), EXIT_USAGE) from None
    _held.extend([fh, server])
    atexit.register(server.stop)
    line = (
        f"the night started {when} in {state}, Redis {mask_url(server.url)} (a private "
        f"redis-server on its data in {rec.redis_dir})"
    )
    return Opened(server.url, rec.namespace, line)


def _unreadable(state: Path, why: str) -> str:
    return f"cannot read the night in {state}: {why}; run this as the user who ran it"


def use_night(root: Path, explicit: bool, err: TextIO = sys.stderr) -> None:
    """Point this process's settings at the night a reading command should read: with no
    Redis configured (or with ``--state-dir`` given), the latest night under ``root``; says
    in one line to ``err`` which night and Redis it reads, or that it reads the default."""
    from overnight.config import context
    from overnight.config.connection import describe
    from overnight.config.settings import load_settings

    settings = load_settings()
    configured = "redis_url" in settings.model_fields_set
    if configured and not explicit:
        return
    if root.is_dir() and not os.access(root, os.R_OK | os.X_OK):
        raise CommandError(_unreadable(root, "permission denied"), EXIT_USAGE)
    found = latest(read_nights(root))
    if found is None:
        if explicit:
            raise CommandError(f"--state-dir {root}: no night recorded there", EXIT_USAGE)
        print(
            f"overnight: no night recorded in {root} and OVERNIGHT_REDIS_URL is unset: "
            f"reading the default, {describe(settings)}",
            file=err,
        )
        return
    opened = open_night(found)
    os.environ["OVERNIGHT_REDIS_URL"] = opened.url
    if "namespace" not in settings.model_fields_set:
        os.environ["OVERNIGHT_NAMESPACE"] = opened.namespace
    for cached in (context.settings, context.redis_client, context.rq_connection):
        cached.cache_clear()
    print(
        f"overnight: reading {opened.line}, namespace {context.settings().namespace!r}",
        file=err,
    )
