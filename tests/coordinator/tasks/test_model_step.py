"""The built-in model step against a real local HTTP server (started by the test), and the stub."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import Model

SECRET = "sk-test-secret-0123456789"


@pytest.fixture
def model_env(env: dict[str, str], tmp_path: Path) -> Iterator[dict[str, str]]:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Assignment:\nsay hello\n")
    yield {**env, "OVERNIGHT_PROMPT_FILE": str(prompt), "OVERNIGHT_TURN": "2"}


def run_step(
    env: dict[str, str], cwd: Path, timeout: float = 20
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", "overnight.coordinator.tasks.model_step"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_stub_writes_the_answer_without_network(model_env: dict[str, str], tmp_path: Path) -> None:
    proc = run_step(model_env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "out" / "turn-002.json").read_text())
    assert record["source"] == "stub" and record["model"] == "echo-stub"
    assert "say hello" in record["answer"]
    assert (tmp_path / "out" / "answer.md").read_text() == record["answer"]
    again = run_step(model_env, tmp_path)
    assert again.stdout == proc.stdout  # deterministic


def test_real_server_answer(model_env: dict[str, str], tmp_path: Path) -> None:
    with Model("ok") as model:
        env = {**model_env, "OVERNIGHT_MODEL_URL": model.url, "OVERNIGHT_MODEL_API_KEY": SECRET}
        proc = run_step(env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    [req] = model.requests
    assert req["path"] == "/v1/chat/completions"
    assert req["auth"] == f"Bearer {SECRET}"
    assert req["body"]["messages"][-1]["content"].startswith("Assignment:")
    record = json.loads((tmp_path / "out" / "turn-002.json").read_text())
    assert record["answer"] == "ANSWER-42" and record["source"] == "http"
    assert SECRET not in proc.stdout + proc.stderr


def test_server_error_fails_the_step_without_leaking_the_key(
    model_env: dict[str, str], tmp_path: Path
) -> None:
    with Model("500") as model:
        env = {
            **model_env,
            "OVERNIGHT_MODEL_URL": model.url + "/v1",
            "OVERNIGHT_MODEL_API_KEY": SECRET,
        }
        proc = run_step(env, tmp_path)
    assert proc.returncode == 1
    assert "HTTP 500" in proc.stderr and SECRET not in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()


def test_hanging_server_is_bounded_by_the_timeout(
    model_env: dict[str, str], tmp_path: Path
) -> None:
    with Model("hang") as model:
        env = {**model_env, "OVERNIGHT_MODEL_URL": model.url, "OVERNIGHT_MODEL_TIMEOUT": "0.5"}
        proc = run_step(env, tmp_path, timeout=10)
    assert proc.returncode == 1 and "unreachable" in proc.stderr


def test_settings_on_stdin_not_in_the_environment(
    model_env: dict[str, str], tmp_path: Path
) -> None:
    """How a worker runs it: the environment names no URL and no key; stdin carries both."""
    from overnight.coordinator.tasks.model_step import settings_line

    with Model("ok") as model:
        line = settings_line(
            {
                "OVERNIGHT_MODEL_URL": model.url,
                "OVERNIGHT_MODEL_API_KEY": SECRET,
                "OVERNIGHT_MODEL_NAME": "m-1",
                "OVERNIGHT_MODEL_TIMEOUT": "5",
                "OVERNIGHT_REDIS_URL": "redis://never:passed@h/0",
            }
        )
        assert b"never" not in line
        env = {k: v for k, v in model_env.items() if not k.startswith("OVERNIGHT_MODEL")}
        proc = subprocess.run(
            [sys.executable, "-P", "-m", "overnight.coordinator.tasks.model_step"],
            cwd=tmp_path,
            env={**env, "OVERNIGHT_MODEL_SETTINGS": "stdin"},
            input=line,
            capture_output=True,
            timeout=20,
            check=False,
        )
    assert proc.returncode == 0, proc.stderr
    [req] = model.requests
    assert req["auth"] == f"Bearer {SECRET}" and req["body"]["model"] == "m-1"
    assert SECRET.encode() not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b"[]",
        b'{"OVERNIGHT_MODEL_URL": "ftp://x"}',
        b'{"OVERNIGHT_MODEL_TIMEOUT": "-1", "OVERNIGHT_MODEL_API_KEY": "sk-x"}',
    ],
)
def test_bad_settings_on_stdin_exit_78_in_one_line(
    model_env: dict[str, str], tmp_path: Path, line: bytes
) -> None:
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "overnight.coordinator.tasks.model_step"],
        cwd=tmp_path,
        env={**model_env, "OVERNIGHT_MODEL_SETTINGS": "stdin"},
        input=line,
        capture_output=True,
        timeout=20,
        check=False,
    )
    assert proc.returncode == 78 and len(proc.stderr.strip().splitlines()) == 1
    assert b"sk-x" not in proc.stderr
