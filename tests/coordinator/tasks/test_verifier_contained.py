"""A verifier rule runs as the step user, never as overnight's own user (root here): the
agent's code a rule imports cannot read overnight's secrets, write root's folders or plant a
setuid-root program; a program planted on a PATH folder the step user can write never runs
in a rule, nor as overnight's git; a git config the agent points its worktree at runs
nothing as overnight. Real loop runs (supervised steps under leases, a private Redis), with
and without the sandbox; each attack has its benign twin."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.tasks.loop import LoopConfig, TaskLoop
from overnight.coordinator.tasks.steps import supervised_runner
from overnight.coordinator.tasks.store import Runner, TaskRecord, TaskStore
from overnight.coordinator.tasks.taskfile import TaskSpec, command_problems, load
from overnight.coordinator.workspace import git as overnight_git
from overnight.coordinator.workspace.rulepath import Node, open_to, rule_path
from overnight.worker.sandbox import launch
from overnight.worker.sandbox.stepuser import StepUser
from tests.helpers import lacking
from tests.repos import make_repo

D, L = stat.S_IFDIR, stat.S_IFLNK
SYSTEM_PYTHON = launch.system_python() or "/usr/bin/python3"
ME, GROUP = 1001, 1001

# --- the PATH rule, as a table --------------------------------------------------------------


@pytest.mark.parametrize(
    ("chain", "open_"),
    [
        ([Node(0, 0, D | 0o755), Node(0, 0, D | 0o755)], False),  # /usr/bin
        ([Node(ME, GROUP, D | 0o755), Node(0, 0, D | 0o755)], True),  # its own folder
        ([Node(0, 0, D | 0o777), Node(0, 0, D | 0o755)], True),  # anyone writes it
        ([Node(0, GROUP, D | 0o775), Node(0, 0, D | 0o755)], True),  # its group writes it
        ([Node(0, 0, D | 0o775), Node(0, 0, D | 0o755)], False),  # another group's
        ([Node(0, 0, D | 0o755), Node(ME, GROUP, D | 0o755), Node(0, 0, D | 0o755)], True),
        ([Node(0, 0, D | 0o755), Node(0, 0, D | 0o777), Node(0, 0, D | 0o755)], True),  # renamed
        # /tmp/x: sticky, so only its own entries can be renamed
        ([Node(0, 0, D | 0o755), Node(0, 0, D | 0o1777), Node(0, 0, D | 0o755)], False),
        ([Node(ME, 0, D | 0o755), Node(0, 0, D | 0o1777), Node(0, 0, D | 0o755)], True),
        ([Node(0, 0, L | 0o777), Node(0, 0, D | 0o755)], False),  # a link's mode means nothing
        ([Node(0, 0, D | 0o755)], False),  # /
    ],
)
def test_a_folder_open_to_a_uid(chain: list[Node], open_: bool) -> None:
    assert open_to(chain, ME, {GROUP}) is open_
    assert open_to(chain, 0, set()) is True


def test_rule_path_keeps_system_folders_and_drops_what_the_step_user_writes(
    step_user: StepUser, top: Path
) -> None:
    mine, theirs = top / "mine", top / "theirs"
    mine.mkdir()
    theirs.mkdir(mode=0o755)
    os.chown(mine, step_user.uid, step_user.gid)
    os.chmod(theirs, 0o755)
    link = top / "link"
    link.symlink_to(mine)
    who = (step_user.uid, (step_user.gid, *step_user.groups))
    path = f"/usr/bin:{mine}:rel:{theirs}:{link}:/bin:{top}/missing"
    assert rule_path(path, [], who) == f"/usr/bin:{theirs}:/bin"
    assert rule_path(path, [str(theirs)], who) == "/usr/bin:/bin"
    assert rule_path(f"{mine}", [], who) == "/usr/bin:/bin"
    assert rule_path(path, [], None) == f"/usr/bin:{mine}:{theirs}:{link}:/bin:{top}/missing"


@pytest.mark.parametrize("theirs", [True, False])
def test_submit_looks_a_rule_up_on_the_same_path(
    step_user: StepUser, top: Path, theirs: bool
) -> None:
    folder = top / "bin"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    program = folder / "mycheck"
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    if theirs:  # the step user could have put it there
        os.chown(folder, step_user.uid, step_user.gid)
    spec = TaskSpec.model_validate(
        {"assignment": "a", "verifier": [{"name": "c", "run": ["mycheck"]}]}
    )
    problems = command_problems(spec, f"{folder}:/usr/bin:/bin", step_user)
    if theirs:
        assert problems == [("verifier[0].run", "rule c: command 'mycheck' not found")]
    else:
        assert problems == []


# --- the loop, with the step user, sandboxed and not -----------------------------------------


@pytest.fixture
def top() -> Iterator[Path]:
    """A folder the step user can walk (pytest's are root's and 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="overnight-verifier-", dir="/tmp"))
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=["off", "bwrap"])
def sandbox(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    mode = str(request.param)
    if mode == "bwrap" and launch.find_bwrap() is None:
        lacking("bubblewrap is not installed")
    monkeypatch.setenv("OVERNIGHT_SANDBOX", mode)
    launch.configured.cache_clear()
    yield mode
    launch.configured.cache_clear()


def run(
    r: redis.Redis,
    namespace: str,
    top: Path,
    user: StepUser,
    calc: str,
    *,
    agent_extra: str = "",
    env: dict[str, str] | None = None,
) -> TaskRecord:
    """One task on a repository at ``top/repo`` (made if missing) whose agent writes
    ``calc`` as calc.py (and runs ``agent_extra``); its rule is ``python3 check.py``
    (protected: check.py imports calc)."""
    if not (top / "repo").exists():
        make_repo(top / "repo")
    agent = f"import pathlib; pathlib.Path('calc.py').write_text({calc!r})\n{agent_extra}"
    data = {
        "id": "t",
        "assignment": "fix add in calc.py",
        "workdir": "repo",
        "agent": [SYSTEM_PYTHON, "-c", agent],
        "max_calls": 2,
        "env": env or {},
        "verifier": [{"name": "check", "run": ["python3", "check.py"]}],
    }
    path = top / "task.json"
    path.write_text(json.dumps(data))
    state = top / "state"
    store = TaskStore(r, Keys(namespace))
    [rec] = store.create([load(path, state)], queue="q")
    config = LoopConfig(
        claim_ttl=5,
        grace=0.5,
        prompt_dir=top / "prompts",
        log_dir=top / "logs",
        state_dir=state,
        step_user=user,
    )
    runner = supervised_runner(r, Keys(namespace), user=user)
    TaskLoop(store, runner, lambda *_: None, config).run(rec.id, rec.attempt, Runner(worker="t"))
    got = store.get(rec.id)
    assert got is not None
    return got


def rule_tail(rec: TaskRecord) -> str:
    return "\n".join(s.tail for s in rec.checkpoint.steps if s.name == "check")


HOSTILE = """
import os, shutil, stat
landed = []

def attempt(name, act):
    try:
        act()
    except OSError as exc:
        print("refused", name, type(exc).__name__, flush=True)
        return
    landed.append(name)
    print("LANDED", name, flush=True)

def environ():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            data = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        if b"OVERNIGHT_REDIS_URL" in data:
            print("read", pid, data[:0], flush=True)
            return
    raise PermissionError("no environment naming a Redis URL could be read")

def root_only():
    with open(os.path.join(os.environ["ROOT_ONLY"], "planted"), "w") as fh:
        fh.write("x")

def setuid_root():
    shutil.copy("/bin/sh", "sh")
    os.chmod("sh", 0o4755)
    info = os.stat("sh")
    if info.st_uid != 0 or not info.st_mode & stat.S_ISUID:
        os.chown("sh", 0, 0)  # what it takes to make it root's
        os.chmod("sh", 0o4755)

print("uid", os.getuid(), flush=True)
attempt("environ", environ)
attempt("root-only", root_only)
attempt("setuid", setuid_root)

def add(a, b):
    return a + b if landed else a - b
"""

BENIGN = """
import os, pathlib
print("uid", os.getuid(), flush=True)
pathlib.Path("proof.txt").write_text("ran")
ok = pathlib.Path("proof.txt").read_text() == "ran"

def add(a, b):
    return a + b if ok else a - b
"""


def test_agent_code_a_rule_imports_cannot_reach_overnights_secrets_or_root(
    r: redis.Redis,
    namespace: str,
    env: dict[str, str],
    top: Path,
    step_user: StepUser,
    sandbox: str,
) -> None:
    root_only = top / "root-only"
    root_only.mkdir(mode=0o700)
    assert "OVERNIGHT_REDIS_URL" in os.environ  # what the attack looks for in this process
    rec = run(r, namespace, top, step_user, HOSTILE, env={"ROOT_ONLY": str(root_only)})
    tail = rule_tail(rec)
    assert rec.state != "finished_verified", tail
    assert f"uid {step_user.uid}" in tail, tail
    for name in ("environ", "root-only", "setuid"):
        assert f"refused {name} " in tail, tail
    assert "LANDED" not in tail, tail
    assert not (root_only / "planted").exists()


def test_its_twin_the_same_import_writes_its_checkout_and_passes(
    r: redis.Redis,
    namespace: str,
    env: dict[str, str],
    top: Path,
    step_user: StepUser,
    sandbox: str,
) -> None:
    rec = run(r, namespace, top, step_user, BENIGN)
    assert rec.state == "finished_verified", (rec.detail, rule_tail(rec))
    assert f"uid {step_user.uid}" in rule_tail(rec)


SHIM = "#!/bin/sh\ntouch {marks}/{name}-ran-as-$(id -u)\n{then}\n"
FIXED_CALC = "def add(a, b):\n    return a + b\n"
BUGGY_CALC = "def add(a, b):\n    return a - b\n"


def shims(top: Path, user: StepUser, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder of the step user's first on the worker's PATH, holding what a step could
    have planted there: a ``python3`` that passes anything, a ``git`` that passes through.
    Returns the folder where each says it ran. The task's repository is made first (by the
    test's own git)."""
    make_repo(top / "repo")
    folder, marks = top / "shims", top / "marks"
    folder.mkdir()
    marks.mkdir(mode=0o777)
    os.chmod(marks, 0o777)
    for name, then in (("python3", "exit 0"), ("git", f'exec {overnight_git.program()} "$@"')):
        shim = folder / name
        shim.write_text(SHIM.format(marks=marks, name=name, then=then))
        shim.chmod(0o755)
        os.chown(shim, user.uid, user.gid)
    os.chown(folder, user.uid, user.gid)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    assert shutil.which("python3") == str(folder / "python3")
    return marks


def test_a_shim_on_a_path_folder_the_step_user_writes_decides_nothing(
    r: redis.Redis,
    namespace: str,
    env: dict[str, str],
    top: Path,
    step_user: StepUser,
    sandbox: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    marks = shims(top, step_user, monkeypatch)
    rec = run(r, namespace, top, step_user, BUGGY_CALC)
    assert rec.state != "finished_verified", rule_tail(rec)
    assert rec.checkpoint.head is not None  # overnight committed the turn, with its own git
    assert not list(marks.glob("git-ran-as-0")) and not list(marks.glob("python3-*"))


def test_its_twin_an_honest_fix_under_the_same_path_is_verified(
    r: redis.Redis,
    namespace: str,
    env: dict[str, str],
    top: Path,
    step_user: StepUser,
    sandbox: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    marks = shims(top, step_user, monkeypatch)
    rec = run(r, namespace, top, step_user, FIXED_CALC)
    assert rec.state == "finished_verified", (rec.detail, rule_tail(rec))
    assert not list(marks.glob("git-ran-as-0"))


# The agent points its tree's .git at a repository of its own whose config runs a program
# on any git command that trusts it (fsmonitor, hooks, a clean filter).
REPOINT = """
import os, pathlib, shutil, subprocess
evil = pathlib.Path("evil-git").resolve()
subprocess.run(["git", "init", "-q", "--bare", str(evil)], check=True)
mark = "touch {marks}/git-config-ran-as-$(id -u)"
hooks = evil / "hooks"
for hook in ("pre-commit", "post-commit", "post-checkout", "reference-transaction"):
    (hooks / hook).write_text("#!/bin/sh\\n" + mark + "\\n")
    (hooks / hook).chmod(0o755)
with open(evil / "config", "a") as fh:
    fh.write("[core]\\n\\tbare = false\\n\\tfsmonitor = " + mark + "\\n")
    fh.write("[filter \\"evil\\"]\\n\\tclean = " + mark + "; cat\\n")
pathlib.Path(".gitattributes").write_text("* filter=evil\\n")
shutil.rmtree(".git")  # the tree's own repository, replaced by a link to the evil one
pathlib.Path(".git").write_text(f"gitdir: {{evil}}\\n")
"""


def test_a_git_config_the_agent_points_its_worktree_at_runs_nothing_as_overnight(
    r: redis.Redis,
    namespace: str,
    env: dict[str, str],
    top: Path,
    step_user: StepUser,
    sandbox: str,
) -> None:
    marks = top / "marks"
    marks.mkdir(mode=0o777)
    os.chmod(marks, 0o777)
    rec = run(r, namespace, top, step_user, FIXED_CALC, agent_extra=REPOINT.format(marks=marks))
    assert rec.state == "finished_verified", (rec.detail, rule_tail(rec))
    assert list(marks.iterdir()) == []
    # The twin: a git that trusts the worktree's .git file runs the agent's program.
    tree = next((top / "state" / "worktrees" / namespace).iterdir())
    assert (tree / ".git").read_text().startswith("gitdir: ") and (tree / "evil-git").is_dir()
    subprocess.run(
        ["git", "-c", "safe.directory=*", "status", "--porcelain"],
        cwd=tree,
        capture_output=True,
        check=False,
        env={**os.environ, "GIT_CONFIG_GLOBAL": os.devnull},
    )
    assert [p.name for p in marks.iterdir()] == ["git-config-ran-as-0"]
