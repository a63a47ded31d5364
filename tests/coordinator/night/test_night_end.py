"""How a night ends for a script: `up` refuses a night with no budget before it enqueues
anything, and `up --exit-when-done` exits 0 only when every task finished verified."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import redis

from overnight.config.exits import EXIT_NEEDS_PERSON, EXIT_OK, EXIT_UNFINISHED
from overnight.config.keys import Keys
from overnight.coordinator.night.ending import night_exit, no_budget, plural
from overnight.coordinator.tasks.states import State
from tests.helpers import OVERNIGHT, task_file

V, Q, R, P = State.FINISHED_VERIFIED, State.QUEUED, State.RUNNING, State.PAUSED


@pytest.mark.parametrize(
    ("states", "code"),
    [
        ([V], EXIT_OK),
        ([V, V], EXIT_OK),
        ([], EXIT_OK),
        ([V, State.HALTED_AT_CALL_CEILING], EXIT_NEEDS_PERSON),
        ([State.HALTED_STUCK], EXIT_NEEDS_PERSON),
        ([V, P], EXIT_NEEDS_PERSON),
        ([State.EXPIRED], EXIT_NEEDS_PERSON),
        ([State.AGENT_FAILED], EXIT_NEEDS_PERSON),
        ([State.ABORTED], EXIT_NEEDS_PERSON),
        ([V, Q], EXIT_UNFINISHED),
        ([R], EXIT_UNFINISHED),
        ([Q, State.HALTED_STUCK], EXIT_NEEDS_PERSON),
    ],
)
def test_the_night_exit_status(states: list[State], code: int) -> None:
    assert night_exit(states) == code


def test_words() -> None:
    assert (plural(1, "task"), plural(2, "task"), plural(0, "worker")) == (
        "1 task",
        "2 tasks",
        "0 workers",
    )
    line = no_budget(["default"])
    assert "\n" not in line and "--budget" in line and "OVERNIGHT_BUDGET" in line
    assert "--name NAME" in no_budget(["default", "side"])


def _up(
    env: dict[str, str], tmp_path: Path, tasks: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            OVERNIGHT,
            "up",
            "--tasks",
            str(tasks),
            "--workers",
            "1",
            "--exit-when-done",
            *extra,
            "--state-dir",
            str(tmp_path / "state"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )


@pytest.mark.timeout(120)
def test_up_without_a_budget_refuses_before_it_enqueues(
    tmp_path: Path, env: dict[str, str], namespace: str, r: redis.Redis
) -> None:
    tasks = tmp_path / "tasks"
    task_file(tasks, "would-halt", ["sh", "-c", "touch ok.txt"], [["test", "-f", "ok.txt"]])
    env = {k: v for k, v in env.items() if k != "OVERNIGHT_BUDGET"}
    proc = _up(env, tmp_path, tasks)
    assert proc.returncode == 64, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "--budget" in last and "OVERNIGHT_BUDGET" in last and "'default'" in last, last
    assert r.zcard(Keys(namespace).tasks) == 0  # nothing enqueued
    assert not r.exists(Keys(namespace).task("would-halt"))

    # The twin: the same night with a budget runs the task to its end, exit 0.
    proc = _up(env, tmp_path, tasks, "--budget", "5")
    assert proc.returncode == EXIT_OK, proc.stdout + proc.stderr
    assert "1 task enqueued" in proc.stderr and "1 worker;" in proc.stderr
    assert "created with 5 calls" in proc.stderr


@pytest.mark.timeout(120)
def test_up_exit_when_done_says_a_task_needs_a_person(tmp_path: Path, env: dict[str, str]) -> None:
    tasks = tmp_path / "tasks"
    task_file(tasks, "fine", ["sh", "-c", "touch ok.txt"], [["test", "-f", "ok.txt"]])
    task_file(tasks, "never", ["true"], [["false"]], max_calls=2)
    proc = _up(env, tmp_path, tasks, "--budget", "20")
    assert proc.returncode == EXIT_NEEDS_PERSON, proc.stdout + proc.stderr
    assert "1 task needs a person: never (halted_at_call_ceiling); exit 5" in proc.stderr
    fine = next(ln for ln in proc.stdout.splitlines() if ln.startswith("fine "))
    assert "finished_verified" in fine


@pytest.mark.timeout(120)
def test_the_coordinator_says_at_once_that_its_tasks_have_no_budget(
    tmp_path: Path, env: dict[str, str]
) -> None:
    tasks = tmp_path / "tasks"
    task_file(tasks, "would-halt", ["sh", "-c", "touch ok.txt"], [["test", "-f", "ok.txt"]])
    argv = [OVERNIGHT, "coordinator", "--once", "--tasks", str(tasks)]
    argv += ["--state-dir", str(tmp_path / "state")]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr  # a service is told, not refused
    assert "no call budget: envelope 'default' does not exist" in proc.stderr, proc.stderr
    # The twin: with OVERNIGHT_BUDGET the envelope is made first; nothing is said.
    other = {
        **env,
        "OVERNIGHT_NAMESPACE": env["OVERNIGHT_NAMESPACE"] + "-b",
        "OVERNIGHT_BUDGET": "5",
    }
    proc = subprocess.run(argv, env=other, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "no call budget" not in proc.stderr and "would-halt" in proc.stderr
