"""A worker's folders on this host: made with their modes whatever the umask, none shared with
another user; one it cannot use ends its start with one line naming it and the fix, before
any task is taken (never a task paused because "its worker died")."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.helpers import OVERNIGHT, task_file


def worker(env: dict[str, str], umask: int = 0o022) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, "worker", "--burst"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.umask(umask),
    )


def status(env: dict[str, str], task_id: str) -> dict[str, object]:
    shown = subprocess.run(
        [OVERNIGHT, "status", task_id], env=env, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    data: dict[str, object] = json.loads(shown.stdout)
    return data


def submit(env: dict[str, str], folder: Path, name: str) -> None:
    path = task_file(folder, name, ["sh", "-c", "echo hi > ok.txt"], [["test", "-f", "ok.txt"]])
    submitted = subprocess.run(
        [OVERNIGHT, "submit", str(path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert submitted.returncode == 0, submitted.stderr
    budget = subprocess.run(
        [OVERNIGHT, "envelope", "reset", "10"], env=env, capture_output=True, text=True, timeout=60
    )
    assert budget.returncode == 0, budget.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a folder to another user (root only)")
@pytest.mark.timeout(240)
def test_a_state_folder_of_another_user_is_one_line_at_start_and_no_task_is_taken(
    tmp_path: Path, env: dict[str, str]
) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    submit(env, tmp_path / "tasks", "waits")
    refused = worker({**env, "OVERNIGHT_STATE_DIR": str(theirs)})
    assert refused.returncode == 78, refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last == (
        f"overnight: cannot use {theirs}: it belongs to uid 65534, not to uid 0 that "
        "overnight runs as; set OVERNIGHT_STATE_DIR to a folder of your own instead"
    )
    assert status(env, "waits")["state"] == "queued"  # not taken, not paused
    assert list(theirs.iterdir()) == []

    # The twin: a folder of its own, under a umask of 000, runs the same task to its end,
    # and no folder it made is writable by others.
    mine = tmp_path / "mine"
    ran = worker({**env, "OVERNIGHT_STATE_DIR": str(mine)}, umask=0)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert status(env, "waits")["state"] == "finished_verified"
    made = [mine, *(p for p in mine.rglob("*") if p.is_dir() and not p.is_symlink())]
    assert any(p.name == "waits" and p.parent.parent.name == "task-logs" for p in made)
    assert any(p.name == "waits" and p.parent.parent.name == "prompts" for p in made)
    loose = [f"{p} {stat.filemode(p.stat().st_mode)}" for p in made if p.stat().st_mode & 0o002]
    assert loose == []


@pytest.mark.timeout(60)
def test_up_names_the_folder_it_cannot_use_before_it_starts_anything(
    tmp_path: Path, env: dict[str, str]
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    proc = subprocess.run(
        [OVERNIGHT, "up", "--state-dir", str(tmp_path / "night")],
        env={**env, "OVERNIGHT_STATE_DIR": str(shared)},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 78, proc.stderr
    assert proc.stderr == (
        f"overnight: cannot use {shared}: others can write it (mode drwxrwxrwx); "
        "set OVERNIGHT_STATE_DIR to a folder of your own instead\n"
    )
    assert not (tmp_path / "night").exists()  # nothing started: no lock, no Redis, no log


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_night_under_a_umask_of_000_leaves_no_folder_open_to_all(
    tmp_path: Path, env: dict[str, str]
) -> None:
    quiet = {
        k: v for k, v in env.items() if k not in ("OVERNIGHT_REDIS_URL", "OVERNIGHT_NAMESPACE")
    }
    quiet["OVERNIGHT_STATE_DIR"] = str(tmp_path / "workspace")
    tasks = tmp_path / "tasks"
    task_file(tasks, "one", ["sh", "-c", "echo hi > ok.txt"], [["test", "-f", "ok.txt"]])
    night = tmp_path / "night"
    args = ["up", "--tasks", str(tasks), "--budget", "4", "--exit-when-done"]
    proc = subprocess.run(
        [OVERNIGHT, *args, "--state-dir", str(night)],
        env=quiet,
        capture_output=True,
        text=True,
        timeout=150,
        preexec_fn=lambda: os.umask(0),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    made = [
        p
        for root in (night, tmp_path / "workspace")
        for p in [root, *root.rglob("*")]
        if p.is_dir() and not p.is_symlink()
    ]
    assert night / "redis" in made and night / "logs" in made  # the night really ran here
    assert any(p.name == "one" and p.parent.parent.name == "task-logs" for p in made)
    loose = [f"{p} {stat.filemode(p.stat().st_mode)}" for p in made if p.stat().st_mode & 0o002]
    assert loose == []


@pytest.mark.timeout(60)
def test_rq_worker_names_the_folder_it_cannot_use_at_start(
    tmp_path: Path, env: dict[str, str]
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    rq = str(Path(OVERNIGHT).with_name("rq"))
    argv = [rq, "worker", "-w", "overnight.coordinator.dispatch.OvernightWorker", "--burst"]
    argv += ["--url", env["OVERNIGHT_REDIS_URL"], env["OVERNIGHT_NAMESPACE"]]
    refused = subprocess.run(
        argv,
        env={**env, "OVERNIGHT_STATE_DIR": str(shared)},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert refused.returncode == 78, refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"overnight: cannot use {shared}: others can write it (mode drwxrwxrwx); "
        "set OVERNIGHT_STATE_DIR to a folder of your own instead"
    )
    # Its twin: a folder of its own, and the same worker starts, finds no job and leaves.
    ran = subprocess.run(
        argv,
        env={**env, "OVERNIGHT_STATE_DIR": str(tmp_path / "mine")},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert (tmp_path / "mine").is_dir()
