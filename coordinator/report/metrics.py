"""Prometheus ``/metrics`` for ``up``, ``coordinator`` and ``worker`` (``OVERNIGHT_METRICS_PORT``).

Everything is computed at scrape time by one custom collector, from Redis: gauges (tasks by
state, each envelope's budget, remaining and consumed calls and tokens) are read then, and
counters are a running fold (:class:`Tally`) over the namespace's receipt stream, read on from
where the last scrape stopped. A step runs in a work horse that RQ forks per job, so counting
in-process would lose it; the stream has every step, lease ending and gateway request.

``up`` and ``coordinator`` count the whole namespace. A worker counts the steps and lease
endings of the tasks it holds (by the ``worker`` of their last ``running`` receipt). The
gateway's requests and tokens come from its ``model_call`` receipts: once the gateway writes
them they are counted, with no change here (:data:`GATEWAY_KIND`).

Ports: the setting names the first port. ``up`` serves there and gives worker N (1, 2, ...)
port + N; ``overnight coordinator`` and a lone ``overnight worker`` serve on the port itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from overnight.coordinator.report.model import LEASE_ENDS, ending_class
from overnight.coordinator.tasks.states import State
from overnight.worker.redisio.receipts import Receipt

if TYPE_CHECKING:
    import redis

    from overnight.config.keys import Keys

log = logging.getLogger("overnight.metrics")
GATEWAY_KIND = "model_call"
# Seconds; a step is anything from a 0.1 s rule to an hour-long agent turn.
BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
READ_BATCH = 5000
MAX_BATCHES = 20  # per scrape; the rest is read at the next one


def lease_reason(note: str) -> str:
    """A lease ending's note as a bounded label value (no free text, no ids)."""
    for prefix, reason in (
        ("worker-complete", "complete"),
        ("worker-exit-", "exit"),
        ("worker-signal-", "signal"),
        ("supervisor-signal-", "supervisor-signal"),
        ("heartbeat-gap", "heartbeat-gap"),
        ("budget-exceeded", "deadline"),
        ("lease-lost", "lease-lost"),
        ("reaped: host-lost", "host-lost"),
        ("reaped", "reaped"),
        ("call-refused", "call-refused"),
        ("over-limit", "over-limit"),
    ):
        if note.startswith(prefix):
            return reason
    return "other"


@dataclass
class Tally:
    """Counters folded from receipts; ``worker`` set: only steps of tasks that worker holds."""

    worker: str | None = None
    steps: dict[tuple[str, str], int] = field(default_factory=dict)
    durations: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # bucket counts
    sums: dict[tuple[str, str], float] = field(default_factory=dict)
    lease_endings: dict[tuple[str, str], int] = field(default_factory=dict)
    verdicts: dict[str, int] = field(default_factory=dict)
    gateway_requests: dict[str, int] = field(default_factory=dict)
    gateway_tokens: dict[str, int] = field(default_factory=dict)
    reaper_kills: int = 0
    receipts: int = 0
    _starts: dict[str, float] = field(default_factory=dict)
    _holder: dict[str, str] = field(default_factory=dict)  # task id -> worker

    def mine(self, rc: Receipt) -> bool:
        if self.worker is None:
            return True
        return rc.task_id is not None and self._holder.get(rc.task_id) == self.worker

    def add(self, rc: Receipt) -> None:
        """Fold one receipt in."""
        self.receipts += 1
        data = rc.data
        if rc.kind == "task_state" and rc.task_id and data.get("state") == State.RUNNING:
            self._holder[rc.task_id] = str(data.get("worker") or "")
        if not self.mine(rc):
            return
        if rc.kind == "lease_acquired" and rc.lease_id and rc.task_id:
            self._starts[rc.lease_id] = rc.ts
        elif rc.kind in LEASE_ENDS:
            key = (str(data.get("status", "")), lease_reason(str(data.get("note", ""))))
            self.lease_endings[key] = self.lease_endings.get(key, 0) + 1
            if rc.kind == "subprocess_lease_expired" and str(data.get("note", "")).startswith(
                "reaped"
            ):
                self.reaper_kills += 1
        elif rc.kind == "step_finished":
            kind = "agent" if data.get("step") == "agent" else "verifier"
            outcome = ending_class(
                str(data.get("status", "")),
                str(data.get("note", "")),
                stopped=bool(data.get("stopped")),
            )
            key = (kind, outcome)
            self.steps[key] = self.steps.get(key, 0) + 1
            start = self._starts.pop(rc.lease_id or "", None)
            if start is not None:
                took = max(0.0, rc.ts - start)
                counts = self.durations.setdefault(key, [0] * (len(BUCKETS) + 1))
                for i, bound in enumerate(BUCKETS):
                    if took <= bound:
                        counts[i] += 1
                counts[-1] += 1
                self.sums[key] = self.sums.get(key, 0.0) + took
        elif rc.kind == "verdict":
            result = "pass" if not data.get("failed") else "fail"
            self.verdicts[result] = self.verdicts.get(result, 0) + 1
        elif rc.kind == GATEWAY_KIND:
            status = int(data.get("status") or 0)
            result = "refunded" if data.get("refunded") else "error" if status >= 400 else "ok"
            self.gateway_requests[result] = self.gateway_requests.get(result, 0) + 1
            for kind in ("input", "output", "cache_read", "cache_write"):
                value = int(data.get(f"{kind}_tokens") or 0)
                self.gateway_tokens[kind] = self.gateway_tokens.get(kind, 0) + value

    def metrics(self) -> Iterator[Metric]:
        """The counters as metric families."""
        steps = CounterMetricFamily(
            "overnight_steps",
            "Steps (agent steps and verifier runs) ended, by how their lease ended.",
            labels=["kind", "outcome"],
        )
        for (kind, outcome), n in sorted(self.steps.items()):
            steps.add_metric([kind, outcome], n)
        yield steps
        hist = HistogramMetricFamily(
            "overnight_step_duration_seconds",
            "How long steps ran, from lease start to the step's end.",
            labels=["kind", "outcome"],
        )
        for key, counts in sorted(self.durations.items()):
            buckets = [(str(b), counts[i]) for i, b in enumerate(BUCKETS)]
            buckets.append(("+Inf", counts[-1]))
            hist.add_metric(list(key), buckets, self.sums.get(key, 0.0))
        yield hist
        ends = CounterMetricFamily(
            "overnight_lease_endings",
            "Lease endings, by final status and reason.",
            labels=["status", "reason"],
        )
        for (status, reason), n in sorted(self.lease_endings.items()):
            ends.add_metric([status, reason], n)
        yield ends
        verdicts = CounterMetricFamily(
            "overnight_verdicts", "Verifier verdicts, by result.", labels=["result"]
        )
        for result, n in sorted(self.verdicts.items()):
            verdicts.add_metric([result], n)
        yield verdicts
        requests = CounterMetricFamily(
            "overnight_gateway_requests",
            "Model requests the gateway metered, by result.",
            labels=["result"],
        )
        for result, n in sorted(self.gateway_requests.items()):
            requests.add_metric([result], n)
        yield requests
        tokens = CounterMetricFamily(
            "overnight_gateway_tokens", "Tokens the gateway metered, by kind.", labels=["kind"]
        )
        for kind, n in sorted(self.gateway_tokens.items()):
            tokens.add_metric([kind], n)
        yield tokens
        yield CounterMetricFamily(
            "overnight_lease_reaped",
            "Leases the reaper ended (their supervisor was gone or late).",
            value=self.reaper_kills,
        )
        yield CounterMetricFamily(
            "overnight_receipts_read", "Receipts folded into these counters.", value=self.receipts
        )


@dataclass
class ReaperTally:
    """Passes and kills of the reaper passes this process makes (``maintain``)."""

    passes: int = 0
    kills: int = 0


REAPER = ReaperTally()


class NightCollector(Collector):
    """Reads Redis at scrape time: gauges directly, counters by folding new receipts."""

    def __init__(self, client: redis.Redis, keys: Keys, worker: str | None = None) -> None:
        self.client, self.keys = client, keys
        self.tally = Tally(worker=worker)
        self.last = "-"
        self.lock = threading.Lock()

    def _read_new(self) -> None:
        from overnight.worker.redisio import receipts

        for _ in range(MAX_BATCHES):
            batch = receipts.read(self.client, self.keys, after=self.last, count=READ_BATCH)
            for rc in batch:
                self.tally.add(rc)
            if batch:
                self.last = batch[-1].id
            if len(batch) < READ_BATCH:
                return

    def collect(self) -> Iterable[Metric]:
        with self.lock:
            try:
                self._read_new()
                gauges = list(self._gauges())
                up = 1
            except Exception as exc:  # Redis away: say so, keep the counters
                log.warning("metrics: cannot read Redis: %s", exc)
                gauges, up = [], 0
            yield GaugeMetricFamily(
                "overnight_redis_up", "1 if the last scrape could read Redis.", value=up
            )
            yield from gauges
            yield from self.tally.metrics()
            if self.tally.worker is None:
                yield CounterMetricFamily(
                    "overnight_reaper_passes",
                    "Reaper passes this process made (host-lost leases).",
                    value=REAPER.passes,
                )
                yield CounterMetricFamily(
                    "overnight_reaper_kills",
                    "Leases this process's reaper passes ended.",
                    value=REAPER.kills,
                )

    def _gauges(self) -> Iterator[Metric]:
        from overnight.worker.envelope.envelope import CallEnvelope

        pipe = self.client.pipeline(transaction=False)
        from overnight.coordinator.tasks.store import TaskStore

        ids = TaskStore(self.client, self.keys).ids()
        for task_id in ids:
            pipe.hget(self.keys.task(task_id), "state")
            pipe.hget(self.keys.task(task_id), "spec")
        rows: list[Any] = pipe.execute() if ids else []
        counts = dict.fromkeys((s.value for s in State), 0)
        envelopes = {"default"}
        for i in range(len(ids)):
            state, spec = rows[2 * i], rows[2 * i + 1]
            if state in counts:
                counts[state] += 1
            if spec:
                with contextlib.suppress(ValueError, AttributeError):
                    envelopes.add(str(json.loads(spec).get("envelope") or "default"))
        tasks = GaugeMetricFamily("overnight_tasks", "Tasks by state.", labels=["state"])
        for state, n in counts.items():
            tasks.add_metric([state], n)
        yield tasks
        remaining = GaugeMetricFamily(
            "overnight_envelope_remaining_calls", "Calls left in the envelope.", labels=["envelope"]
        )
        budget = GaugeMetricFamily(
            "overnight_envelope_budget_calls",
            "The envelope's size at its last reset.",
            labels=["envelope"],
        )
        consumed = GaugeMetricFamily(
            "overnight_envelope_consumed_calls",
            "Calls consumed since the last reset, by kind.",
            labels=["envelope", "kind"],
        )
        tokens = GaugeMetricFamily(
            "overnight_envelope_consumed_tokens",
            "Tokens consumed since the last reset.",
            labels=["envelope"],
        )
        for name in sorted(envelopes):
            state = CallEnvelope(self.client, name, self.keys.namespace).snapshot()
            if not state.exists:
                continue
            remaining.add_metric([name], state.remaining)
            budget.add_metric([name], state.budget)
            consumed.add_metric([name, "model"], state.consumed_model)
            consumed.add_metric([name, "tool"], state.consumed_tool)
            tokens.add_metric([name], state.consumed_tokens)
        yield from (remaining, budget, consumed, tokens)


def serve(client: redis.Redis, keys: Keys, port: int, worker: str | None = None) -> Any:
    """Serve ``/metrics`` on ``port`` (all addresses) from a thread; returns the server
    (``shutdown()`` stops it), or None when the port cannot be had: said on stderr, and the
    night goes on without metrics."""
    import sys

    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(NightCollector(client, keys, worker))
    try:
        server, _thread = start_http_server(port, registry=registry)
    except OSError as exc:
        print(f"overnight: no /metrics on port {port}: {exc.strerror or exc}", file=sys.stderr)
        return None
    log.info("metrics on :%d/metrics (namespace %s)", port, keys.namespace)
    return server


def serve_from_settings(worker: str | None = None) -> Any:
    """Serve ``/metrics`` when ``OVERNIGHT_METRICS_PORT`` is set (a worker: only its own
    tasks' steps); returns the server or None."""
    from overnight.config.context import redis_client, settings
    from overnight.config.keys import Keys

    current = settings()
    if current.metrics_port is None:
        return None
    return serve(redis_client(), Keys(current.namespace), current.metrics_port, worker)
