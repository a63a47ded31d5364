"""A compose night that ends: at OVERNIGHT_STOP_AT the compose services' own commands
(``overnight coordinator`` and ``overnight worker --with-reaper``, as local processes with the
compose file's environment, on a private Redis) end the night as ``up --until`` does: the
hung step is ended by the stop and its task goes back to queued, the coordinator writes the
report and notifies once (reason "until"), and every process exits 0 (so ``restart:
on-failure`` leaves them down)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.redisio import receipts
from tests.composefile import interpolate, load, service_argv
from tests.helpers import OVERNIGHT, task_file

WORKERS = 2  # one runs the hung step, one stays idle: both must end


class _Inbox(BaseHTTPRequestHandler):
    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        _Inbox.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def inbox() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A local webhook receiver: its URL and every JSON body POSTed to it."""
    _Inbox.bodies = []
    server = HTTPServer(("127.0.0.1", 0), _Inbox)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/night", _Inbox.bodies
    server.shutdown()
    server.server_close()


def test_the_compose_file_lets_a_night_end() -> None:
    services = load()["services"]
    for name in ("coordinator", "worker"):
        svc = services[name]
        assert svc["restart"] == "on-failure"  # exit 0 at the night's end: not restarted
        assert {"OVERNIGHT_STOP_AT", "OVERNIGHT_NOTIFY_URL"} <= set(svc["environment"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_compose_night_ends_at_the_stop_time(
    env: dict[str, str],
    namespace: str,
    r: redis.Redis,
    tmp_path: Path,
    inbox: tuple[str, list[dict[str, Any]]],
) -> None:
    url, bodies = inbox
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    task_file(
        tasks,
        "night-owl",
        ["sh", "-c", "sleep 600"],
        [["true"]],
        heartbeat_gap=300,
        lease_seconds=900,
        deadline=3600,
    )
    # Room for the worker to start and take the task under a loaded machine.
    stop_at = datetime.now().astimezone() + timedelta(seconds=20)
    dotenv = {  # what the user's .env would say
        "OVERNIGHT_REDIS_URL": env["OVERNIGHT_REDIS_URL"],
        "OVERNIGHT_NAMESPACE": namespace,
        "OVERNIGHT_QUEUE": namespace,
        "OVERNIGHT_GRACE": "1",
        "OVERNIGHT_BUDGET": "10",
        "OVERNIGHT_STOP_AT": stop_at.isoformat(),
        "OVERNIGHT_NOTIFY_URL": url,
    }
    services = load()["services"]
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name in ("coordinator", "worker"):
        svc = services[name]
        svc_env = {**env, **{k: interpolate(str(v), dotenv) for k, v in svc["environment"].items()}}
        svc_env.pop("OVERNIGHT_STEP_USER")  # steps run as whoever runs the test (see conftest)
        for i in range(WORKERS if name == "worker" else 1):
            with open(logs / f"{name}-{i}.log", "wb") as out:
                procs[f"{name}-{i}"] = subprocess.Popen(
                    service_argv(svc["command"], tasks),
                    env=svc_env,
                    cwd=tasks,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
    exits: dict[str, float] = {}
    try:
        for name, proc in procs.items():
            code = proc.wait(150)
            exits[name] = time.time()
            assert code == 0, f"{name} exited {code}:\n" + _logs(logs)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    keys = Keys(namespace)
    shown = subprocess.run(
        [OVERNIGHT, "status"],
        env={**env, **dotenv},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (record,) = json.loads(shown.stdout)
    assert record["state"] == "queued" and "night ended" in record["detail"]
    seen = receipts.read(r, keys, task_id="night-owl")
    agent = next(rc for rc in seen if rc.kind == "step_finished")
    assert agent.data["stopped"] is True and agent.data["step"] == "agent"
    acquired = next(rc for rc in seen if rc.kind == "lease_acquired")
    ended = next(
        rc for rc in seen if rc.kind == "subprocess_lease_expired" and rc.lease_id == agent.lease_id
    )
    stop_unix = stop_at.timestamp()
    assert acquired.ts < stop_unix <= ended.ts  # the hung step was killed by the stop

    (night,) = [b for b in bodies if b["event"] == "night_ended"]
    assert len(bodies) == 1
    assert night["reason"] == "until" and night["namespace"] == namespace
    assert night["counts"] == {"queued": 1}
    report = tasks / ".overnight" / "report.html"  # the compose WORKDIR is the tasks folder
    assert night["report"] == str(report.resolve()) and report.is_file()
    assert "night-owl" in report.read_text()
    assert r.scard(f"rq:workers:{namespace}") == 0  # every worker unregistered
    print(
        f"\ncompose night: step lease ended {ended.ts - stop_unix:.2f} s after the stop "
        f"(grace 1 s); coordinator exited {exits['coordinator-0'] - stop_unix:.2f} s and the "
        f"last worker {max(exits.values()) - stop_unix:.2f} s after it"
    )


def _logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(folder.iterdir()))
