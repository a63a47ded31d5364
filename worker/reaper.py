"""The reaper: ends leases whose liveness key lapsed, and kills the trees they named.

A pass reads the expiry index up to Redis server time (O(log N + lapsed), no KEYS, no
SCAN), looks at each lapsed lease once, lets the pure :func:`decide` say what to do, and
then acts: kill first, end second. The end goes through ``lease_end.lua`` with
``only_if_lapsed``, so a supervisor that is merely slow and a reaper (or two reapers)
never both end a lease; whoever loses is refused and does nothing more.

Nothing is signalled before the process is shown to be the one the lease named: the
holder by pid + start time + boot id, escaped descendants by the ``OVERNIGHT_LEASE_ID``
tag in their environment, and every signal goes through a pidfd opened after that check.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from overnight.config.keys import Keys
from overnight.worker import procs
from overnight.worker.lease import (
    LeaseCorrupt,
    LeaseDoc,
    Leases,
    Status,
    lapsed_reason,
    status_for,
)
from overnight.worker.scripts import register
from overnight.worker.tree import TAG_VAR, Proc, Tree, end_tree, read_proc, scan

if TYPE_CHECKING:
    import redis

log = logging.getLogger("overnight.reaper")

RECEIPT_KIND = "subprocess_lease_expired"
# Lapsed leases read per round trip; a pass pages through all of them.
PAGE = 1000
MAX_PAGES = 1000
# A live supervisor gets this long past its grace to end its own lapsed lease.
SUPERVISOR_SLACK = 2.0

Action = Literal["skip", "prune", "reap", "end"]


@dataclass(frozen=True)
class Facts:
    """What a pass observed about one lapsed lease: the whole input of :func:`decide`."""

    doc: LeaseDoc | None
    alive: bool = False
    host_reaper_live: bool = False
    holder_same: bool = False
    holder_exists: bool = False
    supervisor_present: bool = False


@dataclass(frozen=True)
class Decision:
    """What to do with one lapsed lease. ``why`` is a short word for logs and reports."""

    action: Action
    why: str
    status: Status | None = None
    note: str = ""
    signal_group: bool = False


def decide(facts: Facts, *, host: str, boot: str, now: float, hold_off: float) -> Decision:
    """The reaper's rule for one lease found in the expiry index. Pure: no Redis, no /proc.

    ``now`` is Redis server time; ``hold_off`` is how long past its lapse a supervisor
    that is still present is left to end its own lease before the reaper steps in.
    """
    doc = facts.doc
    if doc is None:
        return Decision("prune", "no-document")
    if doc.status != "running":
        return Decision("prune", f"already-{doc.status}")
    if facts.alive:
        return Decision("skip", "alive")
    if doc.host != host:
        if facts.host_reaper_live:
            return Decision("skip", "host-has-reaper")
        return Decision("end", "host-lost", "killed", "reaped: host-lost")
    cause = lapsed_reason(doc, now)
    status = status_for(cause)
    if doc.boot_id and boot and doc.boot_id != boot:
        return Decision("end", "host-rebooted", status, f"reaped: {cause}, host-rebooted")
    if facts.supervisor_present and now < doc.lapse_unix + hold_off:
        return Decision("skip", "supervisor-acting")
    if doc.holder_pid <= 0:
        why = "never-attached"
    elif facts.holder_same:
        why = "supervisor-stuck" if facts.supervisor_present else "supervisor-gone"
    elif facts.holder_exists:
        why = "pid-reused"
    else:
        why = "child-gone"
    return Decision("reap", why, status, f"reaped: {cause}, {why}", signal_group=facts.holder_same)


@dataclass(frozen=True)
class ActionRecord:
    """One thing a pass did to one lease."""

    lease_id: str
    host: str
    pid: int
    outcome: str  # reaped | ended | refused | pruned
    why: str
    status: str | None = None
    note: str = ""
    signalled: int = 0


@dataclass
class PassReport:
    """The result of one pass."""

    host: str
    lapsed: int = 0
    skipped: int = 0
    ended: int = 0
    refused: int = 0
    pruned: int = 0
    signalled: int = 0
    survivors: int = 0
    seconds: float = 0.0
    actions: list[ActionRecord] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the log."""
        return (
            f"pass host={self.host} lapsed={self.lapsed} ended={self.ended} "
            f"skipped={self.skipped} refused={self.refused} pruned={self.pruned} "
            f"signalled={self.signalled} survivors={self.survivors} "
            f"in {self.seconds * 1000:.1f}ms"
        )


def announce(client: redis.Redis, keys: Keys, host: str, ttl: float) -> None:
    """Renew this host's reaper heartbeat key: a live reaper runs on ``host``."""
    client.set(keys.reaper_host(host), str(os.getpid()), px=max(1, int(ttl * 1000)))


def reap_once(
    client: redis.Redis,
    keys: Keys,
    *,
    grace: float = 5.0,
    host: str | None = None,
    host_ttl: float | None = 30.0,
    hold_off: float | None = None,
    page: int = PAGE,
    stop: threading.Event | None = None,
) -> PassReport:
    """One reaper pass over the lapsed leases of the namespace; returns what it did.

    Renews this host's reaper key (unless ``host_ttl`` is None), kills the trees of this
    host's lapsed leases (SIGTERM, up to ``grace`` seconds, SIGKILL), then ends each lease
    ``expired``/``killed`` with a ``reaped:`` note, and ends leases of hosts without a
    live reaper as ``killed``/``reaped: host-lost``. Raises redis errors to the caller.
    """
    started = time.monotonic()
    host = host or procs.hostname()
    report = PassReport(host=host)
    if host_ttl is not None:
        announce(client, keys, host, host_ttl)
    leases = Leases(client, keys)
    prune = register(client, "reaper_prune")
    hold = grace + SUPERVISOR_SLACK if hold_off is None else hold_off
    offset = 0
    for _page in range(MAX_PAGES):
        if stop is not None and stop.is_set():
            break
        secs, micros = client.time()
        now = int(secs) + int(micros) / 1e6
        raw = client.zrangebyscore(
            keys.lease_expiry, "-inf", int(now * 1000), start=offset, num=page
        )
        ids = [_text(i) for i in raw]
        if not ids:
            break
        left = _reap_batch(client, keys, leases, prune, ids, now, host, grace, hold, report)
        if len(ids) < page:
            break
        offset += left
    report.seconds = time.monotonic() - started
    return report


def _reap_batch(
    client: redis.Redis,
    keys: Keys,
    leases: Leases,
    prune: Any,
    ids: list[str],
    now: float,
    host: str,
    grace: float,
    hold_off: float,
    report: PassReport,
) -> int:
    """Decide and act on one page of lapsed ids; returns how many this pass left in the index."""
    report.lapsed += len(ids)
    removed_before = report.ended + report.pruned
    pipe = client.pipeline(transaction=False)
    for lease_id in ids:
        pipe.hgetall(keys.lease(lease_id))
        pipe.exists(keys.lease_alive(lease_id))
    rows = pipe.execute()
    docs = [_parse(lease_id, raw) for lease_id, raw in zip(ids, rows[0::2], strict=True)]
    unreadable = {i for i, d, raw in zip(ids, docs, rows[0::2], strict=True) if raw and d is None}
    alive = [bool(n) for n in rows[1::2]]
    others = sorted({d.host for d in docs if d is not None and d.host != host})
    live_hosts = _live_reaper_hosts(client, keys, others)
    boot = procs.boot_id()

    decisions: list[tuple[str, LeaseDoc | None, Decision]] = []
    for lease_id, doc, is_alive in zip(ids, docs, alive, strict=True):
        facts = Facts(
            doc=doc, alive=is_alive, host_reaper_live=bool(doc and doc.host in live_hosts)
        )
        if doc is not None and doc.host == host and not is_alive and doc.status == "running":
            facts = _observe(doc, facts)
        if lease_id in unreadable:
            d = Decision("skip", "unreadable-document")
        else:
            d = decide(facts, host=host, boot=boot, now=now, hold_off=hold_off)
        decisions.append((lease_id, doc, d))

    to_kill = [(doc, d) for _, doc, d in decisions if d.action == "reap" and doc is not None]
    signalled: dict[str, int] = {}
    if to_kill:
        signalled, survivors = _kill_trees(to_kill, grace)
        report.signalled += sum(signalled.values())
        report.survivors += survivors

    ending: list[tuple[LeaseDoc, Decision]] = []
    for lease_id, doc, d in decisions:
        if d.action == "skip":
            report.skipped += 1
        elif d.action == "prune":
            _prune(client, keys, prune, lease_id, d, report)
        elif doc is not None:
            ending.append((doc, d))
    if ending:
        refusals = leases.end_many(
            [(doc.lease_id, doc.token, d.status or "killed", d.note) for doc, d in ending],
            only_if_lapsed=True,
            writer="reaper",
            receipt_kind=RECEIPT_KIND,
        )
        for (doc, d), refused in zip(ending, refusals, strict=True):
            _record(doc, d, refused, signalled.get(doc.lease_id, 0), report)
    return len(ids) - (report.ended + report.pruned - removed_before)


def _live_reaper_hosts(client: redis.Redis, keys: Keys, hosts: list[str]) -> set[str]:
    if not hosts:
        return set()
    pipe = client.pipeline(transaction=False)
    for other in hosts:
        pipe.exists(keys.reaper_host(other))
    return {h for h, n in zip(hosts, pipe.execute(), strict=True) if n}


def _observe(doc: LeaseDoc, facts: Facts) -> Facts:
    """Fill in what /proc says about this host's lease: is the holder the same process, and
    is its supervisor still around (the holder's parent, or at least a live pid)."""
    same = procs.is_same_process(doc.holder_pid, doc.child_start_ticks, doc.boot_id)
    holder = read_proc(doc.holder_pid) if doc.holder_pid > 0 else None
    exists = holder is not None and not holder.dead
    sup = read_proc(doc.supervisor_pid) if doc.supervisor_pid > 0 else None
    present = sup is not None and not sup.dead
    if present and same and holder is not None:
        # A dead supervisor's child is re-parented at once, so its parent pid tells.
        present = holder.ppid == doc.supervisor_pid
    return Facts(
        doc=doc,
        alive=facts.alive,
        host_reaper_live=facts.host_reaper_live,
        holder_same=same,
        holder_exists=exists,
        supervisor_present=present,
    )


def _kill_trees(
    targets: list[tuple[LeaseDoc, Decision]], grace: float
) -> tuple[dict[str, int], int]:
    """End every tree together: SIGTERM, up to ``grace`` seconds, SIGKILL what is left."""
    trees = LapsedTrees(
        [doc for doc, _ in targets],
        trust_roots={doc.lease_id for doc, d in targets if d.signal_group},
    )
    result = end_tree(trees, grace)
    for pid in sorted(result.survivors):
        lease_id = trees.owner.get(pid, "?")
        log.error("lease=%s host=%s pid=%d survived SIGKILL", lease_id, procs.hostname(), pid)
    counts: dict[str, int] = {}
    for pid in result.signalled | result.killed:
        lease_id = trees.owner.get(pid, "?")
        counts[lease_id] = counts.get(lease_id, 0) + 1
    return counts, len(result.survivors)


def _record(
    doc: LeaseDoc, d: Decision, refused: str | None, signalled: int, report: PassReport
) -> None:
    if refused is not None:
        report.refused += 1
        report.actions.append(
            ActionRecord(doc.lease_id, doc.host, doc.holder_pid, "refused", refused,
                         signalled=signalled)
        )  # fmt: skip
        log.info("lease=%s host=%s pid=%d not ended: %s (someone else ended it first)",
                 doc.lease_id, doc.host, doc.holder_pid, refused)  # fmt: skip
        return
    report.ended += 1
    outcome = "reaped" if d.action == "reap" else "ended"
    report.actions.append(ActionRecord(doc.lease_id, doc.host, doc.holder_pid, outcome, d.why,
                                       d.status, d.note, signalled))  # fmt: skip
    log.info("lease=%s host=%s pid=%d %s status=%s note=%r signalled=%d", doc.lease_id,
             doc.host, doc.holder_pid, outcome, d.status, d.note, signalled)  # fmt: skip


def _prune(
    client: redis.Redis, keys: Keys, prune: Any, lease_id: str, d: Decision, report: PassReport
) -> None:
    res = prune(keys=[keys.lease(lease_id), keys.lease_expiry], args=[lease_id])
    if int(res[0]) == 1:
        report.pruned += 1
        report.actions.append(ActionRecord(lease_id, "", 0, "pruned", d.why))
        log.info("lease=%s dropped from the expiry index: %s", lease_id, d.why)


def run(
    client: redis.Redis,
    keys: Keys,
    *,
    interval: float,
    grace: float,
    host_ttl: float,
    stop: threading.Event,
    once: bool = False,
) -> None:
    """Pass every ``interval`` seconds until ``stop`` is set (or once).

    A Redis outage is logged once and retried; any other failure of a pass is logged with
    its traceback and the next pass runs anyway (a reaper that dies helps nobody). With
    ``once`` every failure is raised.
    """
    import redis as redis_mod

    down = False
    while not stop.is_set():
        began = time.monotonic()
        try:
            report = reap_once(client, keys, grace=grace, host_ttl=host_ttl, stop=stop)
        except (redis_mod.ConnectionError, redis_mod.TimeoutError) as exc:
            if once:
                raise
            if not down:
                log.warning("host=%s Redis unreachable (%s); retrying every %.1fs",
                            procs.hostname(), type(exc).__name__, interval)  # fmt: skip
            down = True
        except Exception:
            if once:
                raise
            log.exception("host=%s reaper pass failed; next pass in %.1fs",
                          procs.hostname(), interval)  # fmt: skip
        else:
            if down:
                log.info("host=%s Redis reachable again", procs.hostname())
                down = False
            log.debug("%s", report.summary())
        if once:
            return
        stop.wait(max(0.0, interval - (time.monotonic() - began)))


def _parse(lease_id: str, raw: dict[Any, Any]) -> LeaseDoc | None:
    if not raw:
        return None
    try:
        return LeaseDoc.from_hash(raw)
    except LeaseCorrupt:
        if lease_id not in _unreadable:
            _unreadable.add(lease_id)
            log.warning("lease=%s has an unreadable document; left alone", lease_id)
        return None


_unreadable: set[str] = set()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --- process trees -------------------------------------------------------------------------


class LapsedTrees(Tree):
    """The trees of several lapsed leases, found together in one scan of the process table.

    For :func:`worker.tree.end_tree`: a process belongs to a lease if it carries the lease's
    tag, or (while the lease's holder is still the very process it recorded, so its group
    and session numbers cannot have been reused) it is the holder or shares its group or
    session; and every descendant of a member is a member. Each environment is read once
    per process, whatever the number of leases, so a pass with many leases stays cheap.
    """

    def __init__(self, docs: Iterable[LeaseDoc], *, trust_roots: set[str]) -> None:
        super().__init__(root=0, root_start=None)
        self.docs = {doc.lease_id: doc for doc in docs}
        self.trust_roots = trust_roots
        self.owner: dict[int, str] = {}
        self._tags: dict[tuple[int, int], str | None] = {}

    def members(self, table: dict[int, Proc] | None = None) -> dict[int, Proc]:
        table = scan() if table is None else table
        me = os.getpid()
        by_group: dict[int, list[Proc]] = {}
        children: dict[int, list[Proc]] = {}
        for proc in table.values():
            by_group.setdefault(proc.pgid, []).append(proc)
            if proc.sid != proc.pgid:
                by_group.setdefault(proc.sid, []).append(proc)
            children.setdefault(proc.ppid, []).append(proc)
        found: dict[int, str] = {}
        for lease_id in self.trust_roots:
            doc = self.docs[lease_id]
            root = table.get(doc.holder_pid)
            if root is None or doc.child_start_ticks is None:
                continue
            if root.start != doc.child_start_ticks:
                continue
            found[root.pid] = lease_id
            for proc in by_group.get(root.pid, ()):
                found.setdefault(proc.pid, lease_id)
        for proc in table.values():
            if proc.pid not in found and proc.pid != me and not proc.dead:
                tag = self._tag(proc)
                if tag in self.docs:
                    found[proc.pid] = tag
        stack = list(found)
        while stack:
            pid = stack.pop()
            for child in children.get(pid, ()):
                if child.pid not in found and child.pid != me:
                    found[child.pid] = found[pid]
                    stack.append(child.pid)
        found.pop(me, None)
        self.owner.update(found)
        return {pid: table[pid] for pid in found}

    def _tag(self, proc: Proc) -> str | None:
        key = (proc.pid, proc.start)
        if key not in self._tags:
            self._tags[key] = lease_tag(proc.pid)
        return self._tags[key]


_TAG = f"{TAG_VAR}=".encode()


def lease_tag(pid: int) -> str | None:
    """The lease id in ``pid``'s environment (``OVERNIGHT_LEASE_ID``), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read()
    except OSError:
        return None
    for entry in env.split(b"\0"):
        if entry.startswith(_TAG):
            return entry[len(_TAG) :].decode(errors="replace")
    return None
