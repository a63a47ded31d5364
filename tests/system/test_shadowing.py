"""A folder holding config.py, worker.py, overnight.py, coordinator/ and config/settings/
(each raising when imported) shadows nothing: `overnight up`, the built-in model step, an
agent that calls `overnight beat` and `overnight worker --with-reaper` run in it, and in
task workdirs like it, as they would anywhere else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.supervise.procs import hostname
from tests.helpers import OVERNIGHT, plant_shadows, task_file, wait_for

PY = sys.executable


def run(
    env: dict[str, str], cwd: Path, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def status(env: dict[str, str], cwd: Path, task_id: str) -> dict[str, Any]:
    proc = run(env, cwd, "status", task_id)
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def shadowed_tasks(tasks: Path) -> None:
    """An agent-less task (the built-in model step) and an argv agent that beats and writes;
    each workdir full of would-be shadows."""
    model = task_file(tasks, "model-step", None, [["test", "-f", "out/answer.md"]], max_calls=4)
    agent = ["sh", "-c", f"{OVERNIGHT} beat --note shadowed-workdir && touch ok.txt"]
    argv = task_file(tasks, "argv-agent", agent, [["test", "-f", "ok.txt"]], max_calls=4)
    for path in (model, argv):
        plant_shadows(tasks / path.stem)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_up_in_a_shadowing_folder_ends_as_anywhere(env: dict[str, str], tmp_path: Path) -> None:
    folder = plant_shadows(tmp_path / "here")
    tasks = tmp_path / "tasks"
    shadowed_tasks(tasks)
    proc = run(
        env,
        folder,
        "up",
        "--tasks",
        str(tasks),
        "--budget",
        "20",
        "--exit-when-done",
        "--state-dir",
        str(tmp_path / "state"),
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "shadowed:" not in out
    for task_id in ("model-step", "argv-agent"):
        doc = status(env, folder, task_id)
        assert (doc["state"], doc["turns"]) == ("finished_verified", 1), doc
    answer = (tasks / "model-step" / "out" / "answer.md").read_text()
    assert answer.strip()


@pytest.mark.timeout(120)
def test_worker_with_reaper_in_a_shadowing_folder_ends_as_anywhere(
    env: dict[str, str], tmp_path: Path, r: redis.Redis, namespace: str
) -> None:
    folder = plant_shadows(tmp_path / "here")
    tasks = tmp_path / "tasks"
    gate = tasks / "under-reaper" / "go"  # in the task's own tree: what its sandbox sees
    # The step waits for the test to see the worker's reaper, so the burst cannot end first.
    waits = "import os, time\nwhile not os.path.exists('go'): time.sleep(0.05)\n"
    waits += "open('ok.txt', 'w').close()"
    path = task_file(
        tasks,
        "under-reaper",
        [PY, "-c", waits],
        [["test", "-f", "ok.txt"]],
        max_calls=4,
        heartbeat_gap=60,
    )
    plant_shadows(tasks / path.stem)
    tenv = {**env, "OVERNIGHT_QUEUE": namespace}
    assert run(tenv, folder, "envelope", "reset", "10").returncode == 0
    submitted = run(tenv, folder, "submit", str(path))
    assert submitted.returncode == 0, submitted.stderr
    worker = subprocess.Popen(
        [OVERNIGHT, "worker", "--with-reaper", "--burst"],
        cwd=folder,
        env=tenv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        reaper_pid = int(wait_for(lambda: r.get(Keys(namespace).reaper_host(hostname())), 30))
        with open(f"/proc/{reaper_pid}/stat") as fh:
            parent = int(fh.read().rsplit(")", 1)[1].split()[1])
        assert parent == worker.pid
        gate.touch()
        out, err = worker.communicate(timeout=90)
    finally:
        gate.touch()
        if worker.poll() is None:
            worker.kill()
            worker.communicate(timeout=10)
    assert worker.returncode == 0, (out + err)[-4000:]
    assert "shadowed:" not in out + err
    assert f"reaper host={hostname()} namespace={namespace}" in err
    doc = status(tenv, folder, "under-reaper")
    assert (doc["state"], doc["turns"]) == ("finished_verified", 1), doc
