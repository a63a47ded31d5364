"""The reaper signals only proven members: a lease forged in Redis, naming real processes with
their real start time and boot id, is ended without a single signal; a real lease whose
supervisor was SIGKILLed is still reaped, through the proof its supervisor left."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.lease import proof
from overnight.worker.lease.store import TERMINAL, LeaseDoc, Leases
from overnight.worker.reaper.reaper import RECEIPT_KIND
from overnight.worker.redisio.receipts import read
from overnight.worker.supervise import procs
from tests.helpers import OVERNIGHT, kill_quietly, pid_alive, wait_for


@pytest.fixture
def keys(namespace: str) -> Keys:
    return Keys(namespace)


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """A sacrificial process standing in for redis-server (or anything else on the host)."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    wait_for(lambda: procs.start_ticks(proc.pid) is not None, timeout=5)
    yield proc
    proc.kill()
    proc.wait(5)


def forge(
    r: redis.Redis,
    keys: Keys,
    pid: int,
    *,
    lease_id: str | None = None,
    token: int = 1_700_000_000_000_001,
) -> str:
    """Write a lapsed running lease straight into Redis, as a step with Redis access could:
    it names ``pid`` with its real start time, pgid, boot id and this host."""
    lease_id = lease_id or f"forged-{uuid.uuid4().hex[:8]}"
    ticks = procs.start_ticks(pid)
    assert ticks is not None
    secs, _micros = r.time()
    now = float(secs)
    r.hset(
        keys.lease(lease_id),
        mapping={
            "lease_id": lease_id,
            "token": str(token),
            "holder_pid": str(pid),
            "pgid": str(pid),
            "host": procs.hostname(),
            "budget_sec": "600",
            "started_unix": f"{now - 60:.6f}",
            "deadline_unix": f"{now + 540:.6f}",
            "heartbeat_unix": f"{now - 30:.6f}",
            "heartbeat_max_gap_sec": "5",
            "status": "running",
            "note": "boot",
            "exit_code": "",
            "ended_unix": "",
            "supervisor_pid": str(2**22 + 11),
            "child_start_ticks": str(ticks),
            "boot_id": procs.boot_id(),
            "task_id": "",
        },
    )
    r.zadd(keys.lease_expiry, {lease_id: (now - 25) * 1000})
    return lease_id


def reaper_once(env: dict[str, str], url: str) -> str:
    done = subprocess.run(
        [OVERNIGHT, "reaper", "--once", "-v", "--grace", "0.5"],
        env={**env, "OVERNIGHT_REDIS_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def ended(r: redis.Redis, keys: Keys, lease_id: str) -> LeaseDoc:
    doc = Leases(r, keys).get(lease_id)
    assert doc is not None and doc.status in TERMINAL
    return doc


def test_a_forged_lease_naming_real_processes_is_ended_without_a_signal(
    env: dict[str, str],
    redis_server: EmbeddedRedis,
    r: redis.Redis,
    keys: Keys,
    victim: subprocess.Popen[bytes],
    redis_factory: Callable[..., EmbeddedRedis],
) -> None:
    target = redis_factory()  # a real redis-server, the step's favourite target
    assert target.proc is not None
    other = redis.Redis.from_url(target.url)
    forged = [forge(r, keys, victim.pid), forge(r, keys, target.proc.pid)]
    log = reaper_once(env, redis_server.url)
    assert "signalled=0" in log and "lapsed=2" in log, log
    assert victim.poll() is None and pid_alive(victim.pid)
    assert target.proc.poll() is None and other.ping()
    for lease_id in forged:
        refusal = [
            line
            for line in log.splitlines()
            if f"lease={lease_id}" in line and "not signalling anything" in line
        ]
        assert len(refusal) == 1 and f"host={procs.hostname()}" in refusal[0], log
        assert "no proof" in refusal[0]
        doc = ended(r, keys, lease_id)
        assert doc.status == "killed" and doc.note.endswith("unproven: no proof")
    kinds = [rc.kind for rc in read(r, keys) if rc.lease_id in forged]
    assert kinds == [RECEIPT_KIND, RECEIPT_KIND]
    other.close()


def test_a_proof_that_names_another_process_is_refused(
    env: dict[str, str],
    redis_server: EmbeddedRedis,
    r: redis.Redis,
    keys: Keys,
    victim: subprocess.Popen[bytes],
) -> None:
    # A real lease with its supervisor's proof, for a child that is no longer there...
    leases = Leases(r, keys)
    doc = leases.acquire(budget_sec=600, gap_sec=0.2)
    child = subprocess.Popen(["true"])
    ticks = procs.start_ticks(child.pid)
    assert ticks is not None
    child.wait(5)
    assert proof.store(
        keys.namespace,
        proof.Proof(
            doc.lease_id, doc.token, child.pid, child.pid, ticks, procs.boot_id(), 2**22 + 12, 0
        ),
    )
    # ...whose document a step rewrote to name the victim (real start time and all).
    wait_for(lambda: not leases.is_alive(doc.lease_id), timeout=5)
    forge(r, keys, victim.pid, lease_id=doc.lease_id, token=doc.token)
    try:
        log = reaper_once(env, redis_server.url)
        assert "signalled=0" in log, log
        assert victim.poll() is None and pid_alive(victim.pid)
        assert f"lease={doc.lease_id}" in log and "proof pid differs" in log
        assert ended(r, keys, doc.lease_id).note.endswith("unproven: proof pid differs")
    finally:
        proof.remove(keys.namespace, doc.lease_id)


def test_a_proof_vouches_only_for_the_document_it_matches() -> None:
    boot = procs.boot_id()
    made = proof.Proof("L1", 7, 4242, 4242, 555, boot, 4000, 400)
    lease = LeaseDoc(
        "L1",
        7,
        60,
        0,
        60,
        0,
        5,
        "running",
        holder_pid=4242,
        pgid=4242,
        child_start_ticks=555,
        boot_id=boot,
    )
    table = [
        ({}, ""),
        ({"lease_id": "L2"}, "proof names another lease"),
        ({"token": 8}, "proof token differs"),
        ({"holder_pid": 1}, "proof pid differs"),
        ({"child_start_ticks": 554}, "proof start time differs"),
        ({"boot_id": "another-boot"}, "proof from another boot"),
        # Never attached (the supervisor died first): the proof alone names the child.
        ({"holder_pid": 0, "pgid": 0, "child_start_ticks": None}, ""),
    ]
    for change, why in table:
        assert proof.mismatch(made, dataclasses.replace(lease, **change)) == why, change
    assert proof.mismatch(dataclasses.replace(made, pid=1), lease) == "proof pid invalid"


def test_a_proof_file_other_users_can_write_is_not_trusted(keys: Keys) -> None:
    made = proof.Proof("loose", 5, 4242, 4242, 99, procs.boot_id(), 1, 1)
    assert proof.store(keys.namespace, made)
    path = proof.path_for(keys.namespace, "loose")
    try:
        assert proof.read(keys.namespace, "loose") == (made, "")
        assert path.stat().st_mode & 0o777 == 0o600
        assert path.parent.stat().st_mode & 0o777 == 0o700
        path.chmod(0o666)
        assert proof.read(keys.namespace, "loose") == (None, "proof writable by others")
        # A lease id is never a path of its own.
        assert proof.path_for(keys.namespace, "../../x").parent == path.parent
    finally:
        proof.remove(keys.namespace, "loose")


def test_a_sigkilled_supervisor_is_still_reaped_through_its_proof(
    env: dict[str, str], redis_server: EmbeddedRedis, r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    lease_id = f"proof-{uuid.uuid4().hex[:8]}"
    script = (
        f"trap '' PIPE; setsid sleep 300 & echo $! > {pids}.tmp; echo $$ >> {pids}.tmp; "
        f"mv {pids}.tmp {pids}; while :; do echo tick; sleep 0.1; done"
    )
    # The reaper's own proof, without the sandbox: bwrap's --die-with-parent would end the
    # tree with its supervisor and hide whether the reaper did (and the pids it writes
    # must be the host's).
    env = {**env, "OVERNIGHT_SANDBOX": "off"}
    supervisor = subprocess.Popen(
        [
            OVERNIGHT,
            "supervise",
            "--quiet",
            "--gap",
            "0.5",
            "--grace",
            "0.5",
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
    found: list[int] = []
    try:
        wait_for(lambda: pids.exists() and len(pids.read_text().split()) >= 2, timeout=10)
        found = [int(p) for p in pids.read_text().split()]
        written, why = proof.read(keys.namespace, lease_id)
        assert written is not None, why
        assert written.pid == found[1] and written.supervisor_pid == supervisor.pid
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(5)
        leases = Leases(r, keys)
        wait_for(lambda: not leases.is_alive(lease_id), timeout=10)
        log = reaper_once(env, redis_server.url)
        wait_for(lambda: not any(pid_alive(p) for p in found), timeout=10)
        doc = ended(r, keys, lease_id)
        assert doc.status == "killed" and doc.note.endswith("supervisor-gone"), log
        assert "not signalling" not in log
        assert not proof.path_for(keys.namespace, lease_id).exists()
    finally:
        supervisor.kill()
        supervisor.wait(5)
        for pid in found:
            kill_quietly(pid)
        proof.remove(keys.namespace, lease_id)


def test_the_reaper_never_signals_itself_or_its_ancestors(keys: Keys) -> None:
    from overnight.worker.reaper.trees import LapsedTrees, Target

    me = procs.read_proc(os.getpid())
    assert me is not None
    # Even a proven lease whose tree would take in this process (and pid 1) leaves them out.
    doc = LeaseDoc(
        "self",
        1,
        60,
        0,
        60,
        0,
        5,
        "running",
        holder_pid=me.pid,
        pgid=me.pgid,
        child_start_ticks=me.start,
    )
    made = proof.Proof("self", 1, me.pid, me.pgid, me.start, procs.boot_id(), 0, 0)
    members = LapsedTrees([Target(doc, made, True)]).members()
    assert not {1, os.getpid(), os.getppid()} & set(members)


def test_a_child_its_supervisor_never_recorded_is_reaped_through_the_proof(
    r: redis.Redis, keys: Keys
) -> None:
    from overnight.worker.reaper.reaper import reap_once

    leases = Leases(r, keys)
    doc = leases.acquire(budget_sec=600, gap_sec=0.2)
    child = subprocess.Popen(
        ["sleep", "300"], start_new_session=True, env={**os.environ, procs.TAG_VAR: doc.lease_id}
    )
    try:
        ticks = wait_for(lambda: procs.start_ticks(child.pid), timeout=5)
        # The supervisor wrote its proof, then died before attaching the child to the lease.
        assert proof.store(
            keys.namespace,
            proof.Proof(
                doc.lease_id, doc.token, child.pid, child.pid, ticks, procs.boot_id(), 2**22 + 13, 0
            ),
        )
        wait_for(lambda: not leases.is_alive(doc.lease_id), timeout=5)
        report = reap_once(r, keys, grace=1.0, host_ttl=None)
        assert report.signalled >= 1 and child.wait(5) is not None
        assert ended(r, keys, doc.lease_id).note.endswith("supervisor-gone")
        assert not proof.path_for(keys.namespace, doc.lease_id).exists()
    finally:
        child.kill()
        child.wait(5)
        proof.remove(keys.namespace, doc.lease_id)
