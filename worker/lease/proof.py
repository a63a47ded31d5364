"""Lease proofs: the supervisor's local record tying a lease to the process it started.

A pid, pgid, start time or boot id read from Redis proves nothing: a step that can write
Redis could name any process there (redis-server's pid with its real start time, say).
So when the supervisor starts a child it also writes a proof, under
:func:`config.runtime.proof_dir` (a 0700 folder of the supervisor's user; the file 0600),
holding the lease id, token, the child's pid, pgid, start ticks and boot id, and its own
pid and start ticks. It removes the proof when the step has ended. The reaper signals a
lease's processes only if the proof is there, is the supervisor user's own file and
matches the lease document (see :func:`check`).

The proof does not keep out a step running as the supervisor's own user, which can write
that folder too; that needs the step under another user (or a per-lease cgroup).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from overnight.config.runtime import proof_dir
from overnight.worker.supervise import procs

if TYPE_CHECKING:
    from overnight.worker.lease.store import LeaseDoc

log = logging.getLogger("overnight.proof")


@dataclass(frozen=True)
class Proof:
    """What the supervisor recorded when it started a lease's child."""

    lease_id: str
    token: int
    pid: int
    pgid: int
    start_ticks: int
    boot_id: str
    supervisor_pid: int
    supervisor_start_ticks: int
    cgroup: str = ""  # the lease's cgroup folder, if the step runs in one


def path_for(namespace: str, lease_id: str) -> Path:
    """The proof file of ``lease_id`` (any text: it is quoted, never a path of its own)."""
    return proof_dir(namespace) / f"lease-{quote(lease_id, safe='')}.json"


def write(
    namespace: str,
    lease_id: str,
    token: int,
    pid: int,
    ticks: int | None,
    group: Path | None = None,
) -> bool:
    """Record that this process started ``pid`` (started at ``ticks``) for the lease, in the
    cgroup ``group`` if given.

    Returns False (and logs why) if it could not: the reaper then never signals that
    lease's processes, it only ends the lease.
    """
    me = procs.start_ticks(os.getpid())
    if ticks is None or me is None:
        log.warning("lease=%s host=%s: no start time for the proof", lease_id, procs.hostname())
        return False
    return store(
        namespace,
        Proof(lease_id, token, pid, pid, ticks, procs.boot_id(), os.getpid(), me, str(group or "")),
    )


def store(namespace: str, proof: Proof) -> bool:
    """Write ``proof`` atomically (0600, in a 0700 folder of this user); False if it could not."""
    target = path_for(namespace, proof.lease_id)
    try:
        private_dir(target.parent)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(asdict(proof), fh)
        os.replace(tmp, target)
    except OSError as exc:
        log.warning(
            "lease=%s host=%s: cannot write the lease proof %s: %s",
            proof.lease_id,
            procs.hostname(),
            target,
            exc,
        )
        return False
    return True


def remove(namespace: str, lease_id: str) -> None:
    """Drop the proof of ``lease_id`` (nothing if there is none)."""
    with contextlib.suppress(OSError):
        os.unlink(path_for(namespace, lease_id))


def read(namespace: str, lease_id: str) -> tuple[Proof | None, str]:
    """The proof of ``lease_id``, or None and why there is no usable one."""
    path = path_for(namespace, lease_id)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None, "no proof"
    except OSError as exc:
        return None, f"proof unreadable ({exc.strerror})"
    with os.fdopen(fd) as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid not in (os.geteuid(), 0):
            return None, "proof not ours"
        if info.st_mode & 0o022:
            return None, "proof writable by others"
        try:
            data = json.load(fh)
            proof = Proof(**data)
        except (ValueError, TypeError):
            return None, "proof unreadable"
    fields = (
        proof.token,
        proof.pid,
        proof.pgid,
        proof.start_ticks,
        proof.supervisor_pid,
        proof.supervisor_start_ticks,
    )
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in fields):
        return None, "proof unreadable"
    if not isinstance(proof.cgroup, str):
        return None, "proof unreadable"
    return proof, ""


def mismatch(proof: Proof, doc: LeaseDoc) -> str:
    """Why ``proof`` does not vouch for ``doc`` (empty when it does). Pure."""
    if proof.lease_id != doc.lease_id:
        return "proof names another lease"
    if proof.token != doc.token:
        return "proof token differs"
    if proof.pid <= 1:
        return "proof pid invalid"
    # A supervisor that died between starting the child and recording it on the lease left
    # a document naming no process: then the proof alone names it.
    attached = doc.holder_pid > 0 or doc.child_start_ticks is not None
    if attached and proof.pid != doc.holder_pid:
        return "proof pid differs"
    if attached and proof.start_ticks != doc.child_start_ticks:
        return "proof start time differs"
    if proof.boot_id != procs.boot_id() or (doc.boot_id and doc.boot_id != proof.boot_id):
        return "proof from another boot"
    return ""


def check(namespace: str, doc: LeaseDoc) -> tuple[Proof | None, str]:
    """The proof for ``doc`` if there is one and it matches the document, else None and why."""
    proof, why = read(namespace, doc.lease_id)
    if proof is None:
        return None, why
    why = mismatch(proof, doc)
    return (proof, "") if not why else (None, why)


def private_dir(path: Path) -> None:
    """Create ``path`` and the two folders above it 0700, and make sure each is this user's
    own, private, and not a symlink."""
    for level in (path.parent.parent, path.parent, path):
        with contextlib.suppress(FileExistsError):
            os.mkdir(level, 0o700)
        info = os.lstat(level)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise PermissionError(f"{level} is not a private folder of this user")
