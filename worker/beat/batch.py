"""Host beats: the renewals of every lease on a host, one Redis round trip per beat period.

Each supervisor (one per work horse) keeps its own lease, but a renewal it owes no longer
costs it a round trip of its own. It writes a request (its lease, token, renew interval,
last renewal and when it saw progress) into the host's batch folder, and renews at a grid
point of its renew interval on the host's monotonic clock, ``k * interval``, which every
process on the host shares. The first supervisor to get there takes the folder's lock and
renews every request due at that moment in one script call (``lease_beat_many.lua``: each
lease's token, status, deadline and liveness key checked on its own, a reply for each), and
writes each lease's result beside its request; the others find their result already there.
A supervisor that finds neither its result nor the lock in time beats on its own, as before.

What stays per lease: only a lease with progress since its last renewal is renewed (a
request is progress seen); it lapses at min(renewal + gap, deadline) as before; the gap is
still judged on the supervisor's own clock. A renewal waits for the next grid point, at most
one renew interval after the progress, as it waited for ``last renewal + interval`` before.

The folder is the supervisor user's own (0700, beside the lease proofs), one per namespace,
host id and Redis server. A step run as the step user cannot reach it; one run as the
supervisor's own user could ask for renewals of its own lease, which moves its Redis lapse
but never the supervisor's own gap and deadline (the same holds for the lease proofs).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from overnight.config.runtime import runtime_root
from overnight.worker.lease.proof import private_dir
from overnight.worker.supervise import procs

if TYPE_CHECKING:
    from overnight.worker.lease.store import Leases

log = logging.getLogger("overnight.supervisor")

EARLY = 0.001  # a lease due this much after the batch's moment is renewed in it (float dust)
STALE = 3600.0  # requests and results older than this are dropped by the next batch


# --- which leases are due in a batch (pure) --------------------------------------------------


@dataclass(frozen=True)
class Request:
    """A lease that owes a renewal: seen progress at ``seen``, last renewed at ``renewed``
    (the host's monotonic clock), renewed at the grid points of ``period``."""

    lease_id: str
    token: int
    period: float
    renewed: float
    seen: float


def next_point(t: float, period: float) -> float:
    """The first grid point of ``period`` strictly after ``t``."""
    return (math.floor(t / period) + 1) * period


def due_at(req: Request) -> float:
    """When ``req`` is renewed: the grid point after its last renewal, or the first one at or
    after its progress if that came later (a renewal never runs ahead of its interval)."""
    return max(next_point(req.renewed, req.period), math.ceil(req.seen / req.period) * req.period)


def due(requests: Iterable[Request], now: float) -> list[Request]:
    """The requests a batch at ``now`` renews: progress since the last renewal, and due."""
    return [r for r in requests if r.seen > r.renewed and due_at(r) <= now + EARLY]


# --- the host's batch folder ----------------------------------------------------------------


@dataclass(frozen=True)
class Renewal:
    """What a batch did for one lease at ``at`` (the host's monotonic clock, taken before the
    call): renewed with ``secs`` until it lapses, or refused for ``reason``."""

    at: float
    secs: float = 0.0
    reason: str = ""


def folder_for(leases: Leases) -> Path | None:
    """The batch folder of this namespace, host id and Redis server; None for a client that
    is not a real Redis connection (fakeredis: one per process, nothing to share)."""
    client = leases.client
    if not type(client).__module__.startswith("redis."):
        return None
    kw = client.connection_pool.connection_kwargs
    server = "|".join(str(kw.get(k, "")) for k in ("host", "port", "path", "db", "username"))
    digest = hashlib.sha1(f"{procs.hostname()}\0{server}".encode()).hexdigest()[:16]
    ns = quote(leases.keys.namespace, safe="")
    return runtime_root() / f"ns-{ns}" / f"beats-{digest}"


class HostBatch:
    """One supervisor's view of its host's batch folder (see the module docstring)."""

    def __init__(
        self, leases: Leases, folder: Path, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.leases = leases
        self.folder = folder
        self.clock = clock
        self.made = False  # the folder, made at the first request (most steps never renew)

    @classmethod
    def for_host(cls, leases: Leases) -> HostBatch | None:
        """The host's batch for ``leases``, or None where there is none to share."""
        folder = folder_for(leases)
        return None if folder is None else cls(leases, folder)

    def _path(self, kind: str, lease_id: str) -> Path:
        return self.folder / f"{kind}-{quote(lease_id, safe='')}"

    def request(self, req: Request) -> None:
        """Ask for a renewal of ``req``'s lease at its grid point."""
        if not self.made:
            private_dir(self.folder)
            self.made = True
        _write(self._path("req", req.lease_id), asdict(req))

    def result(self, req: Request) -> Renewal | None:
        """The renewal a batch made for ``req`` since its progress, if one did."""
        data = _read(self._path("res", req.lease_id))
        if data is None:
            return None
        try:
            got = Renewal(float(data["at"]), float(data["secs"]), str(data["reason"]))  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError):
            return None
        return got if got.at >= req.seen else None

    def collect(self, req: Request, wait: float) -> Renewal | None:
        """At ``req``'s grid point: its renewal, from the batch another supervisor made or
        from one made here (holding the lock); None if the lock stayed taken for ``wait``
        seconds (the caller renews on its own). Redis errors of a batch made here propagate.
        """
        got = self.result(req)
        if got is not None:
            return got
        try:
            fd = os.open(self.folder / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError:
            return None
        try:
            if not _lock(fd, self.clock() + wait, self.clock):
                return None
            got = self.result(req)
            if got is not None:
                return got
            return self.flush(req)
        finally:
            os.close(fd)  # releases the lock

    def flush(self, own: Request) -> Renewal:
        """Renew every due request of the folder and ``own`` in one call; write each result.
        Call with the lock held."""
        now = self.clock()
        requests = {own.lease_id: own}
        for path in self.folder.glob("req-*"):
            req = _request(_read(path))
            if req is None or req.seen < now - STALE:
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            requests.setdefault(req.lease_id, req)
        _drop_old(self.folder.glob("res-*"))  # of supervisors killed before they forgot
        batch = due(requests.values(), now)
        if own not in batch:
            batch.append(own)
        for req in batch:
            with contextlib.suppress(OSError):
                self._path("req", req.lease_id).unlink()
        at = self.clock()  # after the unlinks: a request written since is newer than this
        results = self.leases.beat_many([(r.lease_id, r.token) for r in batch])
        mine = Renewal(at, reason="unknown")
        for req, res in zip(batch, results, strict=True):
            got = Renewal(at, secs=res) if isinstance(res, float) else Renewal(at, reason=res)
            if req.lease_id == own.lease_id:
                mine = got
            with contextlib.suppress(OSError):
                _write(self._path("res", req.lease_id), asdict(got))
        return mine

    def forget(self, lease_id: str) -> None:
        """Drop the lease's request and result (its supervisor is done with it)."""
        for kind in ("req", "res"):
            with contextlib.suppress(OSError):
                self._path(kind, lease_id).unlink()


class Seat:
    """One lease's place in its host's batch: at most one request at a time."""

    def __init__(self, batch: HostBatch, lease_id: str, token: int, period: float) -> None:
        self.batch = batch
        self.lease_id, self.token, self.period = lease_id, token, period
        self.requested: Request | None = None

    @classmethod
    def for_host(cls, leases: Leases, lease_id: str, token: int, period: float) -> Seat | None:
        """A seat in the host's batch for ``leases``, or None where there is none to share."""
        batch = HostBatch.for_host(leases)
        return None if batch is None else cls(batch, lease_id, token, period)

    def due(self, renewed: float, now: float) -> float:
        """When the renewal owed (or asked for) now is made."""
        return due_at(self.requested or self._request(renewed, now))

    def _request(self, renewed: float, now: float) -> Request:
        return Request(self.lease_id, self.token, self.period, renewed, now)

    def ask(self, renewed: float, now: float) -> bool:
        """Ask for a renewal of progress seen by ``now`` (once until it is taken); False if
        the folder is unusable (the caller renews alone from then on)."""
        if self.requested is None:
            req = self._request(renewed, now)
            try:
                self.batch.request(req)
            except OSError as exc:
                log.warning("lease=%s: no host batch: %s", self.lease_id, exc)
                return False
            self.requested = req
        return True

    def take(self, wait: float, *, alone: bool = False) -> Renewal | None:
        """The renewal asked for, at its grid point (:meth:`HostBatch.collect`); None when
        there is none to take, or ``alone`` (Redis was unreachable: the caller renews on its
        own until it answers), or no batch answered in time."""
        req, self.requested = self.requested, None
        got = None if req is None or alone else self.batch.collect(req, wait)
        if got is None:
            self.batch.forget(self.lease_id)
        return got


def _lock(fd: int, until: float, clock: Callable[[], float]) -> bool:
    # Polled rather than blocking, so a stopped or stuck holder costs a bounded wait.
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if clock() >= until:
                return False
            time.sleep(0.001)


def _drop_old(paths: Iterable[Path]) -> None:
    old = time.time() - STALE
    for path in paths:
        with contextlib.suppress(OSError):
            if path.lstat().st_mtime < old:
                path.unlink()


def _write(path: Path, data: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def _read(path: Path) -> dict[str, object] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as fh:
        try:
            data = json.load(fh)
        except ValueError:
            return None
    return data if isinstance(data, dict) else None


def _request(data: dict[str, object] | None) -> Request | None:
    if data is None:
        return None
    try:
        req = Request(
            lease_id=str(data["lease_id"]),
            token=int(data["token"]),  # type: ignore[call-overload]
            period=float(data["period"]),  # type: ignore[arg-type]
            renewed=float(data["renewed"]),  # type: ignore[arg-type]
            seen=float(data["seen"]),  # type: ignore[arg-type]
        )
    except (KeyError, TypeError, ValueError):
        return None
    if not (req.period > 0 and math.isfinite(req.period + req.renewed + req.seen)):
        return None
    return req
