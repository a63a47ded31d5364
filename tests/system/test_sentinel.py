"""A night survives a Sentinel failover: the primary is SIGKILLed mid-night and every client
(workers, work horses, reaper, CLI) follows the sentinels to the promoted replica.

A private primary, two replicas and three sentinels, all password-protected; twelve tasks
whose steps take a second each run through two RQ workers and a reaper that know only the
``redis+sentinel://`` URL. Once a few tasks are verified the primary is killed; the test
waits for the sentinels to name the replica, then for every task to end. The books balance
(envelope consumed == the tasks' calls), and no step of a task ever ran while another step
of the same task did (each step holds an flock on a file of its task for its whole run).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.coordinator.night.embedded_redis import EmbeddedRedis, find_redis_server, free_port
from tests.helpers import OVERNIGHT, task_file, wait_for

PY = sys.executable
SERVICE = "night"
TASKS = 12
# Holds its task's lock for its whole run; a second step of the same task running at the
# same moment finds it taken and says so in overlap.log.
STEP = (
    "import fcntl, pathlib, time\n"
    "lock = open('step.lock', 'a')\n"
    "try:\n"
    "    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
    "except OSError:\n"
    "    open('overlap.log', 'a').write('two steps at once\\n')\n"
    "time.sleep(1.0)\n"
    "pathlib.Path('ok.txt').touch()\n"
)


def _sentinel_conf(
    port: int, primary: int, password: str, sentinel_password: str, quorum: int
) -> str:
    auth = [f"sentinel auth-pass {SERVICE} {password}"] if password else []
    own = [f"requirepass {sentinel_password}", f"sentinel sentinel-pass {sentinel_password}"]
    own = own if sentinel_password else []
    return "\n".join(
        [
            f"port {port}",
            "bind 127.0.0.1",
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary} {quorum}",
            *auth,
            f"sentinel down-after-milliseconds {SERVICE} 1000",
            f"sentinel failover-timeout {SERVICE} 10000",
            *own,
            "",
        ]
    )


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[Callable[..., list[int]]]:
    """Start sentinels (three by default) watching the primary on a port; all killed after."""
    started: list[subprocess.Popen[bytes]] = []

    def start(primary: int, password: str, sentinel_password: str, count: int = 3) -> list[int]:
        ports = []
        for _ in range(count):
            port = free_port()
            folder = tmp_path / f"sentinel-{len(started)}"
            folder.mkdir()
            conf = folder / "sentinel.conf"
            conf.write_text(
                _sentinel_conf(port, primary, password, sentinel_password, min(2, count))
            )
            conf.chmod(0o600)
            log = open(folder / "sentinel.log", "wb")  # noqa: SIM115 - the child holds it
            started.append(
                subprocess.Popen(
                    [find_redis_server(), str(conf), "--sentinel"],
                    cwd=folder,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            log.close()
            ports.append(port)
        for port in ports:
            wait_for(lambda p=port: _primary_port(p, sentinel_password) == primary, timeout=30)
        return ports

    yield start
    for proc in started:
        proc.kill()
        proc.wait(10)


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def _states(env: dict[str, str]) -> dict[str, str]:
    out = _cli(env, "status")
    assert out.returncode == 0, out.stderr
    rows: list[dict[str, Any]] = json.loads(out.stdout)
    return {row["id"]: row["state"] for row in rows}


def _primary_port(port: int, sentinel_password: str) -> int | None:
    """The port sentinel ``port`` names for the primary now (None: it cannot say)."""
    try:
        with redis.Redis(port=port, password=sentinel_password, socket_timeout=2) as s:
            addr = s.execute_command("SENTINEL", "get-master-addr-by-name", SERVICE)
    except redis.RedisError:
        return None
    return int(addr[1]) if addr else None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_night_survives_a_sentinel_failover(
    redis_factory: Callable[..., EmbeddedRedis],
    sentinels: Callable[..., list[int]],
    env: dict[str, str],
    namespace: str,
    tmp_path: Path,
    procs: list[subprocess.Popen[bytes]],
) -> None:
    password, sentinel_password = uuid.uuid4().hex, uuid.uuid4().hex
    auth = ["--masterauth", password]
    primary = redis_factory(password=password, extra_args=auth)
    # Two replicas: after the failover one is still there to acknowledge spends (WAIT 1).
    follow = [*auth, "--replicaof", "127.0.0.1", str(primary.port)]
    replicas = [redis_factory(password=password, extra_args=follow) for _ in range(2)]
    ports = sentinels(primary.port, password, sentinel_password)

    def watching() -> bool:
        """Every sentinel knows the primary, its replica (in sync) and the other two."""
        for port in ports:
            try:
                with redis.Redis(port=port, password=sentinel_password, socket_timeout=2) as s:
                    reps = s.execute_command("SENTINEL", "replicas", SERVICE)
                    others = s.execute_command("SENTINEL", "sentinels", SERVICE)
            except redis.RedisError:
                return False
            if len(reps) != 2 or len(others) != 2:
                return False
        for replica in replicas:
            with redis.Redis(port=replica.port, password=password) as r:
                if r.info("replication").get("master_link_status") != "up":
                    return False
        return True

    wait_for(watching, timeout=60, interval=0.2)
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    url = f"redis+sentinel://:{password}@{hosts}/{SERVICE}?sentinel_password={sentinel_password}"
    tenv = {
        **env,
        "OVERNIGHT_REDIS_URL": url,
        "OVERNIGHT_QUEUE": namespace,
        "OVERNIGHT_TASK_CLAIM_TTL": "5",
        "OVERNIGHT_RECOVERY_INTERVAL": "1",
        "OVERNIGHT_GRACE": "1",
    }
    reset = _cli(tenv, "envelope", "reset", str(4 * TASKS))
    assert reset.returncode == 0, reset.stderr
    ids = [f"f{i:02d}" for i in range(TASKS)]
    files = [
        task_file(tmp_path, i, [PY, "-c", STEP], [["test", "-f", "ok.txt"]], heartbeat_gap=10)
        for i in ids
    ]
    submitted = _cli(tenv, "submit", *map(str, files))
    assert submitted.returncode == 0, submitted.stderr
    logs = tmp_path / "logs"
    logs.mkdir()
    for name, args in (
        ("worker-1", ["worker"]),
        ("worker-2", ["worker"]),
        ("reaper", ["reaper", "--interval", "0.5"]),
    ):
        out = open(logs / f"{name}.log", "wb")  # noqa: SIM115 - the child holds it
        procs.append(
            subprocess.Popen([OVERNIGHT, *args], env=tenv, stdout=out, stderr=subprocess.STDOUT)
        )
        out.close()

    def some_done() -> bool:
        return sum(s == "finished_verified" for s in _states(tenv).values()) >= 2

    wait_for(some_done, timeout=180, interval=0.3)
    primary.stop(kill=True)

    def promoted() -> bool:
        named = {_primary_port(p, sentinel_password) for p in ports}
        return len(named) == 1 and named <= {r.port for r in replicas}

    wait_for(promoted, timeout=60, interval=0.2)
    states = _states(tenv)
    assert sum(s == "finished_verified" for s in states.values()) < TASKS, (
        "every task ended before the failover: the night met nothing"
    )
    ended = {"finished_verified", "paused_for_reconciliation"}

    def all_ended() -> bool:
        return all(s in ended for s in _states(tenv).values())

    try:
        wait_for(all_ended, timeout=300, interval=1.0)
    except AssertionError:
        raise AssertionError(
            f"tasks not ended after the failover: {_states(tenv)}; logs in {logs}"
        ) from None
    total = sum(int(json.loads(_cli(tenv, "status", i).stdout)["calls_used"]) for i in ids)
    env_state = json.loads(_cli(tenv, "envelope", "status").stdout)
    consumed = int(env_state["consumed_model"]) + int(env_state["consumed_tool"])
    assert consumed == total >= TASKS
    overlaps = [i for i in ids if (tmp_path / i / "overlap.log").exists()]
    assert overlaps == [], f"steps of a task ran at once: {overlaps}"
    assert [p.poll() for p in procs] == [None, None, None], f"a process died; logs in {logs}"
    states = _states(tenv)
    assert list(states.values()).count("finished_verified") > TASKS // 2, states


def _url(password: str, ports: list[int], sentinel_password: str) -> str:
    auth = f":{password}@" if password else ""
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    query = f"?sentinel_password={sentinel_password}" if sentinel_password else ""
    return f"redis+sentinel://{auth}{hosts}/{SERVICE}{query}"


@pytest.mark.timeout(120)
def test_every_client_made_from_a_sentinel_url_reaches_the_primary(
    redis_factory: Callable[..., EmbeddedRedis], sentinels: Callable[..., list[int]]
) -> None:
    """The sync client, its text twin and the password probe's bare twin, and the gateway's
    asyncio pool: each finds the primary through the sentinel, with both passwords."""
    import asyncio

    from overnight.config.connection import (
        anyone_gets_in,
        async_client_from_url,
        client_from_url,
        parse_sentinel_url,
        same_server,
    )
    from overnight.worker.redisio.clients import url_of

    password, sentinel_password = uuid.uuid4().hex, uuid.uuid4().hex
    primary = redis_factory(password=password)
    url = _url(password, sentinels(primary.port, password, sentinel_password, 1), sentinel_password)
    client = client_from_url(url, timeout=2.0, decode_responses=False)
    client.set("k", "v")
    assert parse_sentinel_url(url_of(client)) == parse_sentinel_url(url)
    with same_server(client, decode_responses=True) as twin:
        assert twin.get("k") == "v"
    assert not anyone_gets_in(client)
    client.close()

    async def through_the_pool() -> object:
        aclient = async_client_from_url(url, timeout=2.0, max_connections=4)
        try:
            return await asyncio.gather(*(aclient.get("k") for _ in range(16)))
        finally:
            await aclient.aclose()
            for sentinel in aclient.connection_pool.sentinel_manager.sentinels:  # type: ignore[attr-defined]
                await sentinel.aclose()

    assert asyncio.run(through_the_pool()) == ["v"] * 16
    with (
        client_from_url(url.replace(password, "wrong"), timeout=2.0) as wrong,
        pytest.raises(redis.AuthenticationError),
    ):
        wrong.ping()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("primary_has", "sentinel_has", "refusal"),
    [
        (True, True, None),  # the twin: both with a password, the worker runs
        (False, True, "the Redis at"),
        (True, False, "the sentinel at"),
    ],
)
def test_a_passwordless_primary_or_sentinel_is_refused(
    redis_factory: Callable[..., EmbeddedRedis],
    sentinels: Callable[..., list[int]],
    env: dict[str, str],
    tmp_path: Path,
    primary_has: bool,
    sentinel_has: bool,
    refusal: str | None,
) -> None:
    """``overnight worker`` on a Sentinel URL whose primary or sentinel anyone gets into: one
    line naming it, exit 78, no password printed; its twin with both passwords runs."""
    password = uuid.uuid4().hex if primary_has else ""
    sentinel_password = uuid.uuid4().hex if sentinel_has else ""
    primary = redis_factory(password=password or None)
    ports = sentinels(primary.port, password, sentinel_password, 1)
    wenv = {**env, "OVERNIGHT_REDIS_URL": _url(password, ports, sentinel_password)}
    proc = subprocess.run(
        [OVERNIGHT, "worker", "--burst"],
        env=wenv,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == (78 if refusal else 0), proc.stderr
    if refusal:
        assert refusal in proc.stderr and "answers without a password" in proc.stderr
    else:
        assert "without a password" not in proc.stderr
    for secret in (password, sentinel_password):
        assert not secret or secret not in proc.stderr
