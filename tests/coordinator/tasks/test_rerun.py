"""`overnight rerun`: an ended task runs again, on its branch with its commits kept (or from its
base), with a new budget; its calls, receipts and the envelope keep agreeing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from overnight.coordinator.tasks.record import Checkpoint, Memory, StepLog, TaskRecord, Verdict
from overnight.coordinator.tasks.runagain import next_checkpoint, next_spec, refusal
from overnight.coordinator.tasks.states import State
from overnight.coordinator.tasks.taskfile import Rule, TaskSpec
from overnight.coordinator.workspace.worktree import Base
from tests.helpers import OVERNIGHT
from tests.repos import PY, make_repo, sh, task_toml

GROW = "open('count.txt', 'a').write('x\\n')"
THREE = "import sys; sys.exit(0 if len(open('count.txt').read().splitlines()) >= 3 else 1)"


def _spec(**kw: Any) -> TaskSpec:
    return TaskSpec(assignment="a", verifier=[Rule(name="r", run=["true"])], **kw)


def test_the_next_checkpoint_goes_on_or_starts_over() -> None:
    cp = Checkpoint(
        turn=2,
        step=1,
        turns=2,
        repeats=2,
        fingerprint="f",
        lost_leases=1,
        memory=Memory(unmet=["r"], rule="r"),
        last_verdict=Verdict(turn=2, failed=["r"]),
        branch="overnight/t",
        head="abc",
        steps=[StepLog(turn=2, name="agent")],
    )
    on = next_checkpoint(cp, from_base=False)
    assert (on.turn, on.step, on.turns, on.repeats, on.lost_leases) == (3, 0, 2, 0, 0)
    assert on.fingerprint is None and on.in_flight is None and on.results == []
    assert (on.head, on.branch, on.memory) == ("abc", "overnight/t", cp.memory)
    assert on.steps == cp.steps  # the record of earlier turns stays
    fresh = next_checkpoint(cp, from_base=True)
    assert (fresh.turn, fresh.head, fresh.branch, fresh.memory, fresh.last_verdict) == (
        3,
        None,
        None,
        None,
        None,
    )
    # A turn refused before it began (turns behind turn) is the next one again.
    assert next_checkpoint(Checkpoint(turn=4, turns=3), from_base=False).turn == 4
    assert cp.turn == 2 and cp.head == "abc"  # never changed in place


@pytest.mark.parametrize(
    ("max_calls", "used", "budget", "want"), [(5, 5, None, 10), (5, 5, 3, 8), (2, 0, 7, 7)]
)
def test_the_next_spec_counts_on(max_calls: int, used: int, budget: int | None, want: int) -> None:
    assert next_spec(_spec(max_calls=max_calls), used, budget).max_calls == want


@pytest.mark.parametrize(
    ("state", "mode", "from_base", "refused"),
    [
        (State.HALTED_AT_CALL_CEILING, "worktree", False, None),
        (State.FINISHED_VERIFIED, "worktree", True, None),
        (State.AGENT_FAILED, "in-place", False, None),
        (State.HALTED_STUCK, "in-place", True, "works in place"),
        (State.QUEUED, "worktree", False, "not ended; wait"),
        (State.RUNNING, "worktree", False, "not ended; wait"),
        (State.PAUSED, "worktree", False, "reconcile it first"),
    ],
)
def test_what_may_run_again(state: State, mode: str, from_base: bool, refused: str | None) -> None:
    base = Base(mode=mode, root="/r", sha="a" * 40 if mode == "worktree" else None)
    rec = TaskRecord(
        id="t",
        run="r1",
        attempt=1,
        state=state,
        spec=_spec(base=base),
        checkpoint=Checkpoint(),
        submitted_unix=0.0,
    )
    got = refusal(rec, from_base)
    assert got == refused if refused is None else refused in (got or "")


@pytest.fixture
def wenv(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    return {
        **env,
        "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"],
        "OVERNIGHT_TASK_CLAIM_TTL": "2",
        "OVERNIGHT_GRACE": "0.5",
        "OVERNIGHT_STATE_DIR": str(tmp_path / "state"),
    }


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def status(env: dict[str, str], task_id: str) -> dict[str, Any]:
    proc = cli(env, "status", task_id)
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def burst(env: dict[str, str]) -> None:
    proc = cli(env, "worker", "--burst")
    assert proc.returncode == 0, proc.stderr[-3000:]


def branches(repo: Path) -> list[str]:
    return sh(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads/overnight/").split()


def envelope_spent(env: dict[str, str]) -> int:
    doc = json.loads(cli(env, "envelope", "status").stdout)
    return int(doc["consumed_model"]) + int(doc["consumed_tool"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_halted_task_reruns_with_a_new_budget_and_keeps_its_commits(
    wenv: dict[str, str], tmp_path: Path
) -> None:
    assert cli(wenv, "envelope", "reset", "40").returncode == 0
    repo = make_repo(tmp_path / "repo")
    base = sh(repo, "rev-parse", "HEAD").strip()
    verifier = [{"name": "three", "run": [PY, "-c", THREE]}]
    path = task_toml(repo, GROW, name="grow", id="grow", max_calls=2, verifier=verifier, protect=[])
    assert cli(wenv, "submit", str(path)).returncode == 0
    live = cli(wenv, "rerun", "grow")
    assert live.returncode == 2 and "queued, not ended" in live.stderr, live.stderr
    burst(wenv)
    first = status(wenv, "grow")
    assert first["state"] == "halted_at_call_ceiling", first["detail"]
    assert first["calls_used"] == 2 and envelope_spent(wenv) == 2
    first_head = first["head"]

    # The file of an ended task is refused, in one line that says what to do.
    again = cli(wenv, "submit", str(path))
    assert again.returncode == 64 and again.stderr.strip().count("\n") == 0
    assert "overnight rerun grow" in again.stderr and "--from-base" in again.stderr

    proc = cli(wenv, "rerun", "grow", "--budget", "10")
    assert proc.returncode == 0, proc.stderr
    assert "queued again (attempt 2, max_calls 12)" in proc.stderr
    assert json.loads(proc.stdout)["state"] == "queued"
    burst(wenv)
    done = status(wenv, "grow")
    assert done["state"] == "finished_verified", done["detail"]
    # Turn 1 ran before; the rerun ran turns 2 and 3 on the same branch.
    assert done["turns"] == 3 and done["calls_used"] == 6
    assert envelope_spent(wenv) == 6  # receipts, calls_used and the envelope agree
    branch = "overnight/grow"
    assert sh(repo, "show", f"{branch}:count.txt") == "x\nx\nx\n"
    subprocess.run(["git", "merge-base", "--is-ancestor", first_head, branch], cwd=repo, check=True)
    log = sh(repo, "log", "--format=%s", f"{base}..{branch}").splitlines()
    assert [line.split(": agent step")[0] for line in reversed(log)] == [
        "overnight: task grow turn 1",
        "overnight: task grow turn 2",
        "overnight: task grow turn 3",
    ], log

    # From the base: the earlier work is set aside on its own branch, a new one starts.
    old_run = branches(repo)
    assert old_run == [branch]
    proc = cli(wenv, "rerun", "grow", "--from-base", "--budget", "2")
    assert proc.returncode == 0, proc.stderr
    kept = next(b for b in branches(repo) if b != branch)
    assert kept.startswith("overnight/grow-") and kept in proc.stderr
    assert sh(repo, "show", f"{kept}:count.txt") == "x\nx\nx\n"
    burst(wenv)
    fresh = status(wenv, "grow")
    assert fresh["state"] == "halted_at_call_ceiling", fresh["detail"]
    assert sh(repo, "show", f"{branch}:count.txt") == "x\n"
    assert sh(repo, "merge-base", branch, kept).strip() == base
    assert fresh["calls_used"] == 8 and envelope_spent(wenv) == 8


def test_up_and_the_coordinator_take_a_known_task_with_its_branch(
    wenv: dict[str, str], tmp_path: Path, r: Any
) -> None:
    from overnight.config.connection import connect
    from overnight.config.settings import load_settings
    from overnight.coordinator.night.control import submit_folders

    repo = make_repo(tmp_path / "repo")
    path = task_toml(repo, GROW, name="known", id="known", protect=[])
    folder = tmp_path / "tasks"
    folder.mkdir()
    path.rename(folder / path.name)
    (folder / path.name).write_text(
        (folder / path.name).read_text().replace('"workdir": "repo"', f'"workdir": "{repo}"')
    )
    settings = load_settings()
    rq_conn = connect(settings, decode_responses=False)
    first = submit_folders(r, rq_conn, settings, [folder])
    assert first.problems == [] and [rec.id for rec in first.records] == ["known"]
    sh(repo, "branch", "overnight/known")  # its first step made the branch
    again = submit_folders(r, rq_conn, settings, [folder])
    assert again.problems == [] and again.known == ["known"] and again.records == []
    # The twin: `overnight submit` of the same file is told to rerun it.
    told = cli(wenv, "submit", str(folder / path.name))
    assert told.returncode == 64 and "overnight rerun known" in told.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_after_a_night_rerun_in_its_folder_and_the_next_up_runs_it(
    tmp_path: Path, env: dict[str, str]
) -> None:
    from tests.helpers import task_file

    quiet = {
        k: v for k, v in env.items() if k not in ("OVERNIGHT_REDIS_URL", "OVERNIGHT_NAMESPACE")
    }
    quiet["OVERNIGHT_STATE_DIR"] = str(tmp_path / "workspace")
    here = tmp_path / "here"
    here.mkdir()
    tasks = tmp_path / "tasks"
    two = "test $(wc -l < n.txt) -ge 2"
    task_file(tasks, "again", ["sh", "-c", "echo x >> n.txt"], [["sh", "-c", two]], max_calls=2)

    def up(*extra: str) -> subprocess.CompletedProcess[str]:
        argv = [OVERNIGHT, "up", "--tasks", str(tasks), "--exit-when-done", "--workers", "1"]
        return subprocess.run(
            [*argv, *extra], cwd=here, env=quiet, capture_output=True, text=True, timeout=120
        )

    first = up("--budget", "10")
    assert first.returncode == 5, first.stdout + first.stderr  # halted: it needs a person
    rerun = subprocess.run(
        [OVERNIGHT, "rerun", "again", "--budget", "4"],
        cwd=here,
        env=quiet,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert "overnight: reading the night started" in rerun.stderr
    assert json.loads(rerun.stdout)["state"] == "queued"
    second = up()
    assert second.returncode == 0, second.stdout + second.stderr
    assert (tasks / "again" / "n.txt").read_text() == "x\nx\n"
