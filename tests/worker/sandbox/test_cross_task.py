"""Two tasks at once, as root with a uid per task (OVERNIGHT_STEP_UIDS, no step user): task B's
agent tries to read task A's agent's environment (its secrets), to kill it and to write into
A's worktree, and each fails, with the sandbox off and in bubblewrap. The benign twin, task
C, does the same to its own child process and its own worktree in the same run, and each
works: the attack ran and failed because the uids differ, not because it never ran.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from overnight.config.defaults import STEP_PIDS
from overnight.worker.sandbox import launch
from tests.helpers import OVERNIGHT, capability, cli, pid_alive, task_file, wait_for, worker_env

PY3 = "/usr/bin/python3"
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="a uid per task needs root"),
    capability(None if os.access(PY3, os.X_OK) else "no system python3"),
    pytest.mark.timeout(240),
]

# Task A's agent: beats by printing until the test lets it finish.
HOLDER = """
import os, pathlib, sys, time
end = time.monotonic() + 120
while not pathlib.Path("release").exists() and time.monotonic() < end:
    print("A-AGENT alive", flush=True)
    time.sleep(0.3)
pathlib.Path("ok.txt").write_text("a\\n")
"""

# Task B's (and C's) agent: the three moves against TARGET_PID and TARGET_TREE ("self": its
# own child, holding SECRET in its environment, and its own worktree).
PROBE = """
import grp, json, os, pwd, resource, signal, subprocess, time
secret = os.environ["SECRET"]
pid, tree = os.environ["TARGET_PID"], os.environ["TARGET_TREE"]
child = None
if pid == "self":
    child = subprocess.Popen(["sleep", "60"], env={"SECRET": secret, "PATH": os.defpath})
    pid, tree = str(child.pid), os.getcwd()
    end = time.monotonic() + 10  # until the child has run sleep (its own environment)
    while b"sleep" not in open(f"/proc/{pid}/cmdline", "rb").read() and time.monotonic() < end:
        time.sleep(0.02)
got = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups()}
got["nproc"] = list(resource.getrlimit(resource.RLIMIT_NPROC))
try:
    got["name"] = pwd.getpwuid(os.getuid()).pw_name + ":" + grp.getgrgid(os.getgid()).gr_name
except KeyError:
    got["name"] = None
try:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        got["environ"] = "read " + ("with" if secret.encode() in fh.read() else "without")
except OSError as exc:
    got["environ"] = exc.strerror
try:
    os.kill(int(pid), signal.SIGKILL)
    got["kill"] = "sent"
except OSError as exc:
    got["kill"] = exc.strerror
try:
    with open(os.path.join(tree, "planted.txt"), "w") as fh:
        fh.write("planted\\n")
    got["write"] = "written"
except OSError as exc:
    got["write"] = exc.strerror
if child is not None:
    child.wait(10)
with open("report.json", "w") as fh:
    json.dump(got, fh)
print("REPORT", json.dumps(got), flush=True)
"""


@pytest.fixture(params=["off", "bwrap"])
def sandbox(request: pytest.FixtureRequest) -> str:
    mode = str(request.param)
    if mode == "bwrap" and launch.find_bwrap() is None:
        pytest.skip("bubblewrap is not installed")  # capability() marks the whole module
    return mode


@pytest.fixture
def stage() -> Iterator[Path]:
    """A folder every uid may enter (pytest's own tree is closed to them)."""
    folder = Path(f"/tmp/overnight-xtask-{uuid.uuid4().hex[:10]}")
    folder.mkdir(mode=0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def with_env(path: Path, **env: str) -> Path:
    """The task file at ``path`` with an ``[env]`` table of ``env``."""
    lines = ["[env]", *(f"{key} = {json.dumps(value)}" for key, value in env.items())]
    path.write_text(path.read_text() + "\n".join(lines) + "\n")
    return path


def repo(path: Path) -> None:
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    (path / "README").write_text("base\n")
    for args in (["init", "-q", "."], ["add", "."], ["commit", "-qm", "base"]):
        subprocess.run([*git, *args], cwd=path, check=True, timeout=30, capture_output=True)


def agent_of(secret: str) -> int | None:
    """The pid of task A's agent (its Python, holding ``secret`` in its environment)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != "python3":
                continue
            if secret.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                return int(pid)
        except OSError:
            continue
    return None


def uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


def uid_pool_env(env: dict[str, str], stage: Path, sandbox: str) -> tuple[int, dict[str, str]]:
    """A worker's environment with a uid per task from a range of 8 of its own (its first
    uid returned), state under ``stage``, no step user and no root steps."""
    first = 1_600_000_000 + secrets.randbelow(1_000_000) * 8
    wenv = worker_env(
        {k: v for k, v in env.items() if k != "OVERNIGHT_ALLOW_ROOT_STEPS"},
        OVERNIGHT_SANDBOX=sandbox,
        OVERNIGHT_STATE_DIR=str(stage / "state"),
        OVERNIGHT_STEP_UIDS=f"{first}-{first + 7}",
    )
    wenv.pop("OVERNIGHT_STEP_USER", None)
    return first, wenv


def test_a_task_cannot_read_kill_or_write_another_task(
    env: dict[str, str], stage: Path, sandbox: str
) -> None:
    first, wenv = uid_pool_env(env, stage, sandbox)
    state = stage / "state"
    secret_a, secret_c = f"A-{uuid.uuid4().hex}", f"C-{uuid.uuid4().hex}"
    rules = [["test", "-f", "ok.txt"]]
    path_a = with_env(task_file(stage, "a", [PY3, "-c", HOLDER], rules), SECRET=secret_a)
    repo(stage / "a")
    assert cli(wenv, "envelope", "reset", "20").returncode == 0
    assert cli(wenv, "submit", str(path_a)).returncode == 0
    with (stage / "worker-a.log").open("wb") as log:
        worker_a = subprocess.Popen(
            [OVERNIGHT, "worker", "--burst"], env=wenv, stdout=subprocess.DEVNULL, stderr=log
        )
    try:
        agent = wait_for(lambda: agent_of(secret_a), timeout=60)
        tree_a = wait_for(lambda: next(state.glob("worktrees/*/a-*"), None), timeout=10)
        uid_a = uid_of(agent)
        assert first <= uid_a <= first + 7
        probe = [PY3, "-c", PROBE + "\nopen('ok.txt', 'w').write('x')\n"]
        targets = {"b": (str(agent), str(tree_a), secret_a), "c": ("self", "self", secret_c)}
        paths = []
        for name, (pid, tree, secret) in targets.items():
            task_env = {"SECRET": secret, "TARGET_PID": pid, "TARGET_TREE": tree}
            paths.append(str(with_env(task_file(stage, name, probe, rules), **task_env)))
            repo(stage / name)
        assert cli(wenv, "submit", *paths).returncode == 0
        worker_bc = cli(wenv, "worker", "--burst", timeout=180)
        assert worker_bc.returncode == 0, worker_bc.stderr[-3000:]
        reports = {}
        for name in ("b", "c"):
            state_of = json.loads(cli(wenv, "status", name).stdout)
            assert state_of["state"] == "finished_verified", json.dumps(state_of)[-1500:]
            tree = next(state.glob(f"worktrees/*/{name}-*"))
            reports[name] = json.loads((tree / "report.json").read_text())
            assert tree.stat().st_uid == 0  # given back when the task ended
            prompts = next(state.glob(f"prompts/*/{name}"))
            assert prompts.stat().st_uid == 0 and (prompts / "prompt.txt").stat().st_uid == 0
        attack, benign = reports["b"], reports["c"]
        # The benign twin: its own child and its own worktree, as its own uid.
        assert benign["environ"] == "read with", benign
        assert benign["kill"] == "sent" and benign["write"] == "written", benign
        # The attack: another uid (gid alike, no groups), and every move failed.
        assert attack["uid"] != uid_a and first <= attack["uid"] <= first + 7, attack
        assert attack["gid"] == attack["uid"] and attack["groups"] == [], attack
        assert not attack["environ"].startswith("read"), attack
        assert attack["kill"] != "sent" and attack["write"] != "written", attack
        assert pid_alive(agent) and uid_of(agent) == uid_a
        # RLIMIT_NPROC counts the step's own uid: none of its processes ran at launch, so
        # the limit is the step's pids alone, a per-task limit.
        assert attack["nproc"] == benign["nproc"] == [STEP_PIDS] * 2, (attack, benign)
        # No account has the uid; the sandbox's /etc/passwd and /etc/group name it.
        named = f"overnight-{attack['uid']}"
        assert attack["name"] == (f"{named}:{named}" if sandbox == "bwrap" else None), attack
        assert not (tree_a / "planted.txt").exists()
        (tree_a / "release").write_text("go\n")
        assert worker_a.wait(timeout=120) == 0, (stage / "worker-a.log").read_text()[-3000:]
    finally:
        if worker_a.poll() is None:
            worker_a.kill()
            worker_a.wait(timeout=30)
    state_a = json.loads(cli(wenv, "status", "a").stdout)
    assert state_a["state"] == "finished_verified", json.dumps(state_a)[-1500:]


# Task B's agent: looks for task A's commit (its marker, its sha) in every way git offers,
# through its own repository and through the user's, then uses git on its own work.
SNOOP = """
import json, os, subprocess
marker, sha, user_repo = os.environ["MARKER"], os.environ["A_HEAD"], os.environ["USER_REPO"]

def git(*args):
    proc = subprocess.run(["git", *args], capture_output=True, timeout=60)
    return proc.returncode, (proc.stdout + proc.stderr).decode("utf-8", "replace")

got = {}
got["own_all_objects"] = marker in git("cat-file", "--batch-all-objects", "--batch")[1]
got["own_by_sha"] = git("cat-file", "-e", sha)[0] == 0
got["own_refs"] = git("for-each-ref", "--format=%(refname)")[1].split()
user = ["--git-dir", os.path.join(user_repo, ".git")]
got["user_repo"] = marker in git(*user, "grep", marker, "refs/heads/overnight/a")[1]
# The benign twin, in the same step: its base, a commit of its own, read back.
got["log"] = git("log", "--format=%s")[1].split("\\n")[0]
open("mine.txt", "w").write("mine\\n")
code, out = git("add", "mine.txt")
code2, out2 = git("commit", "-qm", "mine")
got["commit"] = code == code2 == 0 or out + out2
got["own_commit"] = git("log", "-1", "--format=%s")[1].strip()
open("ok.txt", "w").write("x")
json.dump(got, open("report.json", "w"))
print("REPORT", json.dumps(got), flush=True)
"""


def test_a_task_reads_no_other_tasks_commits_and_commits_in_its_own_repository(
    env: dict[str, str], stage: Path, sandbox: str
) -> None:
    """Two tasks on one repository: task A commits a marker on its branch; task B's agent
    then searches its repository (every object, A's commit by sha) and the user's for it.
    Its tree's repository is its own (the base and its own commits only), and in the
    sandbox the user's repository is not there; the twin without the sandbox reads the
    marker through the user's repository (the search really ran), and in both B's agent
    commits in its own repository while overnight commits its tree on ``overnight/b``."""
    _, wenv = uid_pool_env(env, stage, sandbox)
    state = stage / "state"
    shared = stage / "shared"
    shared.mkdir()
    repo(shared)
    marker = f"MARKER-{uuid.uuid4().hex}"
    writer = f"open('secret.txt', 'w').write('{marker}\\n'); open('ok.txt', 'w').write('a')"
    rules = [["test", "-f", "ok.txt"]]

    def task(name: str, agent: list[str], **task_env: str) -> Path:
        path = task_file(stage, name, agent, rules)
        path.write_text(path.read_text().replace(f'workdir = "{name}"', 'workdir = "shared"'))
        return with_env(path, **task_env) if task_env else path

    assert cli(wenv, "envelope", "reset", "20").returncode == 0
    assert cli(wenv, "submit", str(task("a", [PY3, "-c", writer]))).returncode == 0
    worked = cli(wenv, "worker", "--burst", timeout=180)
    assert worked.returncode == 0, worked.stderr[-3000:]
    status_a = json.loads(cli(wenv, "status", "a").stdout)
    assert status_a["state"] == "finished_verified", json.dumps(status_a)[-1500:]
    a_head = status_a["head"]
    shown = subprocess.run(
        ["git", "show", f"{a_head}:secret.txt"], cwd=shared, capture_output=True, text=True
    )
    assert shown.stdout == f"{marker}\n"  # A's commit holds the marker

    path_b = task("b", [PY3, "-c", SNOOP], MARKER=marker, A_HEAD=a_head, USER_REPO=str(shared))
    assert cli(wenv, "submit", str(path_b)).returncode == 0
    worked = cli(wenv, "worker", "--burst", timeout=180)
    assert worked.returncode == 0, worked.stderr[-3000:]
    status_b = json.loads(cli(wenv, "status", "b").stdout)
    assert status_b["state"] == "finished_verified", json.dumps(status_b)[-1500:]
    tree_b = next(state.glob("worktrees/*/b-*"))
    got = json.loads((tree_b / "report.json").read_text())
    # Its own repository: the base and its own commit, nothing of task A's.
    assert got["own_all_objects"] is False and got["own_by_sha"] is False, got
    assert got["own_refs"] == ["refs/heads/overnight/b"], got
    assert got["log"] == "base" and got["commit"] is True and got["own_commit"] == "mine", got
    # The user's repository: not in the sandbox; readable without it (the search ran).
    assert got["user_repo"] is (sandbox == "off"), got
    # overnight's commit after the turn carries the tree, on the task's branch.
    files = subprocess.run(
        ["git", "ls-tree", "--name-only", status_b["head"]],
        cwd=shared,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert "mine.txt" in files and "secret.txt" not in files, files
