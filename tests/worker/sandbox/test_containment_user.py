"""The step user and a Redis a step cannot get into.

When overnight runs as root, steps run as ``OVERNIGHT_STEP_USER``; a setting that cannot be
honoured ends the command with one line naming it (exit 78), never a silent fallback. Run
as the step user, a hostile agent finds no credential anywhere it can read (its own
environment, every process's ``/proc`` environ, cmdline and memory, root's included), cannot
leave its lease's cgroup, and reaches the private Redis only to be told NOAUTH: it cannot
reset an envelope, touch its task, its lease or anyone else's. The task's end state, the
envelope and the receipts stay what overnight wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.night.embedded_redis import EmbeddedRedis
from overnight.worker.redisio.receipts import read as read_receipts
from overnight.worker.sandbox import cgroup
from overnight.worker.sandbox.stepuser import (
    StepUser,
    StepUserRefused,
    any_of,
    decide,
    workdir_problem,
)
from overnight.worker.supervise.supervisor import StepSpec, run_supervised
from tests import reachable
from tests.helpers import OVERNIGHT, final_doc, lacking, task_file

PY3 = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a step user)")
ALICE = StepUser("alice", 1500, 1500)


# Off: this module proves what the containment holds alone (uid, cgroup, allowlisted
# environment), the promise of OVERNIGHT_SANDBOX=off; its hostile steps also run scripts
# from the test's folder, outside any task tree a sandbox would bind.
@pytest.fixture(autouse=True)
def _containment_alone(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if "env" in request.fixturenames:
        request.getfixturevalue("env")["OVERNIGHT_SANDBOX"] = "off"
    monkeypatch.setenv("OVERNIGHT_SANDBOX", "off")


def find(name: str) -> StepUser | None:
    return {"alice": ALICE, "toor": StepUser("toor", 0, 0)}.get(name)


@pytest.mark.parametrize(
    ("step_user", "allow_root", "euid", "expected"),
    [
        ("alice", False, 0, ALICE),
        ("alice", True, 0, ALICE),  # a step user wins over the opt-in
        (None, True, 0, None),  # root steps, explicitly allowed
        (None, False, 1000, None),  # a plain user: steps run as it
        (None, True, 1000, None),
        (None, False, 0, any_of(61184, 65519)),  # a uid of the default range per task
        ("nosuch", False, 0, "no such user 'nosuch'"),
        ("toor", True, 0, "'toor' has uid 0"),
        ("alice", False, 1000, "cannot be honoured: overnight runs as uid 1000"),
    ],
)
def test_who_steps_run_as(
    step_user: str | None, allow_root: bool, euid: int, expected: StepUser | str | None
) -> None:
    if isinstance(expected, str):
        with pytest.raises(StepUserRefused) as caught:
            decide(step_user, allow_root, euid, find)
        assert caught.value.exit_code == 78 and caught.value.variable == "OVERNIGHT_STEP_USER"
        assert expected in caught.value.message and "\n" not in caught.value.message
    else:
        assert decide(step_user, allow_root, euid, find) == expected


@pytest.mark.parametrize(
    ("uids", "expected"),
    [
        ("1000-1999", any_of(1000, 1999)),
        ("off", "no step user is set and OVERNIGHT_STEP_UIDS is off"),
    ],
)
def test_root_without_a_step_user_takes_a_uid_per_task(uids: str, expected: StepUser | str) -> None:
    if isinstance(expected, str):
        with pytest.raises(StepUserRefused) as caught:
            decide(None, False, 0, find, uids=uids)
        assert expected in caught.value.message and caught.value.exit_code == 78
    else:
        assert decide(None, False, 0, find, uids=uids) == expected
        assert decide(None, True, 0, find, uids=uids) is None  # the root opt-in still wins


@pytest.mark.parametrize(
    ("top", "work", "owner", "problem"),
    [
        (0o755, 0o755, "alice", None),
        (0o755, 0o700, "alice", None),
        (0o755, 0o755, "root", "alice cannot write"),
        (0o755, 0o777, "root", None),
        (0o700, 0o755, "alice", "alice cannot enter"),
        (0o711, 0o700, "alice", None),  # enterable without listing is enough
    ],
)
def test_workdir_problem(top: int, work: int, owner: str, problem: str | None) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        (base / "w").mkdir()
        os.chmod(base, top)
        os.chmod(base / "w", work)
        if owner == "alice":
            os.chown(base / "w", ALICE.uid, ALICE.gid)
        found = workdir_problem(str(base / "w"), ALICE)
        assert (found is None) if problem is None else (found is not None and problem in found)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@ROOT_ONLY
@pytest.mark.parametrize(
    ("args", "settings"),
    [
        (["supervise", "--", "true"], {"OVERNIGHT_STEP_UIDS": "off"}),
        (["worker", "--burst"], {"OVERNIGHT_STEP_UIDS": "off"}),
        (["up", "--exit-when-done"], {"OVERNIGHT_STEP_UIDS": "off"}),
        (["supervise", "--", "true"], {"OVERNIGHT_STEP_USER": "no-such-user-x"}),
        (["worker", "--burst"], {"OVERNIGHT_STEP_USER": "root"}),
        (["demo"], {"OVERNIGHT_STEP_USER": "no-such-user-x"}),
        (["supervise", "--", "true"], {"OVERNIGHT_ALLOW_ROOT_STEPS": "perhaps"}),
    ],
)
def test_commands_that_run_steps_refuse_with_one_line(
    args: list[str], settings: dict[str, str], env: dict[str, str], tmp_path: Path
) -> None:
    env = {k: v for k, v in env.items() if k != "OVERNIGHT_ALLOW_ROOT_STEPS"}
    proc = subprocess.run(
        [OVERNIGHT, *args],
        env={**env, **settings},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 78, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        "OVERNIGHT_ALLOW_ROOT_STEPS" if "perhaps" in settings.values() else "OVERNIGHT_STEP_USER"
    ) in lines[0]


@ROOT_ONLY
def test_a_step_user_cannot_be_honoured_by_a_plain_user(env: dict[str, str]) -> None:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("no setpriv")
    as_nobody = [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
    proc = subprocess.run(
        [*as_nobody, reachable.overnight(), "supervise", "--", "true"],
        env={**env, "OVERNIGHT_STEP_USER": "nobody"},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 78, proc.stderr
    assert proc.stderr.count("\n") == 1 and "OVERNIGHT_STEP_USER: cannot be honoured" in proc.stderr


# --- a hostile step run as the step user -------------------------------------------------

# Looks everywhere a step could find a credential and reports what it read; tries Redis
# by its port (no password: it has none); tries to leave its cgroup. The test, as root,
# searches the report for the secrets.
PROBE = textwrap.dedent(
    r"""
    import errno, json, os, pathlib, socket, subprocess, sys, time
    port, out = int(sys.argv[1]), pathlib.Path(sys.argv[2])
    pathlib.Path("ok.txt").write_text("ok")
    # A process of its own uid besides itself, whose environ it must be able to read.
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "sibling"])
    while b"sibling" not in open(f"/proc/{sibling.pid}/cmdline", "rb").read():
        time.sleep(0.01)  # until it has exec'd

    def err(exc):
        return errno.errorcode.get(exc.errno, str(exc.errno))

    def read(path, limit=1 << 20):
        try:
            with open(path, "rb") as fh:
                return fh.read(limit).decode("latin-1"), None
        except OSError as exc:
            return "", err(exc)

    def resp(*words):
        payload = b"*%d\r\n" % len(words)
        for word in words:
            payload += b"$%d\r\n%s\r\n" % (len(word), word.encode())
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(payload)
            return s.recv(200).decode("latin-1").strip()

    me = os.getpid()
    procs = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        row = {}
        row["environ_text"], row["environ"] = read(f"/proc/{name}/environ")
        row["cmdline_text"], row["cmdline"] = read(f"/proc/{name}/cmdline")
        try:
            with open(f"/proc/{name}/mem", "rb") as fh:
                fh.read(1)
            row["mem"] = "opened"
        except OSError as exc:
            row["mem"] = err(exc)
        status, _ = read(f"/proc/{name}/status")
        row["uid"] = next((int(l.split()[1]) for l in status.splitlines()
                           if l.startswith("Uid:")), -1)
        procs[name] = row
    prompt, _ = read(os.environ.get("OVERNIGHT_PROMPT_FILE", "/nonexistent"))
    cgroup_line, _ = read("/proc/self/cgroup")
    mine = [l.split("::", 1)[1] for l in cgroup_line.splitlines() if l.startswith("0::")]
    escape = {}
    for target in ("/sys/fs/cgroup/unified/cgroup.procs", "/sys/fs/cgroup/cgroup.procs"):
        try:
            with open(target, "w") as fh:
                fh.write(str(me))
            escape[target] = "MOVED"
        except OSError as exc:
            escape[target] = err(exc)
    redis = {
        "ping": resp("PING"),
        "auth": resp("AUTH", "guess"),
        "reset": resp("HSET", "overnight:envelope", "remaining", "1000000"),
        "eval": resp("EVAL", "return redis.call('FLUSHALL')", "0"),
        "rpush": resp("RPUSH", "rq:queue:x", "job"),
    }
    report = {"uid": os.getuid(), "env": dict(os.environ), "prompt": prompt, "procs": procs,
              "cgroup": mine,
              "escape": escape, "redis": redis, "home": oct(os.stat(os.environ["HOME"]).st_mode),
              "home_uid": os.stat(os.environ["HOME"]).st_uid}
    out.write_text(json.dumps(report))
    sibling.kill()
    sibling.wait()
    print("probe done", flush=True)
    """
)


@pytest.fixture
def stage(step_user: StepUser) -> Iterator[Path]:
    """A folder the step user owns (pytest's tmp folders are root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="overnight-user-", dir="/tmp"))
    (path / "probe.py").write_text(PROBE)
    os.chmod(path, 0o755)
    os.chown(path, step_user.uid, step_user.gid)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def check_probe(report: dict[str, Any], user: StepUser, secrets: list[str], port: int) -> None:
    assert report["uid"] == user.uid
    assert report["home_uid"] == user.uid and report["home"].endswith("700")
    text = json.dumps(report)
    for secret in secrets:
        assert secret not in text
    # The attack is real: it read the environment and command line of processes it may.
    readable = [r for r in report["procs"].values() if r["environ"] is None]
    assert any("sibling" in r["cmdline_text"] for r in readable), "it read no environ at all"
    assert all(r["uid"] == user.uid for r in readable), "read another user's environ"
    roots = [r for r in report["procs"].values() if r["uid"] == 0]
    assert roots and all(r["environ"] == "EACCES" and r["mem"] == "EACCES" for r in roots)
    # Redis: reachable by its port, but nothing without the password.
    redis_answers = report["redis"]
    assert redis_answers["ping"].startswith("-NOAUTH"), redis_answers
    assert redis_answers["auth"].startswith("-WRONGPASS"), redis_answers
    for what in ("reset", "eval", "rpush"):
        assert redis_answers[what].startswith("-NOAUTH"), redis_answers
    if not cgroup.available():
        lacking("no cgroup v2 here: the step's own cgroup was not checked")
    assert report["cgroup"] and "/overnight/" in report["cgroup"][0]
    assert "MOVED" not in report["escape"].values(), report["escape"]


@ROOT_ONLY
@pytest.mark.timeout(60)
def test_a_hostile_step_under_supervise_runs_as_the_step_user_and_gets_nothing(
    env: dict[str, str], stage: Path, step_user: StepUser, redis_server: EmbeddedRedis
) -> None:
    assert redis_server.password
    key = f"sk-{uuid.uuid4().hex}"
    env = {**env, "OVERNIGHT_STEP_USER": step_user.name, "OVERNIGHT_MODEL_API_KEY": key}
    out = stage / "report.json"
    proc = subprocess.run(
        [
            OVERNIGHT,
            "supervise",
            "--",
            PY3,
            str(stage / "probe.py"),
            str(redis_server.port),
            str(out),
        ],
        env=env,
        cwd=stage,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stderr
    assert (final_doc(proc.stdout)["status"], final_doc(proc.stdout)["note"]) == (
        "done",
        "worker-complete",
    )
    check_probe(
        json.loads(out.read_text()), step_user, [redis_server.password, key], redis_server.port
    )


@ROOT_ONLY
@pytest.mark.timeout(180)
def test_a_hostile_task_agent_leaves_the_task_envelope_and_receipts_truthful(
    env: dict[str, str],
    stage: Path,
    step_user: StepUser,
    redis_server: EmbeddedRedis,
    r: redis.Redis,
    namespace: str,
) -> None:
    assert redis_server.password
    key = f"sk-{uuid.uuid4().hex}"
    tenv = {
        **env,
        "OVERNIGHT_STEP_USER": step_user.name,
        "OVERNIGHT_MODEL_API_KEY": key,
        "OVERNIGHT_QUEUE": namespace,
        "OVERNIGHT_GRACE": "0.5",
    }
    out = stage / "report.json"
    uid = str(step_user.uid)
    # The agent runs as the step user, and so do its rules (never as overnight's own user).
    rules = [["test", "-f", "ok.txt"], ["sh", "-c", f'test "$(id -u)" = {uid}']]
    hostile = task_file(
        stage, "hostile", [PY3, str(stage / "probe.py"), str(redis_server.port), str(out)], rules
    )
    benign = task_file(stage, "benign", ["sh", "-c", "echo ok > ok.txt"], rules)
    for folder in (stage / "hostile", stage / "benign"):
        os.chown(folder, step_user.uid, step_user.gid)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [OVERNIGHT, *args], env=tenv, capture_output=True, text=True, timeout=150
        )

    assert cli("envelope", "reset", "10").returncode == 0
    assert cli("submit", str(hostile), str(benign)).returncode == 0
    worker = cli("worker", "--burst")
    assert worker.returncode == 0, worker.stderr[-3000:]
    for task in ("hostile", "benign"):
        state = json.loads(cli("status", task).stdout)
        assert state["state"] == "finished_verified", json.dumps(state)[-1500:]
        assert state["calls_used"] == 3, state  # one agent step and two rules, one turn
    check_probe(
        json.loads(out.read_text()), step_user, [redis_server.password, key], redis_server.port
    )
    # The envelope: exactly what the two tasks spent.
    envelope = json.loads(cli("envelope", "status").stdout)
    assert envelope["remaining"] == 4, envelope
    # The prompt folder: the task's own, only the step user can enter it.
    report = json.loads(out.read_text())
    prompt = Path(report["env"]["OVERNIGHT_PROMPT_FILE"])
    assert report["prompt"].startswith("Assignment:")  # the step user reads its prompt
    info = os.stat(prompt.parent)
    assert info.st_uid == step_user.uid and stat.S_IMODE(info.st_mode) == 0o700
    assert stat.S_IMODE(os.stat(prompt.parent.parent).st_mode) == 0o711
    # Every lease of the hostile task ended as overnight saw it, by the supervisor.
    ended = [
        rc
        for rc in read_receipts(r, Keys(namespace), task_id="hostile")
        if rc.kind == "lease_ended"
    ]
    assert len(ended) == 3 and all(rc.data["status"] == "done" for rc in ended), ended


@ROOT_ONLY
def test_a_workdir_the_step_user_cannot_write_stops_the_step_with_one_line(
    r: redis.Redis, namespace: str, step_user: StepUser, tmp_path: Path
) -> None:
    lines: list[bytes] = []
    spec = StepSpec(argv=["touch", "x"], cwd=str(tmp_path), user=step_user, gap=5)
    result = run_supervised(r, Keys(namespace), spec, on_output=lines.append)
    assert result.exit_code == 126 and result.returncode is None
    assert len(lines) == 1 and b"the step user cannot use the workdir" in lines[0], lines
    assert not (tmp_path / "x").exists()


@ROOT_ONLY
def test_the_step_user_can_use_git_in_its_task_worktree(
    env: dict[str, str], stage: Path, step_user: StepUser, namespace: str
) -> None:
    """The task's worktree belongs to the step user but its repository to overnight: the
    agent's git commands still work there (safe.directory for that worktree only)."""
    tenv = {
        **env,
        "OVERNIGHT_STEP_USER": step_user.name,
        "OVERNIGHT_QUEUE": namespace,
        "OVERNIGHT_GRACE": "0.5",
        "OVERNIGHT_STATE_DIR": str(stage / "state"),
    }
    agent = ["sh", "-c", "git log -1 --format=%s > seen.txt && git status --short >> seen.txt"]
    path = task_file(stage, "gitty", agent, [["sh", "check.sh"]])
    repo = stage / "gitty"
    (repo / "check.sh").write_text("grep -q 'the base' seen.txt\n")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    for args in (["init", "-q", "."], ["add", "."], ["commit", "-qm", "the base"]):
        subprocess.run([*git, *args], cwd=repo, check=True, timeout=30)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [OVERNIGHT, *args], env=tenv, capture_output=True, text=True, timeout=150
        )

    assert cli("envelope", "reset", "10").returncode == 0
    submitted = cli("submit", str(path))
    assert submitted.returncode == 0, submitted.stderr
    worker = cli("worker", "--burst")
    assert worker.returncode == 0, worker.stderr[-3000:]
    state = json.loads(cli("status", "gitty").stdout)
    assert state["state"] == "finished_verified", json.dumps(state)[-1500:]
    shown = cli("diff", "gitty")
    assert "+the base" in shown.stdout, shown.stdout + shown.stderr
