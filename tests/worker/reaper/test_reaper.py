"""The reaper against a real private redis-server and real process trees."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.lease import proof
from overnight.worker.lease.store import TERMINAL, LeaseDoc, LeaseRefused, Leases
from overnight.worker.reaper.reaper import RECEIPT_KIND, lease_tag, reap_once
from overnight.worker.redisio.receipts import read
from overnight.worker.supervise import procs
from overnight.worker.supervise.procs import TAG_VAR, scan
from tests.helpers import OVERNIGHT, kill_quietly, pid_alive, wait_for

ENDINGS = ("lease_ended", RECEIPT_KIND)


@pytest.fixture
def keys(namespace: str) -> Keys:
    return Keys(namespace)


@pytest.fixture
def leases(r: redis.Redis, keys: Keys) -> Leases:
    return Leases(r, keys)


def tagged(lease_id: str) -> list[int]:
    """Live processes carrying the lease's tag."""
    return [p.pid for p in scan().values() if not p.dead and lease_tag(p.pid) == lease_id]


Spawn = Callable[..., tuple[LeaseDoc, subprocess.Popen[bytes]]]


@pytest.fixture
def spawn(leases: Leases, keys: Keys) -> Iterator[Spawn]:
    """Start ``sh -c SCRIPT`` as a supervised child would be (own session, tagged env),
    attach it to a fresh lease and write the supervisor's proof for it, naming
    ``supervisor_pid``. Everything still tagged is killed afterwards."""
    made: list[tuple[str, subprocess.Popen[bytes]]] = []

    def make(
        script: str, *, gap: float = 0.5, budget: float = 60.0, supervisor_pid: int = 0
    ) -> tuple[LeaseDoc, subprocess.Popen[bytes]]:
        doc = leases.acquire(budget_sec=budget, gap_sec=gap, supervisor_pid=supervisor_pid)
        env = {**os.environ, TAG_VAR: doc.lease_id}
        child = subprocess.Popen(
            ["sh", "-c", script],
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        leases.attach(
            doc.lease_id,
            doc.token,
            pid=child.pid,
            pgid=child.pid,
            start=procs.start_ticks(child.pid),
        )
        ticks = procs.start_ticks(child.pid)
        assert ticks is not None
        sup = procs.start_ticks(supervisor_pid) if supervisor_pid > 0 else None
        assert proof.store(
            keys.namespace,
            proof.Proof(
                doc.lease_id,
                doc.token,
                child.pid,
                child.pid,
                ticks,
                procs.boot_id(),
                supervisor_pid,
                sup or 0,
            ),
        )
        made.append((doc.lease_id, child))
        fresh = leases.get(doc.lease_id)
        assert fresh is not None
        return fresh, child

    yield make
    for lease_id, child in made:
        proof.remove(keys.namespace, lease_id)
        for pid in tagged(lease_id):
            kill_quietly(pid)
        kill_quietly(child.pid)
        child.wait(5)


def lapse(leases: Leases, doc: LeaseDoc, timeout: float = 5.0) -> None:
    wait_for(lambda: not leases.is_alive(doc.lease_id), timeout=timeout)


def endings(r: redis.Redis, keys: Keys, lease_id: str) -> list[str]:
    return [rc.kind for rc in read(r, keys) if rc.lease_id == lease_id and rc.kind in ENDINGS]


def terminal(leases: Leases, lease_id: str) -> LeaseDoc | None:
    doc = leases.get(lease_id)
    return doc if doc is not None and doc.status in TERMINAL else None


def read_pids(path: Path) -> list[int]:
    wait_for(lambda: path.exists() and len(path.read_text().split()) >= 2, timeout=5)
    return [int(x) for x in path.read_text().split()]


def test_orphaned_tree_with_a_setsid_grandchild_is_killed_and_reaped(
    r: redis.Redis, keys: Keys, leases: Leases, spawn: Spawn, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    doc, child = spawn(
        f"setsid sleep 300 & echo $! > {pids}.tmp; sleep 300 & echo $! >> {pids}.tmp; "
        f"mv {pids}.tmp {pids}; while :; do echo tick; sleep 0.1; done",
        supervisor_pid=2**22 + 7,  # a supervisor that is gone
    )
    grandchild, background = read_pids(pids)
    # `setsid` forks before it calls setsid(2): wait until it has.
    wait_for(lambda: os.getsid(grandchild) != os.getsid(child.pid), timeout=5)
    lapse(leases, doc)
    report = reap_once(r, keys, grace=1.0)
    assert report.ended == 1 and report.survivors == 0
    assert report.signalled >= 3
    child.wait(5)
    for pid in (grandchild, background):
        wait_for(lambda pid=pid: not pid_alive(pid), timeout=2)  # type: ignore[misc]
    assert tagged(doc.lease_id) == []
    ended = leases.get(doc.lease_id)
    assert ended is not None and ended.status == "killed"
    assert ended.note.startswith("reaped: heartbeat-gap-")
    assert ended.note.endswith("supervisor-gone")
    assert endings(r, keys, doc.lease_id) == [RECEIPT_KIND]


def test_reused_pid_is_ended_without_signalling_the_stranger(
    r: redis.Redis, keys: Keys, leases: Leases
) -> None:
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        wait_for(lambda: procs.start_ticks(stranger.pid) is not None)
        doc = leases.acquire(budget_sec=60, gap_sec=0.3)
        real = procs.start_ticks(stranger.pid)
        assert real is not None
        # The lease names this pid but a process that started earlier: the pid was reused.
        leases.attach(doc.lease_id, doc.token, pid=stranger.pid, pgid=stranger.pid, start=real - 10)
        lapse(leases, doc)
        report = reap_once(r, keys, grace=0.5)
        assert report.ended == 1 and report.signalled == 0
        ended = leases.get(doc.lease_id)
        assert ended is not None and ended.status == "killed"
        # No supervisor wrote a proof for it: nothing is signalled, whatever Redis says.
        assert ended.note.startswith("reaped: ") and ended.note.endswith("unproven: no proof")
        time.sleep(0.2)
        assert stranger.poll() is None and pid_alive(stranger.pid)
    finally:
        stranger.kill()
        stranger.wait()


def test_past_its_deadline_is_reaped_as_expired(
    r: redis.Redis, keys: Keys, leases: Leases, spawn: Spawn
) -> None:
    doc, child = spawn("while :; do sleep 0.1; done", budget=0.6, gap=30)
    lapse(leases, doc)
    reap_once(r, keys, grace=1.0)
    assert child.wait(5) is not None
    ended = leases.get(doc.lease_id)
    assert ended is not None and ended.status == "expired"
    assert ended.note.startswith("reaped: budget-exceeded")
    assert endings(r, keys, doc.lease_id) == [RECEIPT_KIND]


def test_host_lost_is_ended_killed_without_any_signal(
    r: redis.Redis, keys: Keys, leases: Leases, spawn: Spawn
) -> None:
    doc, child = spawn("sleep 60")
    # Same pid and tag, but the lease says another host: nothing here may be signalled.
    r.hset(keys.lease(doc.lease_id), "host", "ghost-host")
    lapse(leases, doc)
    report = reap_once(r, keys, grace=0.5)
    assert report.ended == 1 and report.signalled == 0
    ended = leases.get(doc.lease_id)
    assert ended is not None and (ended.status, ended.note) == ("killed", "reaped: host-lost")
    assert child.poll() is None
    assert endings(r, keys, doc.lease_id) == [RECEIPT_KIND]


def test_another_host_with_a_live_reaper_is_left_to_it(
    r: redis.Redis, keys: Keys, leases: Leases
) -> None:
    doc = leases.acquire(budget_sec=60, gap_sec=0.2)
    r.hset(keys.lease(doc.lease_id), "host", "busy-host")
    r.set(keys.reaper_host("busy-host"), "1", px=30_000)
    lapse(leases, doc)
    report = reap_once(r, keys, grace=0.5)
    assert (report.lapsed, report.skipped, report.ended) == (1, 1, 0)
    still = leases.get(doc.lease_id)
    assert still is not None and still.status == "running"
    assert r.zscore(keys.lease_expiry, doc.lease_id) is not None


def test_a_present_supervisor_is_given_its_hold_off(
    r: redis.Redis, keys: Keys, leases: Leases, spawn: Spawn
) -> None:
    # The test process is the child's parent, so it plays a live (slow) supervisor.
    doc, child = spawn("sleep 60", supervisor_pid=os.getpid())
    lapse(leases, doc)
    report = reap_once(r, keys, grace=0.5, hold_off=30.0)
    assert (report.skipped, report.ended) == (1, 0) and child.poll() is None
    report = reap_once(r, keys, grace=0.5, hold_off=0.0)
    assert report.ended == 1
    child.wait(5)
    ended = leases.get(doc.lease_id)
    assert ended is not None and ended.note.endswith("supervisor-stuck")


@pytest.mark.parametrize("rival", ["supervisor", "reaper"])
def test_racing_enders_write_exactly_one_terminal_status(
    r: redis.Redis, keys: Keys, leases: Leases, spawn: Spawn, rival: str
) -> None:
    docs = [spawn("sleep 60", gap=0.3)[0] for _ in range(6)]
    for doc in docs:
        lapse(leases, doc)
    won: dict[str, list[str]] = {d.lease_id: [] for d in docs}
    start = threading.Barrier(2)

    def supervisor() -> None:
        start.wait()
        for doc in docs:
            try:
                leases.end(doc.lease_id, doc.token, "killed", "heartbeat-gap-0.3s")
                won[doc.lease_id].append("supervisor")
            except LeaseRefused:
                pass

    def reaper() -> None:
        client = redis.Redis(connection_pool=r.connection_pool)
        start.wait()
        for action in reap_once(client, keys, grace=0.5).actions:
            if action.outcome == "reaped":
                won[action.lease_id].append("reaper")

    other = supervisor if rival == "supervisor" else reaper
    threads = [threading.Thread(target=reaper), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(len(w) == 1 for w in won.values()), won
    before = {d.lease_id: leases.get(d.lease_id) for d in docs}
    reap_once(r, keys, grace=0.5)
    for doc in docs:
        now = leases.get(doc.lease_id)
        assert now is not None and now.status in TERMINAL
        assert now == before[doc.lease_id]
        assert len(endings(r, keys, doc.lease_id)) == 1
        with pytest.raises(LeaseRefused):
            leases.end(doc.lease_id, doc.token, "done", "late")


# --- the command ------------------------------------------------------------------------------


def test_once_exits_zero_and_keeps_a_host_key(
    env: dict[str, str], r: redis.Redis, keys: Keys
) -> None:
    done = subprocess.run(
        [OVERNIGHT, "reaper", "--once"], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    ttl = r.pttl(keys.reaper_host(procs.hostname()))
    assert ttl > 0


def test_redis_unreachable_at_start_is_exit_69_in_one_line(env: dict[str, str]) -> None:
    from overnight.coordinator.night.embedded_redis import free_port

    bad = {**env, "OVERNIGHT_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    done = subprocess.run(
        [OVERNIGHT, "reaper", "--once"], env=bad, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 69
    assert len(done.stderr.strip().splitlines()) == 1 and "Redis unreachable" in done.stderr


def test_bad_interval_is_a_usage_error(env: dict[str, str]) -> None:
    done = subprocess.run(
        [OVERNIGHT, "reaper", "--interval", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 64


def start_reaper(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [OVERNIGHT, "reaper", "--interval", "0.5", "--grace", "1", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop_reaper(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        _out, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        _out, err = proc.communicate()
    return proc.returncode, err


def test_running_reaper_ends_an_orphan_within_gap_plus_interval(
    env: dict[str, str], keys: Keys, leases: Leases, spawn: Spawn, tmp_path: Path
) -> None:
    reaper = start_reaper(env)
    try:
        wait_for(lambda: leases.client.exists(keys.reaper_host(procs.hostname())), timeout=10)
        pids = tmp_path / "pids"
        gap = 1.0
        doc, child = spawn(
            f"setsid sleep 300 & echo $! > {pids}.tmp; echo $$ >> {pids}.tmp; "
            f"mv {pids}.tmp {pids}; while :; do echo tick; sleep 0.1; done",
            gap=gap,
            supervisor_pid=2**22 + 9,
        )
        grandchild, _ = read_pids(pids)
        # How soon (gap + interval) is bench.reaper's orphan latency; here: that it happens.
        wait_for(lambda: child.poll() is not None and not pid_alive(grandchild), timeout=30)
        ended = wait_for(lambda: terminal(leases, doc.lease_id))
        assert ended is not None
        assert ended.status == "killed" and ended.note.startswith("reaped: ")
    finally:
        code, err = stop_reaper(reaper)
    assert code == 0, err
    assert f"lease={doc.lease_id}" in err and "reaped" in err


def test_sigkilled_supervisor_leaves_nothing_behind(
    env: dict[str, str], keys: Keys, leases: Leases, tmp_path: Path
) -> None:
    gap = 1.0
    pids = tmp_path / "pids"
    lease_id = "reaper-supervise-1"
    # The child ignores SIGPIPE, so it keeps printing after its supervisor's pipe is gone:
    # it would never die of anything but the reaper.
    script = (
        f"trap '' PIPE; setsid sleep 300 & echo $! > {pids}.tmp; echo $$ >> {pids}.tmp; "
        f"mv {pids}.tmp {pids}; while :; do echo tick; sleep 0.1; done"
    )
    # The reaper's own proof, without the sandbox: bwrap's --die-with-parent would end the
    # tree with its supervisor and hide whether the reaper did (and the pids it writes
    # must be the host's).
    env = {**env, "OVERNIGHT_SANDBOX": "off"}
    reaper = start_reaper(env)
    supervisor = subprocess.Popen(
        [
            OVERNIGHT,
            "supervise",
            "--quiet",
            "--gap",
            str(gap),
            "--grace",
            "1",
            "--lease-id",
            lease_id,
            "--",
            "sh",
            "-c",
            script,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        grandchild, child = read_pids(pids)
        wait_for(lambda: os.getsid(grandchild) != os.getsid(child), timeout=5)  # setsid ran
        assert lease_tag(grandchild) == lease_id
        time.sleep(0.5)  # several beats land
        assert leases.is_alive(lease_id) and pid_alive(child)
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(5)
        # How soon (gap + interval) is bench.reaper's orphan latency; here: that it happens.
        wait_for(lambda: not pid_alive(child) and not pid_alive(grandchild), timeout=30)
        assert tagged(lease_id) == []
        ended = wait_for(lambda: terminal(leases, lease_id), timeout=5)
        assert ended is not None and ended.status == "killed"
        assert ended.note.startswith("reaped: heartbeat-gap-")
        assert endings(leases.client, keys, lease_id) == [RECEIPT_KIND]
    finally:
        supervisor.kill()
        supervisor.wait(5)
        for pid in tagged(lease_id):
            kill_quietly(pid)
        code, err = stop_reaper(reaper)
    assert code == 0, err


@pytest.mark.slow
def test_reaper_survives_a_redis_outage(
    redis_factory: Callable[..., object], tmp_path: Path, env: dict[str, str], namespace: str
) -> None:
    from overnight.coordinator.night.embedded_redis import EmbeddedRedis

    server = redis_factory()
    assert isinstance(server, EmbeddedRedis)
    reaper = start_reaper({**env, "OVERNIGHT_REDIS_URL": server.url})
    client = redis.Redis.from_url(server.url, decode_responses=True)
    keys = Keys(namespace)
    try:
        host_key = keys.reaper_host(procs.hostname())
        wait_for(lambda: client.exists(host_key), timeout=10)
        server.stop(kill=True)
        time.sleep(1.5)
        assert reaper.poll() is None
        server.start()
        client.delete(host_key)
        wait_for(lambda: client.exists(host_key), timeout=10)
        leases = Leases(client, keys)
        doc = leases.acquire(budget_sec=60, gap_sec=0.2)
        client.hset(keys.lease(doc.lease_id), "host", "ghost-host")
        wait_for(lambda: terminal(leases, doc.lease_id), timeout=10)
    finally:
        code, err = stop_reaper(reaper)
        client.close()
    assert code == 0, err
    assert "Redis unavailable" in err and "available again" in err
