"""docker-compose.yml, proved without a Docker engine.

The file is checked by a spec-compliant compose parser and against the settings model;
then each service's own command runs as a local process against a private Redis (the same
topology minus containers) and the example tasks reach their expected end states.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
import redis
from compose_spec import PyCompose

from overnight.config.settings import Settings, env_name
from overnight.coordinator.night.embedded_redis import free_port
from tests.composefile import COMPOSE, COMPOSE_ONLY, interpolate, load, service_argv
from tests.helpers import OVERNIGHT, ROOT, wait_for


def setting_env_names() -> set[str]:
    names = {env_name(field) for field in Settings.model_fields}
    return {n.split(" ")[0] for n in names}


def test_compose_file_parses_under_the_compose_spec() -> None:
    compose = PyCompose.from_yaml(COMPOSE.read_text())
    assert set(compose.service_names()) == {"redis", "coordinator", "worker"}


def test_compose_spec_parser_rejects_a_broken_file() -> None:
    broken = COMPOSE.read_text().replace("replicas: 3", "replicas: three")
    with pytest.raises(ValueError):
        PyCompose.from_yaml(broken)


def test_services_have_the_promised_shape() -> None:
    services = load()["services"]
    redis = services["redis"]
    assert redis["image"].startswith("redis:")
    assert "--appendonly" in redis["command"] and "yes" in redis["command"]
    # A password from .env, required: compose refuses to start without one.
    assert "--requirepass" in redis["command"]
    password = redis["command"][redis["command"].index("--requirepass") + 1]
    assert password.startswith("${REDIS_PASSWORD:?")
    with pytest.raises(KeyError, match="REDIS_PASSWORD"):
        interpolate(password, {"REDIS_PASSWORD": ""})
    assert "healthcheck" in redis
    assert services["worker"]["deploy"]["replicas"] == 3
    for name in ("coordinator", "worker"):
        svc = services[name]
        assert svc["command"][0] == "overnight"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert any(v.endswith(":/tasks") for v in svc["volumes"])
    assert "--with-reaper" in services["worker"]["command"]
    assert (ROOT / ".env.example").is_file() and (ROOT / "Dockerfile").is_file()


def test_the_workers_may_build_a_sandbox_and_nothing_more() -> None:
    """The worker's steps run in bwrap (the default) built from a user namespace: Docker's
    seccomp, AppArmor and /proc masks are lifted for it, no capability is added, nothing
    is privileged; the coordinator, which runs no step, keeps Docker's defaults. The image
    installs bubblewrap."""
    services = load()["services"]
    worker = services["worker"]
    assert sorted(worker["security_opt"]) == [
        "apparmor=unconfined",
        "seccomp=unconfined",
        "systempaths=unconfined",
    ]
    assert "cap_add" not in worker and not worker.get("privileged")
    assert "OVERNIGHT_SANDBOX" not in worker["environment"]  # the default: bwrap
    assert "security_opt" not in services["coordinator"]
    assert "bubblewrap" in (ROOT / "Dockerfile").read_text()


def test_every_overnight_variable_is_a_real_setting() -> None:
    known = setting_env_names()
    services = load()["services"]
    seen: set[str] = set()
    for svc in services.values():
        for key in svc.get("environment", {}) or {}:
            if key.startswith("OVERNIGHT_"):
                assert key in known, f"{key} is not a setting"
                seen.add(key)
    assert {"OVERNIGHT_REDIS_URL", "OVERNIGHT_NAMESPACE", "OVERNIGHT_BUDGET"} <= seen
    example = (ROOT / ".env.example").read_text()
    for line in example.splitlines():
        if line and not line.startswith("#"):
            assert line.split("=", 1)[0] in known | COMPOSE_ONLY, line


def test_compose_environment_is_valid_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("OVERNIGHT_") or key == "MODEL_URL":
            monkeypatch.delenv(key)
    env = load()["services"]["worker"]["environment"]
    with pytest.raises(KeyError, match="OVERNIGHT_REDIS_URL"):  # compose needs it from .env
        interpolate(str(env["OVERNIGHT_REDIS_URL"]), {})
    dotenv = {"OVERNIGHT_REDIS_URL": "redis://:pw@redis:6379/0"}
    values = {k: interpolate(str(v), dotenv) for k, v in env.items()}
    settings = Settings(**{k.removeprefix("OVERNIGHT_").lower(): v for k, v in values.items() if v})
    assert settings.redis_url == "redis://:pw@redis:6379/0"
    assert settings.budget == 40
    example = dict(
        line.split("=", 1)
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert example["REDIS_PASSWORD"] == ""  # the user makes one: compose refuses an empty one
    assert example["OVERNIGHT_REDIS_URL"].startswith("redis://:PASSWORD@")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_compose_topology_runs_the_example_tasks(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Every service's own command, with its own environment, as local processes."""
    services = load()["services"]
    tasks = tmp_path / "tasks"
    if os.geteuid() == 0:  # the steps run as the step user: the tasks must be its own
        user = request.getfixturevalue("step_user")
        tasks = Path(tempfile.mkdtemp(prefix="overnight-compose-", dir="/tmp")) / "tasks"
        request.addfinalizer(lambda: shutil.rmtree(tasks.parent, ignore_errors=True))
        tasks.parent.chmod(0o755)
    shutil.copytree(ROOT / "coordinator" / "examples", tasks)
    if os.geteuid() == 0:
        for folder, _dirs, files in os.walk(tasks):
            for name in [folder, *(os.path.join(folder, f) for f in files)]:
                os.chown(name, user.uid, user.gid)
    port = free_port()
    namespace = f"compose-{os.getpid()}"
    # What a user's .env would say: the Redis address on this machine and a small budget.
    password = uuid.uuid4().hex
    dotenv = {
        "REDIS_PASSWORD": password,
        "OVERNIGHT_REDIS_URL": f"redis://:{password}@127.0.0.1:{port}/0",
        "OVERNIGHT_NAMESPACE": namespace,
        "OVERNIGHT_BUDGET": "16",
    }
    base = {k: v for k, v in os.environ.items() if not k.startswith("OVERNIGHT_")}
    procs: list[subprocess.Popen[bytes]] = []
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, argv: list[str], env: dict[str, str]) -> None:
        with open(logs / f"{name}.log", "wb") as out:
            procs.append(
                subprocess.Popen(argv, env=env, cwd=tasks, stdout=out, stderr=subprocess.STDOUT)
            )

    redis_cmd = [interpolate(str(a), dotenv) for a in services["redis"]["command"]]
    redis_cmd += ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    start("redis", redis_cmd, base)
    try:
        client = redis.Redis(port=port, password=password, decode_responses=True)
        wait_for(lambda: _pings(client), timeout=10)
        for name in ("coordinator", "worker"):
            svc = services[name]
            env = {**base}
            for key, value in svc["environment"].items():
                env[key] = interpolate(str(value), dotenv)
            if os.geteuid() == 0:
                env["OVERNIGHT_STEP_USER"] = user.name
            else:  # the image runs overnight as root; this test may not
                env.pop("OVERNIGHT_STEP_USER")
            replicas = svc.get("deploy", {}).get("replicas", 1)
            for i in range(replicas):
                start(f"{name}-{i}", service_argv(svc["command"], tasks), env)
        env = {**base, **dotenv}

        def states() -> dict[str, str]:
            proc = subprocess.run(
                [OVERNIGHT, "status"], env=env, capture_output=True, text=True, timeout=30
            )
            return {t["id"]: t["state"] for t in json.loads(proc.stdout or "[]")}

        ended = {"finished_verified", "halted_at_call_ceiling", "halted_stuck", "expired"}
        wait_for(
            lambda: len(states()) == 4 and set(states().values()) <= ended,
            timeout=120,
            interval=0.5,
        )
        assert states() == {
            "greeting": "finished_verified",
            "fix-add": "finished_verified",
            "hangs-once": "finished_verified",
            "never-done": "halted_at_call_ceiling",
        }
        workers = client.smembers("rq:workers:overnight")
        assert len(workers) == 3
        assert client.exists(f"{{{namespace}}}:reaper:{socket.gethostname()}")
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert all(p.returncode is not None for p in procs)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
