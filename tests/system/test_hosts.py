"""Several hosts around one Redis (tests/hosts.py): one budget exact across hosts, a host
killed whole, a host cut off and joined again; a trace of every run of every task shows
no two runs of one task alive at once."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from overnight.config.keys import Keys
from tests.helpers import lacking, task_file, wait_for
from tests.hosts import Cluster, cluster, namespaces_refused, overlaps, runs, write_agent

pytestmark = pytest.mark.slow

REFUSED = namespaces_refused()
HOST_TTL = 2.0  # tests.hosts.FAST's OVERNIGHT_REAPER_HOST_TTL


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Any]:
    if REFUSED:
        lacking(REFUSED)
    stack: list[Any] = []

    def make(hosts: int) -> Cluster:
        # What these tests prove is the fleet's: one budget, host loss, no run twice at once.
        # Their witness is one trace every run of every task appends to, with its host's
        # name: exactly the cross-task channel a sandbox closes (its proof is in
        # tests/worker/sandbox; tests/system/test_remote_hosts.py runs hosts sandboxed).
        cm = cluster(tmp_path, hosts, {"OVERNIGHT_SANDBOX": "off"})
        made = cm.__enter__()
        stack.append(cm)
        return made

    yield make
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


def submit(c: Cluster, *files: Path) -> list[str]:
    proc = c.coordinator("submit", *map(str, files))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def states(c: Cluster, ids: list[str]) -> dict[str, str]:
    keys = Keys(c.namespace)
    return {t: c.client.hget(keys.task(t), "state") or "" for t in ids}  # type: ignore[misc]


def status(c: Cluster, task_id: str) -> dict[str, Any]:
    proc = c.coordinator("status", task_id)
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def envelope(c: Cluster) -> dict[str, Any]:
    proc = c.coordinator("envelope", "status")
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def leases(c: Cluster) -> list[dict[str, str]]:
    keys = Keys(c.namespace)
    ids = c.client.zrange(keys.leases, 0, -1)
    return [c.client.hgetall(keys.lease(i)) for i in ids]  # type: ignore[misc]


def running_on(c: Cluster, host: Any) -> list[dict[str, str]]:
    return [d for d in leases(c) if d["host"] == host.host_id and d["status"] == "running"]


def agent_task(folder: Path, name: str, trace: Path, secs: float, **kw: Any) -> Path:
    agent = [sys.executable, str(write_agent(folder)), str(trace), name, str(secs)]
    return task_file(folder, name, agent, kw.pop("rules", [["test", "-f", "ok.txt"]]), **kw)


def test_one_budget_across_three_hosts(make_cluster: Any, tmp_path: Path) -> None:
    c: Cluster = make_cluster(3)
    trace = tmp_path / "trace.txt"
    assert c.coordinator("envelope", "reset", "36").returncode == 0
    files = [
        agent_task(tmp_path, f"spend-{i}", trace, 0.1, rules=[["false"]], max_calls=50)
        for i in range(6)
    ]
    for host in c.hosts:
        c.start_worker(host, reaper=True)
        c.start_worker(host, reaper=False)
    wait_for(lambda: all(c.reaper_up(h) for h in c.hosts), timeout=30)
    ids = submit(c, *files)

    def drained() -> bool:
        return all(s == "halted_at_call_ceiling" for s in states(c, ids).values())

    try:  # seconds on a quiet machine; within the test's own 60 s timeout
        wait_for(drained, timeout=50, interval=0.2)
    except AssertionError:
        raise AssertionError(f"not every task ran dry: {states(c, ids)}") from None
    used = [status(c, t)["calls_used"] for t in ids]
    env = envelope(c)
    consumed = env["consumed_model"] + env["consumed_tool"]
    print(
        f"\nhosts figure: 3 hosts x 2 workers, envelope 36: consumed {consumed}, "
        f"tasks' calls_used {sum(used)} {used}, remaining {env['remaining']}"
    )
    assert (consumed, sum(used), env["remaining"]) == (36, 36, 0)
    hosts = {r.host for r in runs(trace)}
    assert len(hosts) >= 2, hosts  # the work was shared
    assert not overlaps(runs(trace))


def test_a_host_killed_whole_is_ended_host_lost_and_its_tasks_finish_elsewhere(
    make_cluster: Any, tmp_path: Path
) -> None:
    c: Cluster = make_cluster(3)
    trace = tmp_path / "trace.txt"
    assert c.coordinator("envelope", "reset", "100").returncode == 0
    doomed = c.hosts[0]
    for host in c.hosts:
        c.start_worker(host, reaper=True)
    wait_for(lambda: all(c.reaper_up(h) for h in c.hosts), timeout=30)
    files = [
        agent_task(tmp_path, f"dies-{i}", trace, 4.0, on_unknown="retry", heartbeat_gap=1)
        for i in range(4)
    ]
    ids = submit(c, *files)
    running = wait_for(lambda: running_on(c, doomed), timeout=30)
    killed_at = c.kill_host(doomed)
    assert not c.pids(doomed.netns)
    # Every lease that could have been running when the host died (one may have started
    # between the look and the kill).
    keys = Keys(c.namespace)

    def ended() -> list[dict[str, str]] | None:
        docs = [
            d
            for d in leases(c)
            if d["host"] == doomed.host_id
            and (d["status"] == "running" or float(d["ended_unix"]) > killed_at)
        ]
        return docs if all(d["status"] != "running" for d in docs) else None

    docs = wait_for(ended, timeout=30, interval=0.1)
    assert {d["lease_id"] for d in running} <= {d["lease_id"] for d in docs}
    assert all((d["status"], d["note"]) == ("killed", "reaped: host-lost") for d in docs), docs
    assert not c.client.exists(keys.reaper_host(doomed.host_id))
    latency = max(float(d["ended_unix"]) for d in docs) - killed_at
    print(
        f"\nhosts figure: a host killed whole: its leases ended host-lost {latency:.2f}s "
        f"after the kill (host TTL {HOST_TTL}s)"
    )
    assert latency <= 2 * HOST_TTL
    wait_for(lambda: all(s == "finished_verified" for s in states(c, ids).values()), timeout=40)
    all_runs = runs(trace)
    task = running[0]["task_id"]
    later = [r for r in all_runs if r.task == task and r.host != doomed.host_id]
    assert later, all_runs  # the killed host's task was run again elsewhere
    assert not overlaps(all_runs), overlaps(all_runs)
    used = sum(status(c, t)["calls_used"] for t in ids)
    env = envelope(c)
    assert env["consumed_model"] + env["consumed_tool"] == used == 100 - env["remaining"]


def test_a_cut_off_host_fails_closed_and_never_runs_a_task_twice_at_once(
    make_cluster: Any, tmp_path: Path
) -> None:
    c: Cluster = make_cluster(2)
    trace = tmp_path / "trace.txt"
    assert c.coordinator("envelope", "reset", "100").returncode == 0
    cut, other = c.hosts
    c.start_worker(cut, reaper=True)
    path = agent_task(tmp_path, "cut", trace, 12.0, on_unknown="retry", heartbeat_gap=3)
    ids = submit(c, path)
    wait_for(lambda: [r for r in runs(trace) if r.host == cut.host_id], timeout=30)
    c.start_worker(other, reaper=True)
    wait_for(lambda: all(c.reaper_up(h) for h in c.hosts), timeout=30)
    cut_at = c.cut(cut)
    wait_for(lambda: [r for r in runs(trace) if r.host == other.host_id], timeout=40)
    cut_runs = [r for r in runs(trace) if r.host == cut.host_id]
    assert cut_runs and all(r.end < time.time() for r in cut_runs)
    wait_for(lambda: "lease lost" in cut.log_text(), timeout=10)
    joined_at = c.join(cut)
    wait_for(lambda: states(c, ids)["cut"] == "finished_verified", timeout=40)
    all_runs = runs(trace)
    assert not overlaps(all_runs), overlaps(all_runs)
    first = min(r.start for r in all_runs if r.host == other.host_id)
    last = max(r.end for r in cut_runs)
    print(
        f"\nhosts figure: a cut-off host's step ended {last - cut_at:.2f}s after the cut; "
        f"the task ran again elsewhere {first - last:.2f}s after that"
    )
    # The cut-off host comes back by itself: its reaper beats again and it takes new work.
    wait_for(lambda: c.reaper_up(cut), timeout=30)
    c.kill_host(other)
    again = agent_task(tmp_path, "again", trace, 0.2)
    submit(c, again)
    wait_for(lambda: states(c, ["again"])["again"] == "finished_verified", timeout=40)
    assert any(r.task == "again" and r.host == cut.host_id for r in runs(trace))
    tokens = [int(d["token"]) for d in leases(c)]
    assert len(tokens) == len(set(tokens))  # no fencing token repeats
    assert joined_at > cut_at


def test_one_budget_of_calls_and_tokens_through_each_hosts_gateway(
    make_cluster: Any, tmp_path: Path
) -> None:
    c: Cluster = make_cluster(3)
    trace = tmp_path / "trace.txt"
    assert c.coordinator("envelope", "reset", "30").returncode == 0
    agent = [sys.executable, str(write_agent(tmp_path, gateway=True)), str(trace)]
    files = [
        task_file(tmp_path, f"gw-{i}", [*agent, f"gw-{i}", "2"], [["false"]], max_calls=50)
        for i in range(6)
    ]
    for host in c.hosts:
        c.start_upstream(host)
        c.start_worker(host, reaper=True)
        c.start_worker(host, reaper=False)
    wait_for(lambda: all(c.reaper_up(h) for h in c.hosts), timeout=30)
    # Every worker waits for work, its gateway up, so every host takes some of the tasks.
    wait_for(lambda: all(c.idle_workers(h) == 2 for h in c.hosts), timeout=30)
    ids = submit(c, *files)

    def drained() -> bool:
        return all(s == "halted_at_call_ceiling" for s in states(c, ids).values())

    try:  # seconds on a quiet machine; within the test's own 60 s timeout
        wait_for(drained, timeout=50, interval=0.2)
    except AssertionError:
        raise AssertionError(f"not every task ran dry: {states(c, ids)}") from None
    used = [status(c, t)["calls_used"] for t in ids]
    env = envelope(c)
    consumed = env["consumed_model"] + env["consumed_tool"]
    keys = Keys(c.namespace)
    receipts = c.client.xrange(keys.receipts)
    calls = [f for _, f in receipts if '"model_call"' in json.dumps(f)]
    print(
        f"\nhosts figure: 3 hosts' gateways, envelope 30: consumed {consumed} (model "
        f"{env['consumed_model']}, tool {env['consumed_tool']}), tasks' calls_used "
        f"{sum(used)}, tokens {env.get('consumed_tokens', 0)} for {len(calls)} requests"
    )
    # Model calls were made, on every host through its own gateway: each host's upstream
    # (on that host's loopback, which only its own gateway reaches) answered as many
    # requests as that host's model_call receipts say.
    metered = Counter(json.loads(f["data"])["host"] for f in calls)
    answered = {
        h.host_id: sum(p.endswith("/chat/completions") for p in c.upstream_requests(h))
        for h in c.hosts
    }
    assert answered == dict(metered) and all(answered.values()), (answered, metered)
    assert (consumed, sum(used), env["remaining"]) == (30, 30, 0)
    assert env["consumed_tokens"] == len(calls) * (11 + 7)  # the scripted upstream's usage
    assert len({r.host for r in runs(trace)}) >= 2  # the work was shared
