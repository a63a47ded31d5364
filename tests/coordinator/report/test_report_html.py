"""The morning, for real: a night run by `overnight up` leaves an HTML report that headless
Chromium renders (non-blank screenshot, every task and state in the DOM, one timeline bar per
step, no external URL); /metrics is scraped and parsed with prometheus_client's parser while
counters move; `--until` ends a night with a hung step, the task resumes the next run; the
notification reaches a local receiver."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.redisio import receipts
from tests.helpers import OVERNIGHT, ROOT, task_file, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DOCS_PNG = ROOT / "docs" / "report.png"


class Inbox(BaseHTTPRequestHandler):
    """A local webhook receiver: keeps every JSON body POSTed to it."""

    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        Inbox.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def inbox() -> Any:
    Inbox.bodies = []
    server = HTTPServer(("127.0.0.1", 0), Inbox)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/night", Inbox.bodies
    server.shutdown()
    server.server_close()


def free_port(count: int = 1) -> int:
    """A port with ``count - 1`` free ports after it."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        try:
            held = []
            for i in range(count):
                t = socket.socket()
                held.append(t)
                t.bind(("127.0.0.1", port + i))
            for t in held:
                t.close()
            return port
        except OSError:
            for t in held:
                t.close()
    raise RuntimeError("no free ports")


def scrape(port: int) -> dict[str, float]:
    """Every sample of /metrics (name{labels} -> value), through prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(name + "{"))


def chromium(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--window-size=1400,1800",
                *args,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=90,
        )


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_a_demo_night_report_metrics_and_notification(
    tmp_path: Path, env: dict[str, str], namespace: str, r: redis.Redis, inbox: Any
) -> None:
    url, bodies = inbox
    tasks = tmp_path / "tasks"
    shutil.copytree(ROOT / "coordinator" / "examples", tasks)
    port = free_port(3)
    state = tmp_path / "state"
    run_env = {**env, "OVERNIGHT_METRICS_PORT": str(port), "OVERNIGHT_NOTIFY_URL": url}
    proc = subprocess.Popen(
        [
            OVERNIGHT,
            "up",
            "--tasks",
            str(tasks),
            "--budget",
            "16",
            "--exit-when-done",
            "--workers",
            "2",
            "--state-dir",
            str(state),
        ],
        cwd=tmp_path,
        env=run_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    steps: list[float] = []
    workers: dict[int, dict[str, float]] = {}
    try:
        deadline = time.monotonic() + 150
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                samples = scrape(port)
                steps.append(total(samples, "overnight_steps_total"))
                for n in (1, 2):
                    workers[n] = scrape(port + n)
            except OSError:
                pass  # not serving yet, or already stopped
            time.sleep(0.2)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 5, out + err  # never-done halts: it needs a person
    # Counters move as the night runs, and never go back.
    assert steps and steps == sorted(steps) and steps[-1] > steps[0], steps
    assert "overnight_tasks{state=running}" in samples
    assert any(
        k.startswith("overnight_envelope_remaining_calls{envelope=default}") for k in samples
    )
    assert any(k.startswith("overnight_lease_endings_total{") for k in samples)
    assert any(k.startswith("overnight_step_duration_seconds_bucket{") for k in samples)
    # Worker N serves on port + N and counts only the steps of the tasks it held.
    mine = [total(workers.get(n, {}), "overnight_steps_total") for n in (1, 2)]
    assert sum(mine) > 0 and all(n <= steps[-1] for n in mine), (mine, steps)
    assert not any("task" in k.split("{", 1)[1] for k in samples)  # no task ids as labels

    report = state / "report.html"
    assert f"overnight: report {report.resolve()}" in err
    page = report.read_text()
    assert not re.search(
        r"""(src|href)\s*=\s*["']?\s*https?:|url\(\s*["']?\s*https?:|//cdn""", page
    )
    assert "<script" not in page

    (ended,) = [b for b in bodies if b["event"] == "night_ended"]
    assert ended["reason"] == "done" and ended["report"] == str(report.resolve())
    assert ended["counts"] == {"finished_verified": 3, "halted_at_call_ceiling": 1}
    assert ended["needs_person"] == []

    dom = chromium(report.resolve().as_uri(), "--dump-dom")
    assert dom.returncode == 0, dom.stderr
    card = r'<article class="card" id="task-\d+" data-task="([^"]+)" data-state="([^"]+)"'
    states = dict(re.findall(card, dom.stdout))
    assert states == {
        "greeting": "finished_verified",
        "fix-add": "finished_verified",
        "hangs-once": "finished_verified",
        "never-done": "halted_at_call_ceiling",
    }
    finished = [rc for rc in receipts.read(r, Keys(namespace)) if rc.kind == "step_finished"]
    assert len(re.findall(r'<rect class="step"', dom.stdout)) == len(finished) > 0

    shot = tmp_path / "report.png"
    taken = chromium(report.resolve().as_uri(), f"--screenshot={shot}")
    assert taken.returncode == 0 and shot.exists(), taken.stderr
    from PIL import Image

    with Image.open(shot) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # not a blank page
    # The same page from the command line, after the night.
    again = tmp_path / "again.html"
    cli = subprocess.run(
        [OVERNIGHT, "report", "--html", str(again)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0 and cli.stdout.strip() == str(again), cli.stderr
    assert all(
        f'data-task="{task}" data-state="{st}"' in again.read_text() for task, st in states.items()
    )
    if os.environ.get("UPDATE_DOCS"):
        DOCS_PNG.parent.mkdir(exist_ok=True)
        shutil.copy(shot, DOCS_PNG)


def task_status(env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(
        [OVERNIGHT, "status", "night-owl"], env=env, capture_output=True, text=True, timeout=30
    )
    return dict(json.loads(done.stdout))


HANG_ONCE = (
    "if [ -e tried ]; then echo ok > done.txt; else touch tried; echo started; sleep 600; fi"
)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_until_ends_a_night_with_a_hung_step_and_the_task_resumes(
    tmp_path: Path, env: dict[str, str], namespace: str, r: redis.Redis, inbox: Any
) -> None:
    url, bodies = inbox
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    task_file(
        tasks,
        "night-owl",
        ["sh", "-c", HANG_ONCE],
        [["test", "-f", "done.txt"]],
        heartbeat_gap=300,
        lease_seconds=900,
        deadline=3600,
    )
    (tasks / "night-owl").chmod(0o777)
    state = tmp_path / "state"
    run_env = {**env, "OVERNIGHT_GRACE": "1", "OVERNIGHT_NOTIFY_URL": url}
    keys = Keys(namespace)

    # Refused: a time that has passed.
    past = (datetime.now().astimezone() - timedelta(minutes=1)).isoformat()
    refused = subprocess.run(
        [OVERNIGHT, "up", "--until", past, "--state-dir", str(state)],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 64
    assert refused.stderr.strip().count("\n") == 0 and "already passed" in refused.stderr

    # Room for up and its worker to start the step under a loaded machine.
    stop_at = datetime.now().astimezone() + timedelta(seconds=20)
    started = time.time()
    first = subprocess.run(
        [
            OVERNIGHT,
            "up",
            "--tasks",
            str(tasks),
            "--budget",
            "10",
            "--workers",
            "1",
            "--until",
            stop_at.isoformat(),
            "--state-dir",
            str(state),
        ],
        cwd=tmp_path,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    exited = time.time()
    assert first.returncode == 0, first.stdout + first.stderr
    status = task_status(run_env)
    assert status["state"] == "queued" and status["in_flight"] is None
    assert "night ended" in status["detail"]

    seen = receipts.read(r, keys, task_id="night-owl")
    kinds = [rc.kind for rc in seen]
    agent = next(rc for rc in seen if rc.kind == "step_finished")
    assert agent.data["stopped"] is True and agent.data["step"] == "agent"
    ended = next(
        rc for rc in seen if rc.kind == "subprocess_lease_expired" and rc.lease_id == agent.lease_id
    )
    acquired = next(rc for rc in seen if rc.kind == "lease_acquired")
    stop_unix = stop_at.timestamp()
    # In order: the step started before the night's end, its lease ended after it, then the
    # task went back to the queue.
    assert acquired.ts < stop_unix <= ended.ts
    assert kinds.index("step_finished") < kinds.index("task_stopped")
    assert ended.data["status"] == "expired"
    print(
        f"\nstop: the hung step's lease ended {ended.ts - stop_unix:.2f} s after the stop "
        f"(grace 1 s); up exited {exited - stop_unix:.2f} s after it, {exited - started:.1f} s "
        "after it started"
    )
    (night,) = [b for b in bodies if b["event"] == "night_ended"]
    assert night["reason"] == "until" and night["counts"] == {"queued": 1}
    assert Path(night["report"]).is_file()
    assert "night-owl" in Path(night["report"]).read_text()

    second = subprocess.run(
        [
            OVERNIGHT,
            "up",
            "--tasks",
            str(tasks),
            "--workers",
            "1",
            "--exit-when-done",
            "--state-dir",
            str(state),
        ],
        cwd=tmp_path,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert "night-owl resumes from its checkpoint" in second.stderr
    final = task_status(run_env)
    assert final["state"] == "finished_verified"
    assert final["turns"] == 1  # the stopped agent step ran again in the same turn
    wait_for(lambda: len([b for b in bodies if b["event"] == "night_ended"]) == 2, timeout=30)


@pytest.mark.timeout(60)
def test_the_coordinator_serves_metrics_and_counts_its_reaper_passes(
    tmp_path: Path, env: dict[str, str]
) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [OVERNIGHT, "coordinator", "--interval", "0.2"],
        cwd=tmp_path,
        env={**env, "OVERNIGHT_METRICS_PORT": str(port), "OVERNIGHT_BUDGET": "7"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def passes() -> float:
            try:
                return scrape(port)["overnight_reaper_passes_total{}"]
            except OSError:
                return 0.0

        first = wait_for(passes, timeout=30)
        assert wait_for(lambda: passes() > first, timeout=30)
        samples = scrape(port)
        assert samples["overnight_envelope_remaining_calls{envelope=default}"] == 7
        assert samples["overnight_tasks{state=queued}"] == 0
        assert samples["overnight_redis_up{}"] == 1
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
