"""Security: TLS, ACL users limited to the namespace, namespace isolation, what a supervised
child can do with its token, and secrets that never show up anywhere."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.night.embedded_redis import EmbeddedRedis, free_port
from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.lease.store import LeaseRefused, Leases
from tests.helpers import OVERNIGHT, Model, task_file

PY = sys.executable
# The agent beats through the CLI and spends from the envelope itself: both must work
# with the same URL (TLS options, ACL user) the worker was given.
AGENT = [
    PY,
    "-c",
    (
        "import subprocess, sys, pathlib\n"
        f"subprocess.run([{OVERNIGHT!r}, 'beat', '--note', 'agent'], check=True)\n"
        "pathlib.Path('ok.txt').touch()\n"
    ),
]


def run(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def exercise(env: dict[str, str], tmp_path: Path, name: str) -> None:
    """supervise (with a beat from the child), envelope consume, and a task on a worker."""
    proc = run(env, "supervise", "--gap", "5", "--", OVERNIGHT, "beat", "--note", "hi")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout[proc.stdout.rfind('{\n  "lease_id"') :])
    assert (doc["status"], doc["note"]) == ("done", "worker-complete")
    assert run(env, "envelope", "reset", "5").returncode == 0
    consume = run(env, "envelope", "consume", "model", "--request-id", "r1")
    assert consume.returncode == 0 and json.loads(consume.stdout)["remaining"] == 4
    path = task_file(tmp_path, name, AGENT, [["test", "-f", "ok.txt"]])
    assert run(env, "submit", str(path)).returncode == 0
    worker = run(env, "worker", "--burst")
    assert worker.returncode == 0, worker.stderr[-3000:]
    status = json.loads(run(env, "status", name).stdout)
    assert status["state"] == "finished_verified", (status, worker.stderr[-3000:])


# --- TLS --------------------------------------------------------------------------------------


@pytest.fixture
def tls_server(tmp_path: Path) -> Any:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    port = free_port()
    # The plain port stays on 127.0.0.1 for EmbeddedRedis's readiness check only.
    password = uuid.uuid4().hex
    server = EmbeddedRedis(
        tmp_path / "tls-redis",
        password=password,
        extra_args=[
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
        ],
    )
    server.start()
    yield port, cert, password
    server.stop(kill=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_everything_runs_over_tls(
    env: dict[str, str], tmp_path: Path, tls_server: tuple[int, Path, str]
) -> None:
    port, cert, password = tls_server
    url = f"rediss://:{password}@127.0.0.1:{port}/0?ssl_ca_certs={cert}&ssl_cert_reqs=required"
    tenv = {**env, "OVERNIGHT_REDIS_URL": url, "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"]}
    assert redis.Redis.from_url(url).ping()
    exercise(tenv, tmp_path, "tls-task")
    # Without the CA the certificate is not trusted: one line, Redis unreachable.
    untrusted = {**tenv, "OVERNIGHT_REDIS_URL": f"rediss://:{password}@127.0.0.1:{port}/0"}
    proc = run(untrusted, "envelope", "status")
    assert proc.returncode == 69 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# --- ACL users ----------------------------------------------------------------------------------


def acl_user(admin: redis.Redis, name: str, password: str, namespace: str) -> None:
    admin.execute_command(
        "ACL",
        "SETUSER",
        name,
        "reset",
        "on",
        f">{password}",
        f"~{{{namespace}}}:*",
        "~rq:*",
        "&*",
        "+@all",
        "-@admin",
        "-@dangerous",
        "+info",
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_acl_user_limited_to_its_namespace_runs_everything_and_nothing_else(
    env: dict[str, str], tmp_path: Path, redis_factory: Any, namespace: str
) -> None:
    server = redis_factory()
    admin = redis.Redis.from_url(server.url, decode_responses=True)
    other = f"{namespace}-other"
    acl_user(admin, "night", "s3cret-pw", namespace)
    acl_user(admin, "day", "other-pw", other)
    url = f"redis://night:s3cret-pw@127.0.0.1:{server.port}/0"
    tenv = {**env, "OVERNIGHT_REDIS_URL": url, "OVERNIGHT_QUEUE": namespace}
    exercise(tenv, tmp_path, "acl-task")

    # The other namespace's records, written by its own user.
    day = redis.Redis.from_url(
        f"redis://day:other-pw@127.0.0.1:{server.port}/0", decode_responses=True
    )
    theirs = Leases(day, Keys(other)).acquire(budget_sec=600, gap_sec=600)
    CallEnvelope(day, "default", other).reset(9)
    night = redis.Redis.from_url(url, decode_responses=True)
    with pytest.raises(redis.exceptions.NoPermissionError):
        night.hgetall(Keys(other).lease(theirs.lease_id))
    with pytest.raises(redis.exceptions.NoPermissionError):
        Leases(night, Keys(other)).beat(theirs.lease_id, theirs.token)
    with pytest.raises(redis.exceptions.NoPermissionError):
        night.hset(Keys(other).envelope("default"), "remaining", 1000)
    with pytest.raises(redis.exceptions.NoPermissionError):
        night.execute_command("FLUSHALL")
    # The CLI of the limited user pointed at the other namespace: refused, one line.
    proc = run({**tenv, "OVERNIGHT_NAMESPACE": other}, "envelope", "consume", "model")
    assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr
    # A permission refusal is a configuration problem: exit 78, one line, no secret.
    proc = run({**tenv, "OVERNIGHT_NAMESPACE": other}, "lease", "show", theirs.lease_id)
    assert proc.returncode == 78, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "s3cret-pw" not in proc.stderr
    assert CallEnvelope(day, "default", other).snapshot().remaining == 9
    assert Leases(day, Keys(other)).get(theirs.lease_id).status == "running"  # type: ignore[union-attr]


# --- namespaces isolate -----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_namespace_a_cannot_read_beat_end_or_spend_anything_of_b(
    env: dict[str, str], r: redis.Redis, namespace: str
) -> None:
    a, b = Keys(namespace), Keys(f"{namespace}-b")
    lease_b = Leases(r, b).acquire(budget_sec=600, gap_sec=600)
    lapsed_b = Leases(r, b).acquire(budget_sec=600, gap_sec=0.05)
    r.delete(b.lease_alive(lapsed_b.lease_id))
    CallEnvelope(r, "default", b.namespace).reset(5)
    r.hset(b.task("tb"), mapping={"id": "tb", "state": "paused_for_reconciliation"})
    before = {k: r.dump(k) for k in r.keys(b.prefix + ":*")}

    leases_a = Leases(r, a)
    assert leases_a.get(lease_b.lease_id) is None
    for attempt in (
        lambda: leases_a.beat(lease_b.lease_id, lease_b.token),
        lambda: leases_a.set_note(lease_b.lease_id, lease_b.token, "mine"),
        lambda: leases_a.end(lease_b.lease_id, lease_b.token, "done", "forged"),
    ):
        with pytest.raises(LeaseRefused) as refused:
            attempt()
        assert refused.value.reason == "unknown"
    env_a = {**env, "OVERNIGHT_NAMESPACE": a.namespace}
    # `overnight beat` holds no Redis client at all: without its supervisor's channel it is
    # no lease, whatever ids and tokens the environment names.
    beat = subprocess.run(
        [OVERNIGHT, "beat"],
        capture_output=True,
        text=True,
        timeout=30,
        env={
            **env_a,
            "OVERNIGHT_LEASE_ID": lease_b.lease_id,
            "OVERNIGHT_LEASE_TOKEN": str(lease_b.token),
        },
    )
    assert beat.returncode == 64, beat.stderr
    for args, code in [
        (["lease", "show", lease_b.lease_id], 64),
        (["envelope", "consume", "model"], 2),
        (["status", "tb"], 64),
        (["reconcile", "tb", "--abort"], 64),
        (["reconcile", "tb", "--resume"], 64),
        (["reaper", "--once"], 0),
    ]:
        proc = run(env_a, *args)
        assert proc.returncode == code, (args, proc.stderr)
    assert {k: r.dump(k) for k in r.keys(b.prefix + ":*")} == before


# --- a supervised child that reached Redis anyway ---------------------------------------------

# A step gets no Redis URL and no token (tests/test_containment_env.py); here it learned the
# URL some other way (argv stands in for the leak) and reads its own token from its lease
# record: the scripts still refuse every forged write.
CHILD = """
import json, os, sys
import redis
from overnight.config.keys import Keys
from overnight.worker.lease.store import LeaseRefused, Leases
assert "OVERNIGHT_LEASE_TOKEN" not in os.environ and "OVERNIGHT_REDIS_URL" not in os.environ
other, other_token, url, namespace = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
own = os.environ["OVERNIGHT_LEASE_ID"]
client = redis.Redis.from_url(url, decode_responses=True)
token = int(client.hget(Keys(namespace).lease(own), "token"))
leases = Leases(client, Keys(namespace))
tries = {
    "beat other with own token": lambda: leases.beat(other, token),
    "end other with own token": lambda: leases.end(other, token, "done", "forged"),
    "note other with own token": lambda: leases.set_note(other, token, "forged"),
    "end other with a guessed token": lambda: leases.end(other, other_token + 1, "done", "x"),
    "end own with a guessed token": lambda: leases.end(own, token + 1, "done", "forged"),
    "end own with an older token": lambda: leases.end(own, other_token, "done", "forged"),
    "beat own with a stale token": lambda: leases.beat(own, token - 1),
    "end own with its own token": lambda: leases.end(own, token, "done", "forged"),
    "end own as the reaper would": lambda: _first(leases.reap([(own, token, "done", "forged")])),
}
refused = {}
def _first(reasons):
    if reasons[0] is not None:
        raise LeaseRefused(own, reasons[0])
for name, attempt in tries.items():
    try:
        attempt()
        refused[name] = "ALLOWED"
    except LeaseRefused as exc:
        refused[name] = exc.reason
print(json.dumps(refused), flush=True)
"""


@pytest.mark.timeout(60)
def test_a_supervised_child_cannot_forge_ends_or_beat_another_lease(
    env: dict[str, str], r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    keys = Keys(namespace)
    victim = Leases(r, keys).acquire(budget_sec=600, gap_sec=600)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    # Given the Redis URL and a network to reach it (OVERNIGHT_SANDBOX=off gives both; a
    # sandboxed step has neither), the lease scripts still refuse a forged end or beat.
    env = {**env, "OVERNIGHT_SANDBOX": "off"}
    proc = subprocess.run(
        [
            OVERNIGHT,
            "supervise",
            "--gap",
            "5",
            "--",
            PY,
            str(script),
            victim.lease_id,
            str(victim.token),
            env["OVERNIGHT_REDIS_URL"],
            namespace,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    verdicts = json.loads(proc.stdout.splitlines()[0])
    assert "ALLOWED" not in verdicts.values(), verdicts
    assert verdicts.pop("end own with its own token") == "end-key"  # the supervisor's alone
    assert verdicts.pop("end own as the reaper would") == "alive"
    assert set(verdicts.values()) <= {"stale-token"}
    doc = Leases(r, keys).get(victim.lease_id)
    assert doc is not None and (doc.status, doc.note) == ("running", "boot")
    final = json.loads(proc.stdout[proc.stdout.rfind('{\n  "lease_id"') :])
    assert (final["status"], final["note"]) == ("done", "worker-complete")


# --- secrets ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_secrets_never_show_in_logs_receipts_config_argv_or_errors(
    env: dict[str, str], tmp_path: Path, redis_factory: Any, namespace: str
) -> None:
    password, api_key = "pw-Zq81xVv2", "sk-SECRET-9f3kq"
    server = redis_factory(extra_args=["--requirepass", password])
    url = f"redis://:{password}@127.0.0.1:{server.port}/0"
    tenv = {
        **env,
        "OVERNIGHT_REDIS_URL": url,
        "OVERNIGHT_QUEUE": namespace,
        "OVERNIGHT_MODEL_API_KEY": api_key,
    }
    seen: list[str] = []

    config = run(tenv, "config")
    assert config.returncode == 0
    seen += [config.stdout, config.stderr]
    assert json.loads(config.stdout)["model_api_key"] == "********"

    # argv of every process while a task runs, and the environment of every step process
    # (the key reaches the model step on its stdin only, never an environment). Each step
    # is held until the scan has seen it: the model step by a model that answers only then,
    # the rule until the scan writes the file it waits for.
    # The rule waits in its own (sandboxed) folder: the scan releases it through /proc.
    hold = "import os, time\nwhile not os.path.exists('released'): time.sleep(0.02)"
    marker = "rule-held-until-seen"
    path = task_file(tmp_path, "quiet", None, [[PY, "-c", hold, marker]], max_calls=2)
    held = False
    assert run(tenv, "envelope", "reset", "5").returncode == 0
    assert run(tenv, "submit", str(path)).returncode == 0
    argvs: set[str] = set()
    step_envs: set[str] = set()
    with Model("hang") as model:
        worker = subprocess.Popen(
            [OVERNIGHT, "worker", "--burst"],
            env={
                **tenv,
                "OVERNIGHT_MODEL_URL": model.url,
                "OVERNIGHT_GATEWAY_PORT": str(free_port()),
            },
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        while worker.poll() is None:
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    with contextlib.suppress(OSError):
                        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                        argvs.add(cmd)
                        environ = Path(f"/proc/{pid}/environ").read_bytes()
                        if b"OVERNIGHT_BEAT_SOCKET=" in environ:
                            step_envs.add(environ.decode(errors="replace"))
                            if "model_step" in cmd and model.requests:
                                model.release.set()
                            if marker in cmd:
                                Path(f"/proc/{pid}/cwd/released").touch()
                                held = True
            time.sleep(0.01)
        out, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, out[-3000:]
    # The scan saw both steps, each with its environment.
    assert model.release.is_set() and held, out[-3000:]
    assert len(step_envs) >= 2, step_envs
    seen += [out, *argvs, *step_envs]
    for args in (["receipts"], ["status", "quiet"], ["report"], ["lease", "list", "--json"]):
        proc = run(tenv, *args)
        assert proc.returncode == 0, proc.stderr
        seen += [proc.stdout, proc.stderr]

    # Wrong password, bad URL, unreachable server: the one-line error never echoes it.
    wrong = "pw-WRONG-77aa"
    for bad_url in (
        f"redis://:{wrong}@127.0.0.1:{server.port}/0",
        f"redis://:{wrong}@127.0.0.1:{free_port()}/0",
        f"redis://user:{wrong}@127.0.0.1:notaport/0",
    ):
        for args in (
            ["envelope", "status"],
            ["supervise", "--", "true"],
            ["status"],
            ["reaper", "--once"],
            ["config"],
        ):
            proc = run({**tenv, "OVERNIGHT_REDIS_URL": bad_url}, *args)
            assert proc.returncode in (0, 69, 78, 1), (args, proc.stderr)
            assert wrong not in proc.stdout + proc.stderr, (args, proc.stderr)
            if proc.returncode != 0:
                assert len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
            seen += [proc.stdout, proc.stderr]
    for text in seen:
        assert password not in text and api_key not in text, text[:500]
