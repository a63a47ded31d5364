"""How a host's steps were contained is said where a person looks: `overnight status` (each
task's JSON) and `overnight report` (plain and HTML), "sandbox: bwrap"
or "sandbox: off", the latter with a warning; the worker says off at start."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import redis

from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.sandbox import launch
from tests.helpers import cli, lacking, task_file, worker_env

AGENT = ["sh", "-c", "echo ok > ok.txt"]


@pytest.mark.parametrize("mode", ["bwrap", "off"])
def test_status_and_report_say_how_steps_were_contained(
    env: dict[str, str], tmp_path: Path, r: redis.Redis, namespace: str, mode: str
) -> None:
    if mode == "bwrap" and launch.find_bwrap() is None:
        lacking("bubblewrap is not installed")
    CallEnvelope(r, "default", namespace).reset(10)
    wenv = worker_env(env, OVERNIGHT_SANDBOX=mode)
    path = task_file(tmp_path, "said", AGENT, [["test", "-f", "ok.txt"]], workspace="in-place")
    assert cli(wenv, "submit", str(path)).returncode == 0
    worked = cli(wenv, "worker", "--burst")
    assert worked.returncode == 0, worked.stderr[-3000:]
    without = "steps run WITHOUT a sandbox (OVERNIGHT_SANDBOX=off)"
    assert (without in worked.stderr) == (mode == "off"), worked.stderr
    host = socket.gethostname()

    shown = cli(env, "status")
    assert shown.returncode == 0, shown.stderr
    (task,) = json.loads(shown.stdout)
    assert task["state"] == "finished_verified", task
    assert task["sandbox"] == mode

    plain = cli(env, "report", "--plain")
    assert plain.returncode == 0, plain.stderr
    assert f"sandbox: {mode} (host {host})" in plain.stdout
    assert (f"a sandbox on {host} (OVERNIGHT_SANDBOX=off)" in plain.stdout) == (mode == "off")

    page = tmp_path / "night.html"
    assert cli(env, "report", "--html", str(page)).returncode == 0
    html = page.read_text()
    assert f'<span id="sandbox">sandbox: {mode} (host {host})</span>' in html
    assert ("<h2>Ran without</h2>" in html) == (mode == "off")
