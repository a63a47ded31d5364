"""`overnight up` and `overnight demo`: real processes, a private Redis, nothing left behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import redis

from overnight.config.exits import EXIT_NEEDS_PERSON
from overnight.worker.supervise import procs
from tests.helpers import OVERNIGHT, ROOT, remove_demo_scratch, wait_for

EXPECTED = {
    "greeting": "finished_verified",
    "fix-add": "finished_verified",
    "hangs-once": "finished_verified",
    "never-done": "halted_at_call_ceiling",
}


def processes_with(var: str, value: str) -> list[int]:
    """Live processes (zombies excluded) whose environment holds ``var=value``."""
    return sorted(procs.tagged(var, value))


def reachable_python(env: dict[str, str]) -> dict[str, str]:
    """``env`` whose ``python3`` (the examples' agent) is one a sandboxed step reaches: this
    venv's (bound into every sandbox), never a shim under /root (the step's HOME is its own)."""
    return {**env, "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}


def copy_examples(tmp_path: Path) -> Path:
    dest = tmp_path / "tasks"
    shutil.copytree(ROOT / "coordinator" / "examples", dest)
    return dest


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_shows_the_four_outcomes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERNIGHT_")}
    try:
        proc = subprocess.run(
            [OVERNIGHT, "demo", "--state-dir", str(tmp_path / "state")],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=110,
        )
    finally:
        remove_demo_scratch(tmp_path / "state")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for task_id, state in EXPECTED.items():
        assert f"demo: {task_id}: {state} (as expected)" in proc.stdout
    assert "started a private redis-server" in proc.stderr
    assert "envelope default: remaining 0" in proc.stdout
    # The hang is seen being killed: in the progress lines and under its row in the report.
    assert "hangs-once: turn 1 agent killed: heartbeat gap 2.0 s" in proc.stdout
    assert "\n            turn 1 agent killed: heartbeat gap 2.0 s\n" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_up_runs_a_folder_to_its_end_states_and_leaves_nothing(
    tmp_path: Path, env: dict[str, str], namespace: str
) -> None:
    tasks = copy_examples(tmp_path)
    args = ["up", "--tasks", str(tasks), "--budget", "16", "--exit-when-done"]
    env = reachable_python(env)
    proc = subprocess.run(
        [OVERNIGHT, *args, "--state-dir", str(tmp_path / "state")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    # never-done ends halted: --exit-when-done says a task needs a person.
    assert proc.returncode == EXIT_NEEDS_PERSON, proc.stdout + proc.stderr
    assert "1 task needs a person: never-done (halted_at_call_ceiling)" in proc.stderr
    for task_id, state in EXPECTED.items():
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(task_id + " "))
        assert state in line, line
    assert "private redis-server" not in proc.stderr  # OVERNIGHT_REDIS_URL was given
    assert processes_with("OVERNIGHT_NAMESPACE", namespace) == []
    status = subprocess.run(
        [OVERNIGHT, "status", "fix-add"], env=env, capture_output=True, text=True, timeout=30
    )
    assert '"finished_verified"' in status.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_second_up_refuses_and_sigterm_stops_everything(
    tmp_path: Path, env: dict[str, str], namespace: str
) -> None:
    tasks = copy_examples(tmp_path)
    first = subprocess.Popen(
        [
            OVERNIGHT,
            "up",
            "--tasks",
            str(tasks / "03-hangs"),
            "--budget",
            "10",
            "--state-dir",
            str(tmp_path / "a"),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Wait until the hanging agent runs under a worker of the first `up`.
        wait_for(lambda: len(processes_with("OVERNIGHT_NAMESPACE", namespace)) >= 4, timeout=30)
        second = subprocess.run(
            [OVERNIGHT, "up", "--tasks", str(tasks), "--state-dir", str(tmp_path / "b")],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode == 2, second.stderr
        assert "another overnight up" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1
        assert first.poll() is None
        first.send_signal(signal.SIGTERM)
        _out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 128 + signal.SIGTERM, err
    wait_for(lambda: processes_with("OVERNIGHT_NAMESPACE", namespace) == [], timeout=10)


def test_a_killed_up_leaves_nothing_of_its_night_running(
    tmp_path: Path, env: dict[str, str], namespace: str
) -> None:
    env = reachable_python(env)
    tasks = copy_examples(tmp_path)
    up = subprocess.Popen(
        [OVERNIGHT, "up", "--tasks", str(tasks / "03-hangs"), "--budget", "10"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    work = str(tasks / "03-hangs" / "work")

    def agents() -> list[int]:
        found = []
        for proc in psutil.process_iter(["cmdline", "cwd"]):
            with contextlib.suppress(psutil.Error):
                if "agent.py" in (proc.info["cmdline"] or []) and (
                    proc.info["cwd"] or ""
                ).startswith(work):
                    found.append(proc.pid)
        return found

    try:
        # Its reaper and workers run, and the hanging agent under one of them.
        wait_for(agents, timeout=60, interval=0.1)
        assert len(processes_with("OVERNIGHT_NAMESPACE", namespace)) >= 3
    finally:
        up.kill()
        up.wait(10)
    wait_for(lambda: processes_with("OVERNIGHT_NAMESPACE", namespace) == [], timeout=60)
    wait_for(lambda: agents() == [], timeout=30)


def test_up_help_explains() -> None:
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "overnight", "up", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0
    assert "--workers" in proc.stdout and "Ctrl-C" in proc.stdout


def test_the_namespace_lock_is_one_holder_at_a_time_and_renewed(
    r: redis.Redis, namespace: str
) -> None:
    from overnight.config.exits import EXIT_REFUSED, CommandError
    from overnight.config.keys import Keys
    from overnight.coordinator.night.instance import (
        INSTANCE_TTL_MS,
        claim_instance,
        renew_instance,
    )

    keys = Keys(namespace)
    first = claim_instance(r, keys, "host-a:1:x")
    with pytest.raises(CommandError) as refused:
        claim_instance(r, keys, "host-b:2:y")
    assert refused.value.exit_code == EXIT_REFUSED and "host-a:1:x" in str(refused.value)
    r.pexpire(keys.instance("up"), 1000)
    renew_instance(first, keys)
    assert INSTANCE_TTL_MS - 2000 < r.pttl(keys.instance("up")) <= INSTANCE_TTL_MS
    # Lapsed (up was stalled): the holder takes it back if nobody else did.
    r.delete(keys.instance("up"))
    renew_instance(first, keys)
    assert r.get(keys.instance("up")) == "host-a:1:x"
    first.release()
    second = claim_instance(r, keys, "host-b:2:y")
    second.release()
    assert not r.exists(keys.instance("up"))
