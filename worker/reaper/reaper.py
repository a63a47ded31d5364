"""The reaper: ends leases whose liveness key lapsed, and kills the trees they named.

A pass reads the expiry index up to Redis server time (O(log N + lapsed), no KEYS, no
SCAN), looks at each lapsed lease once, lets the pure :func:`worker.reaper.rule.decide` say
what to do, and then acts: kill first, end second. The end goes through ``lease_reap.lua``,
which ends only a lapsed lease, so a supervisor that is merely slow and a reaper (or two
reapers) never both end it; whoever loses is refused and does nothing more.

What Redis says proves nothing about a process: a lease's processes are signalled only if
its step's cgroup exists (its members are the lease's, whatever Redis says) or its
supervisor's local proof (:mod:`worker.lease.proof`) is there and matches the document.
Otherwise the reaper logs why, ends the lease with an ``unproven:`` note and signals
nothing. How trees are found and signalled: :mod:`worker.reaper.trees`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from overnight.config import defaults
from overnight.config.keys import Keys
from overnight.worker.lease import proof
from overnight.worker.lease.doc import as_text
from overnight.worker.lease.store import LeaseCorrupt, LeaseDoc, Leases
from overnight.worker.reaper.listen import Listener
from overnight.worker.reaper.rule import Decision, Facts, decide
from overnight.worker.reaper.trees import Target, kill_trees, observe
from overnight.worker.redisio import receipts
from overnight.worker.redisio.clients import Backoff, transient
from overnight.worker.redisio.scripts import register
from overnight.worker.sandbox import cgroup
from overnight.worker.supervise import procs
from overnight.worker.supervise.procs import lease_tag

if TYPE_CHECKING:
    import redis

log = logging.getLogger("overnight.reaper")

__all__ = [
    "RECEIPT_KIND",
    "Decision",
    "Facts",
    "PassReport",
    "decide",
    "lease_tag",
    "reap_once",
    "run",
]

RECEIPT_KIND = "subprocess_lease_expired"
# Lapsed leases read per round trip; a pass pages through all of them.
PAGE = 1000
MAX_PAGES = 1000
# A live supervisor gets this long past its grace to end its own lapsed lease.
SUPERVISOR_SLACK = 2.0


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
    grace: float = defaults.GRACE,
    host: str | None = None,
    host_ttl: float | None = defaults.REAPER_HOST_TTL,
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
        ids = [as_text(i) for i in raw]
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
    proofs: dict[str, proof.Proof] = {}
    groups: dict[str, cgroup.StepGroup] = {}
    for lease_id, doc, is_alive in zip(ids, docs, alive, strict=True):
        facts = Facts(
            doc=doc, alive=is_alive, host_reaper_live=bool(doc and doc.host in live_hosts)
        )
        if doc is not None and doc.host == host and not is_alive and doc.status == "running":
            found, why = proof.check(keys.namespace, doc)
            if found is not None:
                proofs[lease_id] = found
            group = cgroup.open_existing(keys.namespace, lease_id)
            if group is not None:
                groups[lease_id] = group
                why = ""  # the lease's own cgroup: its members are proven by the kernel
            facts = observe(doc, found, Facts(doc, False, facts.host_reaper_live, unproven=why))
        if lease_id in unreadable:
            d = Decision("skip", "unreadable-document")
        else:
            d = decide(facts, host=host, boot=boot, now=now, hold_off=hold_off)
        if d.why in ("unproven", "never-attached") and doc is not None:
            log.warning(
                "lease=%s host=%s pid=%d: not signalling anything: %s",
                lease_id,
                doc.host,
                doc.holder_pid,
                facts.unproven,
            )
        decisions.append((lease_id, doc, d))

    to_kill = [
        Target(
            doc,
            proofs.get(doc.lease_id),
            d.signal_group and doc.lease_id in proofs,
            groups.pop(doc.lease_id, None),
        )
        for _, doc, d in decisions
        if d.action == "reap"
        and doc is not None
        and (doc.lease_id in proofs or doc.lease_id in groups)
    ]
    for group in groups.values():  # not reaped now (its supervisor acts): not ours to hold
        group.remove_handle()
    signalled: dict[str, int] = {}
    if to_kill:
        signalled, survivors = kill_trees(to_kill, grace)
        report.signalled += sum(signalled.values())
        report.survivors += sum(len(p) for p in survivors.values())
        for lease_id, pids in survivors.items():
            _record_survivors(client, keys, lease_id, pids)

    ending: list[tuple[LeaseDoc, Decision]] = []
    for lease_id, doc, d in decisions:
        if d.action == "skip":
            report.skipped += 1
        elif d.action == "prune":
            _prune(client, keys, prune, lease_id, doc, d, report)
        elif doc is not None:
            ending.append((doc, d))
    if ending:
        refusals = leases.reap(
            [(doc.lease_id, doc.token, d.status or "killed", d.note) for doc, d in ending],
            receipt_kind=RECEIPT_KIND,
        )
        for (doc, d), refused in zip(ending, refusals, strict=True):
            _record(doc, d, refused, signalled.get(doc.lease_id, 0), report)
            if doc.lease_id in proofs:
                proof.remove(keys.namespace, doc.lease_id)
    return len(ids) - (report.ended + report.pruned - removed_before)


def _record_survivors(client: redis.Redis, keys: Keys, lease_id: str, pids: list[int]) -> None:
    try:
        receipts.emit(
            client, keys, receipts.SURVIVORS, lease_id=lease_id, pids=sorted(pids), writer="reaper"
        )
    except Exception:
        log.exception("lease=%s: cannot record the survivors %s", lease_id, pids)


def _live_reaper_hosts(client: redis.Redis, keys: Keys, hosts: list[str]) -> set[str]:
    if not hosts:
        return set()
    pipe = client.pipeline(transaction=False)
    for other in hosts:
        pipe.exists(keys.reaper_host(other))
    return {h for h, n in zip(hosts, pipe.execute(), strict=True) if n}


def _record(
    doc: LeaseDoc, d: Decision, refused: str | None, signalled: int, report: PassReport
) -> None:
    if refused is not None:
        report.refused += 1
        report.actions.append(
            ActionRecord(
                doc.lease_id, doc.host, doc.holder_pid, "refused", refused, signalled=signalled
            )
        )
        log.info(
            "lease=%s host=%s pid=%d not ended: %s (someone else ended it first)",
            doc.lease_id,
            doc.host,
            doc.holder_pid,
            refused,
        )
        return
    report.ended += 1
    outcome = "reaped" if d.action == "reap" else "ended"
    report.actions.append(
        ActionRecord(
            doc.lease_id, doc.host, doc.holder_pid, outcome, d.why, d.status, d.note, signalled
        )
    )
    log.info(
        "lease=%s host=%s pid=%d %s status=%s note=%r signalled=%d",
        doc.lease_id,
        doc.host,
        doc.holder_pid,
        outcome,
        d.status,
        d.note,
        signalled,
    )


def _prune(
    client: redis.Redis,
    keys: Keys,
    prune: Any,
    lease_id: str,
    doc: LeaseDoc | None,
    d: Decision,
    report: PassReport,
) -> None:
    res = prune(keys=[keys.lease(lease_id), keys.lease_expiry], args=[lease_id])
    if int(res[0]) == 1:
        report.pruned += 1
        report.actions.append(ActionRecord(lease_id, "", 0, "pruned", d.why))
        log.info("lease=%s dropped from the expiry index: %s", lease_id, d.why)
    if doc is not None and doc.host == report.host:
        # A proof its supervisor could not remove (it died after the end was written).
        found, _why = proof.check(keys.namespace, doc)
        if found is not None:
            proof.remove(keys.namespace, lease_id)
        # Likewise its cgroup: the lease is over, so whatever is still in it must go.
        group = cgroup.open_existing(keys.namespace, lease_id)
        if group is not None:
            if group.populated():
                ended = group.kill()
                log.error(
                    "lease=%s host=%s: %d process(es) left in the cgroup of an ended lease; killed",
                    lease_id,
                    report.host,
                    ended.killed,
                )
            group.remove()


def run(
    client: redis.Redis,
    keys: Keys,
    *,
    interval: float,
    grace: float,
    host_ttl: float,
    stop: threading.Event,
    once: bool = False,
    listen: bool = True,
) -> None:
    """Pass every ``interval`` seconds until ``stop`` is set (or once).

    A Redis that is away or refuses writes for a while (:func:`clients.transient`: lost
    connection, OOM at maxmemory, LOADING, MISCONF, READONLY) is logged once and retried;
    any other failure of a pass is logged with its traceback and the next pass runs anyway
    (a reaper that dies helps nobody). With ``once`` every failure is raised.

    With ``listen``, a lapsed liveness key (a keyspace event, :mod:`worker.reaper.listen`)
    starts a pass at once; the timed passes stay as the backstop.
    """
    ear = Listener(client, keys, stop).start() if listen and not once else None
    redis_state = Backoff(f"host={procs.hostname()} reaper", log, first=interval, cap=30.0)
    while not stop.is_set():
        began = time.monotonic()
        wait = interval
        try:
            report = reap_once(client, keys, grace=grace, host_ttl=host_ttl, stop=stop)
        except Exception as exc:
            if once:
                raise
            if transient(exc):
                wait = max(interval, redis_state.failed(exc))
            else:
                log.exception(
                    "host=%s reaper pass failed; next pass in %.1fs", procs.hostname(), interval
                )
        else:
            redis_state.ok()
            log.debug("%s", report.summary())
        if once:
            return
        (stop.wait if ear is None else ear.wait)(max(0.0, wait - (time.monotonic() - began)))


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
