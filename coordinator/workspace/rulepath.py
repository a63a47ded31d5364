"""The PATH a verifier rule runs with: the worker's, without any folder the rule's user could
have written a program into (a ``python3`` shim the agent planted would otherwise decide
the verdict).

:func:`open_to` is the rule, on what ``lstat`` said of a folder and every folder above it;
:func:`rule_path` applies it to each entry of a PATH.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from overnight.coordinator.workspace.plan import clean_path

if TYPE_CHECKING:
    from overnight.worker.sandbox.stepuser import StepUser

FALLBACK = "/usr/bin:/bin"


class Node(NamedTuple):
    """What ``lstat`` said of one folder of a path: its owner, group and mode (type bits
    included)."""

    uid: int
    gid: int
    mode: int


def _may_write(node: Node, uid: int, gids: Collection[int]) -> bool:
    if node.uid == uid:  # its owner can always chmod it writable
        return True
    if node.gid in gids:
        return bool(node.mode & 0o020 and node.mode & 0o010)
    return bool(node.mode & 0o002 and node.mode & 0o001)


def open_to(chain: Sequence[Node], uid: int, gids: Collection[int]) -> bool:
    """True if ``uid`` (in groups ``gids``) can change what a folder holds: ``chain`` is the
    folder, then each folder above it up to ``/``. It can if it may write the folder
    itself, or any folder above (and so rename what is below: in a sticky folder only what
    it owns). A symbolic link's own mode means nothing; uid 0 can do anything."""
    if uid == 0:
        return True
    for i, node in enumerate(chain):
        if stat.S_ISLNK(node.mode):
            continue
        if i == 0:
            if _may_write(node, uid, gids):
                return True
            continue
        if node.uid == uid:
            return True
        if _may_write(node, uid, gids):
            below = chain[i - 1]
            if not (node.mode & stat.S_ISVTX) or below.uid == uid:
                return True
    return False


def chain_of(path: str, follow: bool) -> list[Node] | None:
    """``path`` (absolute) and each folder above it, as ``lstat`` (or, ``follow``, ``stat``)
    sees them; None if one cannot be read."""
    nodes = []
    here = path
    while True:
        try:
            info = os.stat(here) if follow else os.lstat(here)
        except OSError:
            return None
        nodes.append(Node(info.st_uid, info.st_gid, info.st_mode))
        up = os.path.dirname(here)
        if up == here:
            return nodes
        here = up


def writable_by(entry: str, uid: int, gids: Collection[int]) -> bool:
    """True if ``uid`` could put a program into the folder ``entry`` names: through the
    names as written, or where its links lead. A folder that cannot be read counts as
    writable (it is dropped, never trusted)."""
    spelled = chain_of(os.path.abspath(entry), follow=False)
    real = chain_of(os.path.realpath(entry), follow=True)
    if spelled is None or real is None:
        return True
    return open_to(spelled, uid, gids) or open_to(real, uid, gids)


def rule_path(path: str, forbidden: Iterable[str], who: tuple[int, Collection[int]] | None) -> str:
    """``path`` without relative entries, entries inside ``forbidden`` folders (the task's
    trees) and, when ``who`` (a uid and its groups) is given, any folder that uid could
    write; ``/usr/bin:/bin`` if nothing is left."""
    kept = clean_path(path, forbidden).split(os.pathsep)
    if who is not None:
        uid, gids = who
        kept = [e for e in kept if e and not writable_by(e, uid, gids)]
    return os.pathsep.join(e for e in kept if e) or FALLBACK


def rule_user(user: StepUser | None) -> tuple[int, tuple[int, ...]] | None:
    """The uid a rule runs as and its groups: ``user``'s (the step user), else this
    process's own (None as root: a root step can write anywhere, no folder is safer)."""
    if user is not None:
        return user.uid, (user.gid, *user.groups)
    if os.geteuid() == 0:
        return None
    return os.geteuid(), (os.getegid(), *os.getgroups())
