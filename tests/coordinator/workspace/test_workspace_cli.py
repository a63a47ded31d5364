"""End to end: `overnight submit`, two real workers (steps under leases), and what
the morning gets: status fields, `overnight diff`, the report's diffstat, worktree pruning."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.redisio import receipts
from overnight.worker.sandbox.stepuser import StepUser
from tests.helpers import OVERNIGHT, wait_for
from tests.repos import (
    BUGGY,
    FIX,
    FIXED,
    REWRITER,
    TAMPERS,
    make_repo,
    rewriter_task,
    sh,
    task_toml,
)


@pytest.fixture
def wenv(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    return {
        **env,
        "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"],
        "OVERNIGHT_TASK_CLAIM_TTL": "2",
        "OVERNIGHT_GRACE": "0.5",
        "OVERNIGHT_STATE_DIR": str(tmp_path / "state"),
    }


def cli(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def status(env: dict[str, str], task_id: str) -> dict[str, Any]:
    proc = cli(env, "status", task_id)
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_workers_two_branches_and_the_morning_view(
    wenv: dict[str, str], tmp_path: Path
) -> None:
    # No worker dies here: a claim that outlives a busy machine's stalls, so neither idle
    # worker takes a starved one's task for a dead worker's (each task runs one agent step).
    wenv = {**wenv, "OVERNIGHT_TASK_CLAIM_TTL": "60"}
    assert cli(wenv, "envelope", "reset", "100").returncode == 0
    repo = make_repo(tmp_path / "repo")
    (repo / "notes.txt").write_text("not committed\n")  # the base is HEAD, not this
    # Each agent also keeps what its worktree's lock says while it runs (in ignored build/):
    # the lock is in the worktree's admin folder in the user's repository (the tree's own
    # repository is the task's), which only a step without a sandbox can read.
    wenv["OVERNIGHT_SANDBOX"] = "off"
    admin = str(repo / ".git" / "worktrees")
    keep_lock = (
        "; import os; os.makedirs('build', exist_ok=True);"
        f"gd = os.path.join({admin!r}, os.path.basename(os.getcwd()));"
        "locked = open(os.path.join(gd, 'locked')).read();"
        "open('build/lock.txt', 'w').write(locked)"
    )
    files = [
        task_toml(repo, FIX + f"; open('{n}.txt', 'w').write('{n}')" + keep_lock, name=n, id=n)
        for n in ("one", "two")
    ]
    proc = cli(wenv, "submit", *map(str, files))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["one", "two"]
    warnings = proc.stderr.splitlines()
    assert len(warnings) == 2 and all("uncommitted changes" in w for w in warnings)
    workers = [
        subprocess.Popen(
            [OVERNIGHT, "worker", "--burst"],
            env=wenv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    try:

        def settled() -> bool:
            return all(
                status(wenv, t)["state"] not in ("queued", "running") for t in ("one", "two")
            )

        wait_for(settled, timeout=300, interval=0.5)
        for w in workers:
            assert w.wait(60) == 0  # burst workers leave once the queue is empty
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait(10)
            if w.stderr is not None:
                w.stderr.close()
    base = sh(repo, "rev-parse", "HEAD").strip()
    for mine, other in (("one", "two"), ("two", "one")):
        st = status(wenv, mine)
        assert st["state"] == "finished_verified", (st["detail"], st.get("endings"))
        branch = f"overnight/{mine}"
        assert (st["base"], st["branch"]) == (base, branch)
        assert st["head"] == sh(repo, "rev-parse", branch).strip()
        files_on_branch = sh(repo, "ls-tree", "-r", "--name-only", branch).split()
        assert f"{mine}.txt" in files_on_branch and f"{other}.txt" not in files_on_branch
        assert "notes.txt" not in files_on_branch
        assert sh(repo, "show", f"{branch}:calc.py") == FIXED
        assert f"overnight: task {mine} turn 1" in sh(repo, "log", "--format=%s", branch)
        want = sh(repo, "diff", f"{base}..{branch}")
        got = cli(wenv, "diff", mine)
        assert got.returncode == 0 and got.stdout == want
        shortstat = sh(repo, "diff", "--shortstat", f"{base}..{branch}").strip()
        assert st["diffstat"] == shortstat
        rcs = [json.loads(line) for line in cli(wenv, "receipts", mine).stdout.splitlines()]
        verdicts = [rc for rc in rcs if rc["kind"] == "verdict"]
        assert verdicts[-1]["data"]["commit"] == st["head"]
        [agent] = [
            rc for rc in rcs if rc["kind"] == "step_finished" and rc["data"]["step"] == "agent"
        ]
        tree = Path(wenv["OVERNIGHT_STATE_DIR"]) / "worktrees" / wenv["OVERNIGHT_NAMESPACE"]
        [lock] = tree.glob(f"{mine}-*/build/lock.txt")
        assert (
            lock.read_text().strip()
            == f"task {mine} host {agent['host']} lease {agent['lease_id']}"
        )
    report = cli(wenv, "report", "--plain")
    assert report.returncode == 0
    for mine in ("one", "two"):
        [line] = [ln for ln in report.stdout.splitlines() if ln.startswith(mine + " ")]
        assert f"overnight/{mine}: {status(wenv, mine)['diffstat']}" in line
    # Nothing of the night touched the person's own tree.
    assert (repo / "calc.py").read_text() != FIXED
    pruned = cli(wenv, "worktrees", "prune")
    assert pruned.returncode == 0, pruned.stderr
    assert len([ln for ln in pruned.stdout.splitlines() if "removed" in ln]) == 2
    assert not any((tmp_path / "state" / "worktrees").rglob("calc.py"))
    assert sh(repo, "branch", "--list", "overnight/*").split() == ["overnight/one", "overnight/two"]


def test_bad_workspace_input_enqueues_nothing(wenv: dict[str, str], tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "x.txt").write_text("x")
    repo = make_repo(tmp_path / "repo")
    good = task_toml(repo, FIX, name="good")
    bad = task_toml(plain, FIX, name="bad", workspace="worktree")
    proc = cli(wenv, "submit", str(good), str(bad))
    assert proc.returncode == 64
    assert proc.stderr.splitlines() == [
        f'{bad}: workspace: "worktree" needs a git repository; {plain} is not in one'
    ]
    assert json.loads(cli(wenv, "status").stdout) == []


def test_diff_of_a_task_without_a_branch_is_one_line(wenv: dict[str, str], tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "x.txt").write_text("x")
    path = task_toml(plain, FIX, name="p", id="plain-task", protect=[])
    assert cli(wenv, "submit", str(path)).returncode == 0
    proc = cli(wenv, "diff", "plain-task")
    assert proc.returncode == 64 and len(proc.stderr.strip().splitlines()) == 1
    assert "did not work on a branch" in proc.stderr


@pytest.mark.slow
def test_the_agent_and_the_rules_run_as_the_step_user(
    wenv: dict[str, str], step_user: StepUser
) -> None:
    # pytest's tmp folders are root's and 0700: the step user needs a path it can walk.
    top = Path(tempfile.mkdtemp(prefix="overnight-ws-", dir="/tmp"))
    try:
        os.chmod(top, 0o755)
        env = {
            **wenv,
            "OVERNIGHT_STEP_USER": step_user.name,
            "OVERNIGHT_STATE_DIR": str(top / "state"),
        }
        env.pop("OVERNIGHT_ALLOW_ROOT_STEPS", None)
        assert cli(env, "envelope", "reset", "20").returncode == 0
        repo = make_repo(top / "repo")
        agent = f"import os; assert os.getuid() == {step_user.uid}, os.getuid(); " + FIX
        rules = [
            {"name": "check", "run": ["python3", "check.py"]},
            {"name": "as-step-user", "run": ["sh", "-c", f'test "$(id -u)" = {step_user.uid}']},
        ]
        path = task_toml(repo, agent, name="as-user", id="as-user", verifier=rules)
        # The system's python3: the step user may not be able to run the test's venv one.
        data = json.loads(path.read_text())
        data["agent"] = ["python3", "-c", agent]
        path.write_text(json.dumps(data))
        proc = cli(env, "submit", str(path))
        assert proc.returncode == 0, proc.stderr
        worker = cli(env, "worker", "--burst", timeout=120)
        assert worker.returncode == 0, worker.stderr[-3000:]
        st = status(env, "as-user")
        assert st["state"] == "finished_verified", (st["detail"], st.get("endings"))
        assert sh(repo, "show", "overnight/as-user:calc.py") == FIXED
        author = sh(repo, "log", "-1", "--format=%an", "overnight/as-user").strip()
        assert author == "overnight"
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.slow
def test_tamperings_under_real_leases_are_flagged_and_never_verified(
    wenv: dict[str, str], tmp_path: Path, r: redis.Redis
) -> None:
    # Off: t2's first rule waits for a mark this test's rewriter writes outside the worktree.
    wenv = {**wenv, "OVERNIGHT_SANDBOX": "off"}
    assert cli(wenv, "envelope", "reset", "100").returncode == 0
    repo = make_repo(tmp_path / "repo")
    names = ("conftest-passes-failures", "path-shim", "background-rewriter")
    mark = tmp_path / "landed"
    files = []
    for i, name in enumerate(names[:2]):
        path = task_toml(repo, TAMPERS[name], name=f"t{i}", id=f"t{i}", max_calls=3)
        files.append(path)
    files.append(rewriter_task(repo, mark, name="t2", id="t2"))
    proc = cli(wenv, "submit", *map(str, files))
    assert proc.returncode == 0, proc.stderr
    # The agent's own rewriter ends with its tree under a real lease; this one, outside any
    # lease, stands for one that got away: it rewrites t2's live tree while its rules run.
    base = sh(repo, "rev-parse", "HEAD").strip()
    rewriter = subprocess.Popen(
        [sys.executable, "-c", REWRITER, str(repo), "overnight/t2", base, str(mark)]
    )
    try:
        worker = cli(wenv, "worker", "--burst", timeout=150)
    finally:
        rewriter.kill()
        rewriter.wait()
    assert worker.returncode == 0, worker.stderr[-3000:]
    report = cli(wenv, "report", "--plain").stdout
    for i, name in enumerate(names):
        st = status(wenv, f"t{i}")
        assert st["state"] == "halted_at_call_ceiling", (name, st["detail"])
        assert st["last_verdict"]["failed"], name
        line = next(ln for ln in report.splitlines() if ln.startswith(f"t{i} "))
        if name != "background-rewriter":
            assert st["protected_changed"] and "protected-paths" in st["last_verdict"]["failed"]
            assert "PROTECTED CHANGED" in line
    # The rewrite landed before t2's other rules ran ("landed" passed); they checked the
    # step's commit, which still has the bug.
    assert mark.exists() and status(wenv, "t2")["last_verdict"]["failed"] == ["check", "tests"]
    [checked] = [
        rc.data["commit"]
        for rc in receipts.read(r, Keys(wenv["OVERNIGHT_NAMESPACE"]), task_id="t2")
        if rc.kind == "verdict"
    ]
    assert checked == sh(repo, "rev-parse", "overnight/t2").strip()
    assert sh(repo, "show", f"{checked}:calc.py") == BUGGY
    assert (repo / "calc.py").read_text() != FIXED
