"""Each task works on its own branch; the verifier checks a pinned commit.

Real git repositories in tmp folders (identity in the repo's own config), the real loop with
plain subprocess steps, a private redis-server for the record. Every tampering an agent
could try to pass the checks without fixing the bug fails to reach finished_verified.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.report.view import status_dict
from overnight.coordinator.tasks.judge import PROTECTED_RULE
from overnight.coordinator.tasks.loop import LoopConfig, TaskLoop
from overnight.coordinator.tasks.steps import StepOutcome, StepRequest, plain_runner
from overnight.coordinator.tasks.store import Runner, TaskRecord, TaskStore
from overnight.coordinator.tasks.taskfile import TaskFileError, load
from overnight.coordinator.workspace import worktree as workspace
from overnight.worker.redisio import receipts
from tests.helpers import wait_for
from tests.repos import (
    BUGGY,
    CHECK,
    FIX,
    FIXED,
    TAMPERS,
    TEST,
    make_repo,
    rewriter_task,
    sh,
    task_toml,
)


def run(r: redis.Redis, namespace: str, tmp_path: Path, path: Path) -> TaskRecord:
    state = tmp_path / "state"
    spec = load(path, state)
    store = TaskStore(r, Keys(namespace))
    [rec] = store.create([spec], queue="q")
    config = LoopConfig(
        claim_ttl=5, prompt_dir=tmp_path / "prompts", state_dir=state, step_user=None
    )
    TaskLoop(store, plain_runner, lambda *_: None, config).run(rec.id, 1, Runner(worker="t"))
    got = store.get(rec.id)
    assert got is not None
    return got


# --- pure tables ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "globs", "named", "protected"),
    [
        ("tests/test_a.py", ["tests/**"], [], True),
        ("tests/deep/x/test_a.py", ["tests/**"], [], True),
        ("src/tests/test_a.py", ["tests/**"], [], False),
        ("src/tests/test_a.py", ["**/tests/*.py"], [], True),
        ("src/conftest.py", [], [], True),
        ("pytest.ini", [], [], True),
        ("lib/site/evil.pth", [], [], True),
        ("a/sitecustomize.py", [], [], True),
        ("usercustomize.py", [], [], True),
        ("check.py", [], ["check.py"], True),
        ("calc.py", ["tests/**"], ["check.py"], False),
        ("docs", ["docs/"], [], True),
        ("docs/a/b.md", ["docs"], [], True),
        ("docsy/a.md", ["docs"], [], False),
        ("a.py", ["?.py"], [], True),
        ("ab.py", ["?.py"], [], False),
    ],
)
def test_is_protected(path: str, globs: list[str], named: list[str], protected: bool) -> None:
    assert workspace.is_protected(path, globs, named) is protected


@pytest.mark.parametrize(
    ("glob", "bad"),
    [("tests/**", False), ("../x", True), ("/etc/passwd", True), ("a/../../b", True), ("", True)],
)
def test_glob_problem(glob: str, bad: bool) -> None:
    assert (workspace.glob_problem(glob) is not None) is bad


@pytest.mark.parametrize(
    ("argv", "subdir", "named"),
    [
        (["python3", "check.py"], "", ["check.py"]),
        (["python3", "check.py"], "sub", ["sub/check.py"]),
        (["./run.sh", "-x", "tests"], "", ["run.sh"]),
        (["python3", "/r/check.py"], "sub", ["check.py"]),
        (["python3", "../check.py"], "sub", ["check.py"]),
        (["python3", "nothere.py"], "", []),
    ],
)
def test_named_files(argv: list[str], subdir: str, named: list[str]) -> None:
    files = {"check.py", "sub/check.py", "run.sh"}
    assert workspace.named_files([argv], "/r", subdir, files) == named


def test_clean_path_drops_relative_and_task_folders(tmp_path: Path) -> None:
    inside = tmp_path / "tree" / "bin"
    inside.mkdir(parents=True)
    path = os.pathsep.join(["bin", "", ".", str(inside), "/usr/bin", "/bin"])
    assert workspace.clean_path(path, [str(tmp_path / "tree")]) == "/usr/bin:/bin"


def test_commit_message_and_lock_reason() -> None:
    assert workspace.commit_message("t1", 2, "done").startswith("overnight: task t1 turn 2:")
    assert workspace.lock_reason("t1", "h", "l") == "task t1 host h lease l"


# --- bad input --------------------------------------------------------------------------------


def test_bad_workspace_input_is_one_line_each(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_text("a")
    path = task_toml(plain, "pass", workspace="worktree")
    with pytest.raises(TaskFileError) as info:
        load(path, tmp_path / "state")
    assert info.value.problems == [
        f'{path}: workspace: "worktree" needs a git repository; {plain} is not in one'
    ]
    repo = make_repo(tmp_path / "repo")
    for glob, word in (("nothing/**", "matches no file"), ("../up", "escapes")):
        bad = task_toml(repo, "pass", name="bad").read_text().replace('"tests/**"', f'"{glob}"')
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(TaskFileError) as info:
            load(tmp_path / "bad.json", tmp_path / "state")
        [line] = info.value.problems
        assert line.startswith(f"{tmp_path / 'bad.json'}: protect") and word in line
    empty = tmp_path / "empty"
    empty.mkdir()
    sh(empty, "init", "-q")
    with pytest.raises(TaskFileError) as info:
        load(task_toml(empty, "pass", name="empty"), tmp_path / "s")
    assert any("has no commit" in p for p in info.value.problems)


def test_uncommitted_changes_warn_in_one_line(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    (repo / "calc.py").write_text(FIXED)
    said: list[str] = []
    spec = load(task_toml(repo, "pass"), tmp_path / "state", warn=said.append)
    assert spec.base is not None and spec.base.sha == sh(repo, "rev-parse", "HEAD").strip()
    [line] = said
    assert "uncommitted changes" in line and "\n" not in line


# --- the loop ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TAMPERS))
def test_a_tampering_never_reaches_finished_verified(
    r: redis.Redis, namespace: str, tmp_path: Path, name: str
) -> None:
    repo = make_repo(tmp_path / "repo")
    mark = tmp_path / "landed"
    if name == "background-rewriter":
        path = rewriter_task(repo, mark)
    else:
        path = task_toml(repo, TAMPERS[name])
    rec = run(r, namespace, tmp_path, path)
    try:
        assert rec.state != "finished_verified", rec.detail
        verdict = rec.checkpoint.last_verdict
        assert verdict is not None and verdict.failed
        if name != "background-rewriter":
            assert PROTECTED_RULE in verdict.failed
            assert rec.checkpoint.protected_changed
        else:
            # The rewrite landed in the live tree before the other rules ran ("landed"
            # passed); they checked the step's commit, which still has the bug.
            assert mark.exists() and verdict.failed == ["check", "tests"], verdict.failed
            [checked] = [
                rc.data["commit"]
                for rc in receipts.read(r, Keys(namespace), task_id=rec.id)
                if rc.kind == "verdict"
            ]
            assert (
                checked == rec.checkpoint.head and sh(repo, "show", f"{checked}:calc.py") == BUGGY
            )
        assert rec.checkpoint.branch == f"overnight/{rec.id}"
    finally:
        tree = workspace.worktree_path(tmp_path / "state", namespace, rec.id, rec.run)
        pid_file = tree / "build" / "pid"
        if pid_file.exists():
            pid = int(pid_file.read_text())
            os.kill(pid, signal.SIGKILL)
    # The user's own tree is untouched: the agent worked on its branch.
    assert (repo / "calc.py").read_text() == BUGGY and sh(repo, "status", "--porcelain") == ""


def test_a_genuine_fix_is_verified_on_its_branch(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "repo")
    rec = run(r, namespace, tmp_path, task_toml(repo, FIX))
    assert rec.state == "finished_verified", (rec.detail, rec.checkpoint.last_verdict)
    base = rec.spec.base
    assert base is not None and base.sha is not None
    branch = f"overnight/{rec.id}"
    assert rec.checkpoint.head == sh(repo, "rev-parse", branch).strip()
    assert sh(repo, "show", f"{branch}:calc.py") == FIXED
    assert (repo / "calc.py").read_text() == BUGGY  # the user's tree is not the task's
    log = sh(repo, "log", "--format=%s", f"{base.sha}..{branch}").splitlines()
    assert log == [f"overnight: task {rec.id} turn 1: agent step done (worker-complete, exit 0)"]
    # Receipts say what was checked.
    [verdict] = [
        rc for rc in receipts.read(r, Keys(namespace), task_id=rec.id) if rc.kind == "verdict"
    ]
    assert verdict.data["commit"] == rec.checkpoint.head
    assert set(verdict.data["protected"]) == {"check.py", "tests/test_calc.py"}
    # Status, diff and the report's diffstat agree with git.
    status = status_dict(rec, claim_alive=False)
    assert (status["base"], status["branch"], status["head"]) == (
        base.sha,
        branch,
        rec.checkpoint.head,
    )
    want = sh(repo, "diff", "--shortstat", f"{base.sha}..{branch}").strip()
    assert status["diffstat"] == want == rec.checkpoint.diffstat
    assert workspace.diff(base.root, base.sha, branch) == sh(repo, "diff", f"{base.sha}..{branch}")


def test_an_agent_commit_stays_in_its_trees_repository_and_ignored_junk_stays_out(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    """The agent commits in its tree's own repository (based on the task's base); the
    task's branch gets overnight's commit of the tree after the turn, without ignored files."""
    repo = make_repo(tmp_path / "repo")
    agent = (
        FIX + "; import subprocess, os; os.makedirs('build', exist_ok=True);"
        "open('build/junk.o', 'w').write('x');"
        "subprocess.run(['git', 'commit', '-qam', 'agent fix'], check=True)"
    )
    rec = run(r, namespace, tmp_path, task_toml(repo, agent))
    assert rec.state == "finished_verified", rec.detail
    branch = f"overnight/{rec.id}"
    subjects = sh(repo, "log", "--format=%s", f"main..{branch}").splitlines()
    assert len(subjects) == 1 and subjects[0].startswith("overnight: task"), subjects
    assert "build/junk.o" not in sh(repo, "ls-tree", "-r", "--name-only", branch)
    assert sh(repo, "show", f"{branch}:calc.py") == FIXED
    tree = next((tmp_path / "state" / "worktrees" / namespace).iterdir())
    logged = sh(tree, "log", "--format=%s %an").splitlines()
    assert logged[0] == "agent fix overnight step" and len(logged) == 2, logged
    assert rec.checkpoint.head not in sh(tree, "rev-list", "--all")


def test_two_tasks_on_one_repository_work_apart(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "repo")
    agents = {
        "one": FIX
        + "; open('one.txt','w').write('1'); import os; assert not os.path.exists('two.txt')",
        "two": FIX
        + "; open('two.txt','w').write('2'); import os; assert not os.path.exists('one.txt')",
    }
    state = tmp_path / "state"
    store = TaskStore(r, Keys(namespace))
    specs = [load(task_toml(repo, a, name=n, id=n), state) for n, a in agents.items()]
    records = store.create(specs, queue="q")
    results: dict[str, str] = {}
    barrier = threading.Barrier(2)

    def work(rec: TaskRecord) -> None:
        config = LoopConfig(claim_ttl=5, prompt_dir=tmp_path / "p", state_dir=state, step_user=None)
        barrier.wait(10)
        loop = TaskLoop(store, plain_runner, lambda *_: None, config)
        results[rec.id] = loop.run(rec.id, 1, Runner(worker=f"w-{rec.id}")).label

    threads = [threading.Thread(target=work, args=(rec,)) for rec in records]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {"one": "finished_verified", "two": "finished_verified"}
    for mine, other in (("one", "two"), ("two", "one")):
        files = sh(repo, "ls-tree", "-r", "--name-only", f"overnight/{mine}").split()
        assert f"{mine}.txt" in files and f"{other}.txt" not in files
        log = sh(repo, "log", "--format=%s", f"main..overnight/{mine}")
        assert f"overnight: task {mine} turn 1" in log


def test_a_plain_folder_gets_snapshot_protection(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "calc.py").write_text(BUGGY)
    (folder / "check.py").write_text(CHECK)
    (folder / "tests").mkdir()
    (folder / "tests" / "test_calc.py").write_text(TEST)
    rec = run(r, namespace, tmp_path, task_toml(folder, TAMPERS["conftest-passes-failures"]))
    assert rec.spec.base is not None and rec.spec.base.mode == "in-place"
    assert set(rec.spec.base.snapshot) == {"check.py", "tests/test_calc.py"}
    assert rec.state != "finished_verified"
    verdict = rec.checkpoint.last_verdict
    assert verdict is not None and PROTECTED_RULE in verdict.failed
    assert rec.checkpoint.checked is not None and rec.checkpoint.checked.snapshot
    # Then a genuine fix in a plain folder does pass.
    (folder / "tests" / "conftest.py").unlink()
    (folder / "check.py").write_text(CHECK)
    good = run(r, namespace, tmp_path, task_toml(folder, FIX, name="good"))
    assert good.state == "finished_verified", (good.detail, good.checkpoint.last_verdict)


def test_prune_removes_ended_worktrees_only(r: redis.Redis, namespace: str, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    rec = run(r, namespace, tmp_path, task_toml(repo, FIX))
    tree = workspace.worktree_path(tmp_path / "state", namespace, rec.id, rec.run)
    assert tree.is_dir()
    from overnight.coordinator.workspace.taskspace import prune

    store = TaskStore(r, Keys(namespace))
    (tree / "scratch.txt").write_text("uncommitted")
    kept = prune(store, tmp_path / "state")
    assert tree.is_dir() and any("uncommitted" in line for line in kept)
    (tree / "scratch.txt").unlink()
    said = prune(store, tmp_path / "state")
    assert not tree.exists(), said
    assert workspace.branch_exists(str(repo), f"overnight/{rec.id}")
    wait_for(lambda: not tree.exists(), 1)


def test_an_agent_tree_that_outlived_its_lease_is_not_verified(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "repo")
    state = tmp_path / "state"
    spec = load(task_toml(repo, FIX), state)
    store = TaskStore(r, Keys(namespace))
    [rec] = store.create([spec], queue="q")
    ran: list[str] = []

    def runner(req: StepRequest) -> StepOutcome:
        ran.append(req.name)
        out = plain_runner(req)
        return dataclasses.replace(out, survivors=1 if req.name == "agent" else 0)

    config = LoopConfig(claim_ttl=5, prompt_dir=tmp_path / "p", state_dir=state, step_user=None)
    state_now = (
        TaskLoop(store, runner, lambda *_: None, config).run(rec.id, 1, Runner(worker="t")).label
    )
    got = store.get(rec.id)
    assert got is not None and state_now == "paused_for_reconciliation" == got.state
    assert "outlived its lease" in got.detail and ran == ["agent"]


@pytest.mark.parametrize("mode", ["worktree", "in-place"])
def test_a_protected_folder_turned_into_a_link_is_never_written_through(
    r: redis.Redis, namespace: str, tmp_path: Path, mode: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "test_ok.py").write_text("def test_ok():\n    pass\n")
    agent = f"import os, shutil; shutil.rmtree('tests'); os.symlink({str(outside)!r}, 'tests')"
    if mode == "worktree":
        folder = make_repo(tmp_path / "repo")
    else:
        folder = tmp_path / "plain"
        folder.mkdir()
        (folder / "calc.py").write_text(BUGGY)
        (folder / "check.py").write_text(CHECK)
        (folder / "tests").mkdir()
        (folder / "tests" / "test_calc.py").write_text(TEST)
    rec = run(r, namespace, tmp_path, task_toml(folder, agent))
    assert rec.state != "finished_verified"
    verdict = rec.checkpoint.last_verdict
    assert verdict is not None and PROTECTED_RULE in verdict.failed and "tests" in verdict.failed
    assert sorted(p.name for p in outside.iterdir()) == ["test_ok.py"]


def test_an_agent_that_rewinds_its_branch_does_not_erase_the_audit_trail(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "repo")
    agent = (
        "import os, pathlib, subprocess\n"
        "if os.environ['OVERNIGHT_TURN'] == '1':\n"
        "    pathlib.Path('notes.txt').write_text('turn one')\n"
        "else:\n"
        "    steps = (['add', '-A'], ['commit', '-qm', 'm'], ['reset', '-q', '--hard', 'HEAD~'])\n"
        "    for args in steps:\n"
        "        subprocess.run(['git', *args], check=True)\n"
        "    pathlib.Path('calc.py').write_text('def add(a, b):\\n    return a + b\\n')\n"
    )
    rec = run(r, namespace, tmp_path, task_toml(repo, agent))
    assert rec.state == "finished_verified", rec.detail
    subjects = sh(repo, "log", "--format=%s", f"main..overnight/{rec.id}").splitlines()
    assert [s.split(":")[1].strip() for s in subjects] == [
        f"task {rec.id} turn 2",
        f"task {rec.id} turn 1",
    ]
    assert sh(repo, "show", f"overnight/{rec.id}~1:notes.txt") == "turn one"


def test_a_lost_worktree_is_made_again_on_the_task_branch(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    base = sh(repo, "rev-parse", "HEAD").strip()
    path = tmp_path / "state" / "wt"
    wt = workspace.open_worktree(str(repo), base, "overnight/t", path)
    (path / "calc.py").write_text(FIXED)
    head = workspace.commit_step(wt, "turn 1")
    sh(repo, "worktree", "remove", "--force", str(path))  # its host is gone
    again = workspace.open_worktree(str(repo), base, "overnight/t", path)
    assert (path / "calc.py").read_text() == FIXED
    assert workspace.commit_step(again, "turn 2", keep=head) != head
    sh(repo, "branch", "other", "HEAD")
    sh(repo, "commit", "-q", "--allow-empty", "-m", "later")
    later = sh(repo, "rev-parse", "HEAD").strip()
    with pytest.raises(workspace.GitError, match="does not grow from"):
        workspace.open_worktree(str(repo), later, "overnight/t", tmp_path / "state" / "wt2")


def test_prune_removes_a_frozen_tree_a_dead_worker_left(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    from overnight.coordinator.workspace.taskspace import frozen_path, prune

    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "calc.py").write_text(BUGGY)
    (folder / "check.py").write_text(CHECK)
    (folder / "tests").mkdir()
    (folder / "tests" / "test_calc.py").write_text(TEST)
    rec = run(r, namespace, tmp_path, task_toml(folder, FIX))
    assert rec.state == "finished_verified"
    frozen = frozen_path(tmp_path / "state", namespace, rec.id, rec.run)
    assert not frozen.exists()  # the loop drops it when the task's run ends
    (frozen / "sub").mkdir(parents=True)
    lines = prune(TaskStore(r, Keys(namespace)), tmp_path / "state")
    assert lines == [f"{rec.id}: removed {frozen}"] and not frozen.exists()


def test_overnights_commit_runs_no_filter_the_repository_config_names(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "repo")
    marker = tmp_path / "filter-ran"
    # What an agent of overnight's own user could write into the repository's config.
    sh(repo, "config", "filter.evil.clean", f"touch {marker}; cat")
    agent = FIX + "; open('.gitattributes', 'w').write('*.py filter=evil\\n')"
    rec = run(r, namespace, tmp_path, task_toml(repo, agent))
    assert rec.state == "finished_verified", rec.detail
    assert not marker.exists()
    assert sh(repo, "show", f"overnight/{rec.id}:calc.py") == FIXED
