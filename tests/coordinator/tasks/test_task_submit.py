"""`overnight submit` and the other task commands' input handling, through the real CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import redis

from overnight.config.keys import Keys
from overnight.coordinator.tasks.taskfile import TaskFileError, load
from tests.helpers import OVERNIGHT

GOOD = """
assignment = "make it pass"
workdir = "."
max_calls = 4
[[verifier]]
name = "ok"
run = ["true"]
"""


def cli(env: dict[str, str], *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def queue_len(env: dict[str, str]) -> int:
    client = redis.Redis.from_url(env["OVERNIGHT_REDIS_URL"])
    return int(client.llen(f"rq:queue:{env.get('OVERNIGHT_QUEUE', 'overnight')}"))


def test_invalid_file_enqueues_nothing(env: dict[str, str], tmp_path: Path, r: redis.Redis) -> None:
    env = {**env, "OVERNIGHT_QUEUE": f"q-{env['OVERNIGHT_NAMESPACE']}"}
    good = tmp_path / "good.toml"
    good.write_text(GOOD)
    bad = tmp_path / "bad.toml"
    bad.write_text(
        'assignment = "x"\nworkdir = "missing"\nmax_calls = 0\nagent = "not-a-list"\n'
        'colour = "blue"\nverifier = []\n'
    )
    proc = cli(env, "submit", str(good), str(bad))
    assert proc.returncode == 64, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert all(line.startswith(f"{bad}: ") for line in lines), lines
    keys = {line.split(": ")[1] for line in lines}
    assert keys == {"workdir", "max_calls", "agent", "colour", "verifier"}
    assert "Traceback" not in proc.stderr
    assert queue_len(env) == 0
    assert r.zcard(Keys(env["OVERNIGHT_NAMESPACE"]).tasks) == 0


def test_json_and_toml_submit_prints_ids_and_refuses_live_duplicates(
    env: dict[str, str], tmp_path: Path
) -> None:
    env = {**env, "OVERNIGHT_QUEUE": f"q-{env['OVERNIGHT_NAMESPACE']}"}
    a = tmp_path / "a.toml"
    a.write_text('id = "alpha"\n' + GOOD)
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"assignment": "x", "verifier": [{"name": "v", "run": ["true"]}]}))
    proc = cli(env, "submit", str(a), str(b))
    assert proc.returncode == 0, proc.stderr
    ids = proc.stdout.split()
    assert ids[0] == "alpha" and len(ids) == 2 and ids[1].startswith("task-")
    assert queue_len(env) == 2
    again = cli(env, "submit", str(a))
    assert again.returncode == 64 and "alpha" in again.stderr and "live" in again.stderr
    assert queue_len(env) == 2
    status = json.loads(cli(env, "status", "alpha").stdout)
    assert status["state"] == "queued" and status["calls_used"] == 0 and status["turns"] == 0
    assert status["last_verdict"] is None
    listing = json.loads(cli(env, "status").stdout)
    assert {s["id"] for s in listing} == set(ids)


def test_rq_info_lists_the_queue_and_jobs(env: dict[str, str], tmp_path: Path) -> None:
    queue = f"q-{env['OVERNIGHT_NAMESPACE']}"
    env = {**env, "OVERNIGHT_QUEUE": queue}
    a = tmp_path / "a.toml"
    a.write_text(GOOD)
    assert cli(env, "submit", str(a)).returncode == 0
    rq = str(Path(OVERNIGHT).with_name("rq"))
    proc = subprocess.run(
        [rq, "info", "--url", env["OVERNIGHT_REDIS_URL"], queue],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert queue in proc.stdout and "1" in proc.stdout


def test_usage_errors_and_unknown_tasks(env: dict[str, str]) -> None:
    assert cli(env, "status", "nope").returncode == 64
    assert cli(env, "reconcile", "nope").returncode == 64  # neither --resume nor --abort
    assert cli(env, "reconcile", "nope", "--abort").returncode == 64
    assert cli(env, "submit").returncode == 64
    for name in ("submit", "worker", "status", "reconcile", "receipts", "report"):
        proc = cli(env, name, "--help")
        assert proc.returncode == 0 and "Usage:" in proc.stdout


def test_redis_unreachable_is_69(env: dict[str, str], tmp_path: Path) -> None:
    a = tmp_path / "a.toml"
    a.write_text(GOOD)
    env = {**env, "OVERNIGHT_REDIS_URL": "redis://127.0.0.1:1/0"}
    for args in (["submit", str(a)], ["status"], ["report"], ["receipts"]):
        proc = cli(env, *args)
        assert proc.returncode == 69, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_workdir_is_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "sub" / "repo").mkdir(parents=True)
    path = tmp_path / "sub" / "t.toml"
    path.write_text(GOOD.replace('workdir = "."', 'workdir = "repo"'))
    assert load(path).workdir == str(tmp_path / "sub" / "repo")
    path.write_text(GOOD + '\n[[verifier]]\nname = "ok"\nrun = ["x"]\n')
    try:
        load(path)
    except TaskFileError as exc:
        assert "verifier" in exc.problems[0] and "unique" in exc.problems[0]
    else:
        raise AssertionError("duplicate rule names accepted")
