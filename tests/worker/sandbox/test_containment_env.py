"""A step holds no credential and beats without Redis.

The rules as tables (the step's environment, declared names, who may beat), then a hostile
step for real: under ``overnight supervise`` and as a task's agent on ``overnight worker
--burst``, it dumps its environment looking for the Redis URL, a token or a key (a sentinel
model API key is set in the supervisor's environment), and beats another running lease
through that lease's own socket: refused every time, and that lease still lapses on its
gap. The same step's ``overnight beat`` and ``pulse()`` keep its own lease alive past the
gap with output beats off.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from overnight.coordinator.tasks.taskfile import TaskFileError, load
from overnight.worker.beat.channel import in_tree
from overnight.worker.sandbox.stepenv import declared_problem, step_environment
from overnight.worker.supervise.procs import Proc
from tests.helpers import OVERNIGHT, final_doc, start, task_file, wait_for

PY = sys.executable
API_KEY = "sk-SENTINEL-4d1c9e"
REDIS_AUTH = "REDISPW-SENTINEL-77b2"

# --- the environment, as a table ------------------------------------------------------------

WORKER_ENV = {
    "PATH": "/opt/bin:/usr/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TERM": "xterm",
    "TZ": "UTC",
    "HOME": "/home/worker",
    "USER": "worker",
    "OVERNIGHT_REDIS_URL": "redis://:pw@127.0.0.1:6379/0",
    "OVERNIGHT_NAMESPACE": "ns",
    "OVERNIGHT_MODEL_API_KEY": API_KEY,
    "OVERNIGHT_ANTHROPIC_API_KEY": API_KEY,
    "OPENAI_API_KEY": API_KEY,
    "REDISCLI_AUTH": REDIS_AUTH,
    "OVERNIGHT_LEASE_TOKEN": "17",
    "VIRTUAL_ENV": "/venv",
    "AWS_SECRET_ACCESS_KEY": "nope",
}


# Off: this module proves what the containment holds alone (uid, cgroup, allowlisted
# environment), the promise of OVERNIGHT_SANDBOX=off; its hostile steps also run scripts
# from the test's folder, outside any task tree a sandbox would bind.
@pytest.fixture(autouse=True)
def _containment_alone(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if "env" in request.fixturenames:
        request.getfixturevalue("env")["OVERNIGHT_SANDBOX"] = "off"
    monkeypatch.setenv("OVERNIGHT_SANDBOX", "off")


@pytest.mark.parametrize(
    ("declared", "expected"),
    [
        ({}, {}),
        ({"TASK_VAR": "x", "PATH": "/task/bin"}, {"TASK_VAR": "x", "PATH": "/task/bin"}),
        ({"OVERNIGHT_REDIS_URL": "redis://x"}, {}),
        ({"overnight_redis_url": "redis://x", "redis_password": "p"}, {}),
        ({"MY_API_KEY": "k", "OVERNIGHT_LEASE_TOKEN": "1"}, {}),
        ({"HOME": "/", "TMPDIR": "/", "OVERNIGHT_LEASE_ID": "other"}, {}),
        (
            {"OVERNIGHT_PROMPT": "do it", "OVERNIGHT_TURN": "2"},
            {"OVERNIGHT_PROMPT": "do it", "OVERNIGHT_TURN": "2"},
        ),
    ],
)
def test_step_environment(declared: dict[str, str], expected: dict[str, str]) -> None:
    channel = {"OVERNIGHT_BEAT_SOCKET": "/run/b/s", "OVERNIGHT_LEASE_ID": "L1"}
    env = step_environment(
        WORKER_ENV, declared, lease_id="L1", task_id="T1", home="/h", channel=channel
    )
    base = {
        "PATH": "/opt/bin:/usr/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "xterm",
        "TZ": "UTC",
        "HOME": "/h",
        "TMPDIR": "/h/tmp",
        "OVERNIGHT_LEASE_ID": "L1",
        "OVERNIGHT_TASK_ID": "T1",
        "OVERNIGHT_BEAT_SOCKET": "/run/b/s",
    }
    assert env == {**base, **expected}
    assert API_KEY not in json.dumps(env) and REDIS_AUTH not in json.dumps(env)


def test_step_environment_without_a_path_gets_a_default() -> None:
    env = step_environment({}, None, lease_id=None)
    assert env == {"PATH": "/usr/local/bin:/usr/bin:/bin"}


@pytest.mark.parametrize(
    ("name", "refused"),
    [
        ("TASK_VAR", False),
        ("PATH", False),
        ("GIT_AUTHOR_NAME", False),
        ("OVERNIGHT_REDIS_URL", True),
        ("REDIS_URL", True),
        ("redispass", True),
        ("OPENAI_API_KEY", True),
        ("OVERNIGHT_LEASE_TOKEN", True),
        ("OVERNIGHT_ANYTHING", True),
        ("HOME", True),
        ("TMPDIR", True),
        ("", True),
    ],
)
def test_declared_names(name: str, refused: bool) -> None:
    assert (declared_problem(name) is not None) == refused


def test_a_task_declaring_a_credential_is_refused_with_one_line_each(tmp_path: Path) -> None:
    path = task_file(tmp_path, "creds", ["true"], [["true"]])
    path.write_text(path.read_text() + '\n[env]\nOK_VAR = "1"\nOVERNIGHT_REDIS_URL = "redis://h"\n')
    with pytest.raises(TaskFileError) as err:
        load(path)
    [line] = err.value.problems
    assert "env" in line and "OVERNIGHT_REDIS_URL" in line and "credential" in line
    path.write_text(path.read_text().replace('OVERNIGHT_REDIS_URL = "redis://h"\n', ""))
    assert load(path).env == {"OK_VAR": "1"}


# --- who may beat, as a table -----------------------------------------------------------------

ME = 100  # the supervisor
TABLE = {
    # pid: (ppid, start)
    1: (0, 0),
    ME: (1, 10),
    200: (ME, 50),  # the child (root), started at 50
    201: (200, 51),  # its child
    202: (201, 52),  # a grandchild
    300: (ME, 60),  # an orphan of the tree, re-parented to us
    301: (300, 61),
    400: (1, 55),  # a stranger: another lease's step, say
    401: (400, 56),
    500: (ME, 40),  # our child from before the root started
    600: (ME, 70),  # the root of another step run by this same process
    601: (600, 71),
}


def reader(table: dict[int, tuple[int, int]]) -> Callable[[int], Proc | None]:
    def read(pid: int) -> Proc | None:
        row = table.get(pid)
        return None if row is None else Proc(pid, row[0], pid, pid, "S", row[1])

    return read


@pytest.mark.parametrize(
    ("pid", "root_start", "ours"),
    [
        (200, 50, True),
        (201, 50, True),
        (202, 50, True),
        (300, 50, True),
        (301, 50, True),
        (400, 50, False),
        (401, 50, False),
        (500, 50, False),
        (600, 50, False),
        (601, 50, False),
        (ME, 50, False),
        (1, 50, False),
        (0, 50, False),
        (999, 50, False),  # gone
        (201, 49, False),  # the root pid was reused: not our child any more
        (201, None, False),
    ],
)
def test_who_may_beat(pid: int, root_start: int | None, ours: bool) -> None:
    got = in_tree(
        pid, root=200, root_start=root_start, adopter=ME, other_roots={600}, read=reader(TABLE)
    )
    assert got == ours


def test_a_parent_loop_in_the_table_ends() -> None:
    table = {7: (8, 1), 8: (7, 1)}
    assert not in_tree(7, root=200, root_start=50, adopter=ME, read=reader(table))


# --- a hostile step, for real -------------------------------------------------------------------

# argv: victim env file, out file, seconds per phase, overnight. Phase one beats with pulse()
# only, phase two with `overnight beat` only; both attack the victim all along.
HOSTILE = """
import json, os, subprocess, sys, time
from overnight import LeaseRefused, beat, pulse
victim_file, out_file, phase, overnight = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
env = dict(os.environ)
while not os.path.exists(victim_file):
    time.sleep(0.02)
victim = json.load(open(victim_file))
attack = {k: victim[k] for k in ("OVERNIGHT_LEASE_ID", "OVERNIGHT_BEAT_SOCKET")}
res = {"own_cli": [], "attack_cli": [], "attack_py": []}

def attack_py():
    try:
        beat(environ=attack)
        res["attack_py"].append("ALLOWED")
    except LeaseRefused as exc:
        res["attack_py"].append(exc.reason)

end = time.monotonic() + phase
with pulse() as p:
    while time.monotonic() < end:
        attack_py()
        time.sleep(0.1)
res["pulse_beats"], res["pulse_refused"] = p.beats, p.refused is not None
end = time.monotonic() + phase
while time.monotonic() < end:
    own = subprocess.run([overnight, "beat", "--note", "own"], capture_output=True, text=True)
    res["own_cli"].append([own.returncode, own.stderr.strip()])
    bad = subprocess.run([overnight, "beat"], env={**env, **attack}, capture_output=True,
                         text=True)
    res["attack_cli"].append([bad.returncode, bad.stderr.strip()])
    attack_py()
    time.sleep(0.05)
json.dump({"env": env, "res": res}, open(out_file, "w"))
print("hostile step done", flush=True)
"""
VICTIM = (
    "import json, os, sys, time\njson.dump(dict(os.environ), open(sys.argv[1], 'w'))\n"
    "time.sleep(120)\n"
)


def start_victim(env: dict[str, str], tmp_path: Path, gap: float) -> tuple[Any, Path]:
    victim_env = tmp_path / "victim-env.json"
    script = tmp_path / "victim.py"
    script.write_text(VICTIM)
    proc = start(
        [
            "--gap",
            str(gap),
            "--grace",
            "0.5",
            "--no-output-beats",
            "--",
            PY,
            str(script),
            str(victim_env),
        ],
        env,
    )
    return proc, victim_env


def check_hostile(out: dict[str, Any], redis_url: str, gap: float) -> None:
    env, res = out["env"], out["res"]
    for name in env:
        up = name.upper()
        assert not (up.startswith("REDIS") or up.endswith("_API_KEY")), name
        assert up not in ("OVERNIGHT_REDIS_URL", "OVERNIGHT_LEASE_TOKEN", "OVERNIGHT_NAMESPACE")
    text = json.dumps(env)
    for secret in (API_KEY, REDIS_AUTH, redis_url, redis_url.split("//")[1].split("/")[0]):
        assert secret not in text
    # The victim refused every beat: while it ran as not of its tree, then as over.
    reasons = res["attack_py"] + [r[1] for r in res["attack_cli"]]
    assert "ALLOWED" not in res["attack_py"]
    # Refused (2), or killed by a signal: the attacking process carries the victim's lease id
    # as its tag, so the victim's end takes it along as one of its own.
    assert all(code == 2 or code < 0 for code, _ in res["attack_cli"]), res["attack_cli"]
    assert any("not-this-lease" in r for r in reasons), reasons
    # The control: its own beats were all taken and kept it past the gap twice over.
    assert res["own_cli"] and all(code == 0 for code, _ in res["own_cli"]), res["own_cli"]
    assert res["pulse_beats"] >= 2 and not res["pulse_refused"]


def check_victim_lapsed(victim: Any, gap: float) -> None:
    out, err = victim.communicate(timeout=60)
    assert victim.returncode == 3, err
    doc = final_doc(out)
    assert doc["status"] == "killed" and doc["note"].startswith("heartbeat-gap-")
    assert float(doc["note"].removeprefix("heartbeat-gap-").rstrip("s")) >= gap


@pytest.mark.timeout(120)
def test_hostile_step_under_supervise(env: dict[str, str], tmp_path: Path) -> None:
    env = {**env, "OVERNIGHT_MODEL_API_KEY": API_KEY, "REDISCLI_AUTH": REDIS_AUTH}
    hostile, out_file = tmp_path / "hostile.py", tmp_path / "hostile-out.json"
    hostile.write_text(HOSTILE)
    victim, victim_env = start_victim(env, tmp_path, gap=4)
    try:
        wait_for(victim_env.exists, timeout=20)
        proc = start(
            [
                "--gap",
                "2",
                "--no-output-beats",
                "--",
                PY,
                str(hostile),
                str(victim_env),
                str(out_file),
                "3",
                OVERNIGHT,
            ],
            env,
        )
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        check_victim_lapsed(victim, 4)
    assert proc.returncode == 0, stderr
    doc = final_doc(stdout)
    assert (doc["status"], doc["note"]) == ("done", "worker-complete")
    assert doc["ended_unix"] - doc["started_unix"] > 2 * 2  # alive past the gap, twice
    for secret in (API_KEY, REDIS_AUTH):
        assert secret not in stdout + stderr
    check_hostile(json.loads(out_file.read_text()), env["OVERNIGHT_REDIS_URL"], 2)


@pytest.mark.timeout(180)
def test_hostile_step_as_a_task_agent(env: dict[str, str], tmp_path: Path) -> None:
    tenv = {
        **env,
        "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"],
        "OVERNIGHT_GRACE": "0.5",
        "OVERNIGHT_MODEL_API_KEY": API_KEY,
        "REDISCLI_AUTH": REDIS_AUTH,
    }
    hostile, out_file = tmp_path / "hostile.py", tmp_path / "hostile-out.json"
    hostile.write_text(HOSTILE)
    victim, victim_env = start_victim(env, tmp_path, gap=8)  # outlives the worker's start-up
    try:
        wait_for(victim_env.exists, timeout=20)
        agent = [PY, str(hostile), str(victim_env), str(out_file), "2.5", OVERNIGHT]
        path = task_file(
            tmp_path, "hostile", agent, [["test", "-f", str(out_file)]], heartbeat_gap=2
        )
        path.write_text(path.read_text() + '\n[env]\nTASK_VAR = "declared"\n')
        cli = [OVERNIGHT]
        assert (
            subprocess.run(
                [*cli, "envelope", "reset", "5"], env=tenv, timeout=30, capture_output=True
            ).returncode
            == 0
        )
        sub = subprocess.run(
            [*cli, "submit", str(path)], env=tenv, timeout=30, capture_output=True, text=True
        )
        assert sub.returncode == 0, sub.stderr
        worker = subprocess.run(
            [*cli, "worker", "--burst"], env=tenv, timeout=150, capture_output=True, text=True
        )
    finally:
        check_victim_lapsed(victim, 8)
    assert worker.returncode == 0, worker.stderr[-3000:]
    for secret in (API_KEY, REDIS_AUTH):
        assert secret not in worker.stdout + worker.stderr
    status = subprocess.run(
        [*cli, "status", "hostile"], env=tenv, timeout=30, capture_output=True, text=True
    )
    assert json.loads(status.stdout)["state"] == "finished_verified", status.stdout
    out = json.loads(out_file.read_text())
    assert out["env"]["TASK_VAR"] == "declared" and out["env"]["OVERNIGHT_TASK_ID"] == "hostile"
    assert "OVERNIGHT_PROMPT_FILE" in out["env"]
    check_hostile(out, env["OVERNIGHT_REDIS_URL"], 2)


def test_a_scratch_home_with_read_only_folders_is_removed() -> None:
    from overnight.worker.sandbox.stepenv import make_home, remove_home

    home = Path(make_home("lease-ro"))
    assert oct(home.stat().st_mode & 0o777) == "0o700" and (home / "tmp").is_dir()
    cache = home / "go" / "pkg" / "mod" / "x@v1"
    cache.mkdir(parents=True)
    (cache / "f.go").write_text("package x\n")
    for path in (cache / "f.go", cache, cache.parent, cache.parent.parent):
        path.chmod(0o444 if path.is_file() else 0o555)
    remove_home(str(home))
    assert not home.exists()
