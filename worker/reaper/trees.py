"""What the reaper sees of this host's lapsed leases in ``/proc``, and how it ends their trees.

A lease whose step ran in a cgroup (:mod:`worker.sandbox.cgroup`) is ended through it: the group
named by the lease id under overnight's cgroup folder is itself proof of membership (only
root creates groups there, and no step can move a process into or out of one). Otherwise
only leases whose supervisor left a matching proof (:mod:`worker.lease.proof`) get here: their
holder and its group and session count while the holder is still the very process the
proof names; escaped descendants count by the ``OVERNIGHT_LEASE_ID`` tag in their
environment. Pid 1, the reaper and its ancestors are never members, and every signal goes
through a pidfd opened after the start time was checked (:class:`worker.supervise.procs.Signaller`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

from overnight.worker.lease.proof import Proof
from overnight.worker.lease.store import LeaseDoc
from overnight.worker.reaper.rule import Facts
from overnight.worker.sandbox.cgroup import StepGroup
from overnight.worker.supervise import procs
from overnight.worker.supervise.procs import Proc
from overnight.worker.supervise.tree import Tree, end_tree

log = logging.getLogger("overnight.reaper")


@dataclass(frozen=True)
class Target:
    """One lease to reap: its document, its proof and/or its cgroup, and whether its
    holder's process group counts."""

    doc: LeaseDoc
    proof: Proof | None
    signal_group: bool
    group: StepGroup | None = None


def observe(doc: LeaseDoc, proof: Proof | None, facts: Facts) -> Facts:
    """Fill in what /proc says about this host's lease: is the holder the same process, and
    is its supervisor still around (as the proof names them, else as the document does)."""
    pid, ticks = doc.holder_pid, doc.child_start_ticks
    if proof is not None:
        pid, ticks = proof.pid, proof.start_ticks
    same = procs.is_same_process(pid, ticks, doc.boot_id)
    holder = procs.read_proc(pid) if pid > 0 else None
    exists = holder is not None and not holder.dead
    if proof is not None:
        sup = procs.read_proc(proof.supervisor_pid)
        present = sup is not None and not sup.dead and sup.start == proof.supervisor_start_ticks
    else:
        sup = procs.read_proc(doc.supervisor_pid) if doc.supervisor_pid > 0 else None
        present = sup is not None and not sup.dead
    if present and same and holder is not None and sup is not None:
        # A dead supervisor's child is re-parented at once, so its parent pid tells.
        present = holder.ppid == sup.pid
    return Facts(
        doc=doc,
        alive=facts.alive,
        host_reaper_live=facts.host_reaper_live,
        holder_same=same,
        holder_exists=exists,
        supervisor_present=present,
        unproven=facts.unproven,
    )


def kill_trees(targets: list[Target], grace: float) -> tuple[dict[str, int], dict[str, list[int]]]:
    """End every tree together: SIGTERM, up to ``grace`` seconds, SIGKILL what is left;
    cgroups are emptied and removed. Returns the number of processes signalled per lease
    id, and the pids that survived per lease id."""
    started = time.monotonic()
    counts: dict[str, int] = {}
    survivors: dict[str, list[int]] = {}
    groups = {t.doc.lease_id: t.group for t in targets if t.group is not None}
    for lease_id, group in groups.items():
        counts[lease_id] = len(group.signal_all(signal.SIGTERM))
    proven = [t for t in targets if t.proof is not None]
    if proven:
        trees = LapsedTrees(proven)
        result = end_tree(trees, grace)
        for pid in sorted(result.survivors):
            survivors.setdefault(trees.owner.get(pid, "?"), []).append(pid)
        for pid in result.signalled | result.killed:
            lease_id = trees.owner.get(pid, "?")
            counts[lease_id] = counts.get(lease_id, 0) + 1
    for lease_id, group in groups.items():
        left = max(0.0, grace - (time.monotonic() - started))
        ended = group.end(left)
        counts[lease_id] = counts.get(lease_id, 0) + ended.killed
        if ended.survivors:
            survivors.setdefault(lease_id, []).extend(ended.survivors)
        group.remove()
    for lease_id, pids in survivors.items():
        log.error("lease=%s host=%s pids %s SURVIVED SIGKILL", lease_id, procs.hostname(), pids)
    return counts, survivors


class LapsedTrees(Tree):
    """The trees of several proven lapsed leases, found together in one scan of the table.

    For :func:`worker.supervise.tree.end_tree`: a process belongs to a lease if it carries the
    lease's tag, or (while the holder the proof names is still that very process, so its group
    and session numbers cannot have been reused) it is the holder or shares its group or
    session; and every descendant of a member is a member. Each environment is read once
    per process, whatever the number of leases, so a pass with many leases stays cheap.
    """

    def __init__(self, targets: Iterable[Target]) -> None:
        super().__init__(root=0, root_start=None)
        self.targets = {t.doc.lease_id: t for t in targets}
        self.owner: dict[int, str] = {}
        self.protected = procs.ancestors(os.getpid()) | {1}
        self._tags: dict[tuple[int, int], str | None] = {}

    def members(self, table: dict[int, Proc] | None = None) -> dict[int, Proc]:
        table = procs.scan() if table is None else table
        by_group: dict[int, list[Proc]] = {}
        children: dict[int, list[Proc]] = {}
        for proc in table.values():
            by_group.setdefault(proc.pgid, []).append(proc)
            if proc.sid != proc.pgid:
                by_group.setdefault(proc.sid, []).append(proc)
            children.setdefault(proc.ppid, []).append(proc)
        keep_out = self.protected
        found: dict[int, str] = {}
        for lease_id, target in self.targets.items():
            if not target.signal_group or target.proof is None:
                continue
            root = table.get(target.proof.pid)
            if root is None or root.start != target.proof.start_ticks or root.pid in keep_out:
                continue
            found[root.pid] = lease_id
            for proc in by_group.get(root.pid, ()):
                if proc.pid not in keep_out:
                    found.setdefault(proc.pid, lease_id)
        for proc in table.values():
            if proc.pid not in found and proc.pid not in keep_out and not proc.dead:
                tag = self._tag(proc)
                if tag in self.targets:
                    found[proc.pid] = tag
        stack = list(found)
        while stack:
            pid = stack.pop()
            for child in children.get(pid, ()):
                if child.pid not in found and child.pid not in keep_out:
                    found[child.pid] = found[pid]
                    stack.append(child.pid)
        self.owner.update(found)
        return {pid: table[pid] for pid in found}

    def _tag(self, proc: Proc) -> str | None:
        key = (proc.pid, proc.start)
        if key not in self._tags:
            self._tags[key] = procs.lease_tag(proc.pid)
        return self._tags[key]
