"""Errors name their cause: a command or workdir that cannot be found is refused at submit
(as the step will look it up), a verifier rule that cannot start pauses the task for a person
instead of burning turns, and a step that never started is never charged: the task's
calls_used, its receipts and the shared envelope agree."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.report.logs import print_logs
from overnight.coordinator.tasks.loop import CallRefused, Consume, LoopConfig, TaskLoop
from overnight.coordinator.tasks.steps import plain_runner
from overnight.coordinator.tasks.store import Runner, TaskStore
from overnight.coordinator.tasks.taskfile import (
    Rule,
    TaskFileError,
    TaskSpec,
    command_problems,
    load,
)
from overnight.worker.envelope.envelope import CallEnvelope, EnvelopeEmpty
from overnight.worker.redisio import receipts
from overnight.worker.sandbox.stepuser import StepUser
from tests.helpers import wait_for
from tests.repos import sh

PY = sys.executable


def spec(tmp_path: Path, agent: list[str], rule: list[str]) -> TaskSpec:
    return TaskSpec(
        assignment="make ok.txt",
        workdir=str(tmp_path),
        agent=agent,
        max_calls=6,
        verifier=[Rule(name="checks", run=rule)],
    )


def envelope(r: redis.Redis, namespace: str, n: int) -> tuple[CallEnvelope, Consume]:
    env = CallEnvelope(r, "default", namespace)
    env.reset(n)

    def consume(name: str, kind: str, request_id: str) -> None:
        try:
            env.try_consume(kind, request_id=request_id)
        except EnvelopeEmpty as exc:
            raise CallRefused("envelope", str(exc)) from None

    return env, consume


def run(
    r: redis.Redis,
    namespace: str,
    tmp_path: Path,
    task: TaskSpec,
    consume: Consume,
    prompts: Path | None = None,
) -> TaskStore:
    store = TaskStore(r, Keys(namespace))
    [rec] = store.create([task], queue="q")
    loop(store, tmp_path, consume, rec.id, prompts)
    return store


def loop(
    store: TaskStore, tmp_path: Path, consume: Consume, task_id: str, prompts: Path | None = None
) -> None:
    config = LoopConfig(
        claim_ttl=5, prompt_dir=prompts or tmp_path / "prompts", log_dir=tmp_path / "logs"
    )
    rec = store.get(task_id)
    assert rec is not None
    TaskLoop(store, plain_runner, consume, config).run(rec.id, rec.attempt, Runner(worker="t"))


def spent(env: CallEnvelope) -> tuple[int, int]:
    snap = env.snapshot()
    return snap.consumed_model, snap.consumed_tool


def kinds(r: redis.Redis, namespace: str, task_id: str) -> list[str]:
    return [rc.kind for rc in receipts.read(r, Keys(namespace), task_id=task_id)]


# --- a verifier that cannot start -----------------------------------------------------------


def test_a_rule_command_not_on_path_pauses_before_it_is_charged(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    env, consume = envelope(r, namespace, 10)
    agent = ["sh", "-c", "touch ok.txt"]
    store = run(r, namespace, tmp_path, spec(tmp_path, agent, ["no-such-checker"]), consume)
    [rec] = store.all()
    assert rec.state == "paused_for_reconciliation"
    assert "rule checks: command 'no-such-checker' was not found on PATH" in rec.detail
    assert "overnight reconcile --resume" in rec.detail
    assert (rec.turns, rec.calls_used) == (1, 1)  # the agent ran; the rule was never charged
    assert spent(env) == (1, 0)
    assert "rule_cannot_start" in kinds(r, namespace, rec.id)
    # `overnight logs` says it too, under the rule's step.
    out = io.StringIO()
    print_logs(tmp_path / "logs" / rec.id, out)
    assert "==> turn 1 checks (" in out.getvalue()
    assert "overnight: rule checks: command 'no-such-checker' was not found" in out.getvalue()


def test_its_twin_with_the_command_installed_finishes(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    env, consume = envelope(r, namespace, 10)
    agent = ["sh", "-c", "touch ok.txt"]
    store = run(r, namespace, tmp_path, spec(tmp_path, agent, ["test", "-f", "ok.txt"]), consume)
    [rec] = store.all()
    assert (rec.state, rec.calls_used) == ("finished_verified", 2)
    assert spent(env) == (1, 1)


def test_a_rule_that_cannot_start_is_given_back_and_resumes_once_fixed(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    env, consume = envelope(r, namespace, 10)
    agent = ["sh", "-c", "touch ok.txt"]
    task = spec(tmp_path, agent, ["./checker.sh"])
    store = run(r, namespace, tmp_path, task, consume)
    [rec] = store.all()
    assert rec.state == "paused_for_reconciliation", rec.detail
    assert "rule checks: command './checker.sh' was not found (exit 127)" in rec.detail
    assert rec.calls_used == 1 and spent(env) == (1, 0)  # the rule's unit came back
    assert "envelope_refunded" in kinds(r, namespace, rec.id)
    [step] = [s for s in rec.checkpoint.steps if s.name == "checks"]
    assert "cannot start './checker.sh'" in step.tail
    assert rec.checkpoint.step == 1  # the same rule runs again on resume

    # A person installs the checker and resumes: the turn is judged, charged once.
    checker = tmp_path / "checker.sh"
    checker.write_text("#!/bin/sh\ntest -f ok.txt\n")
    checker.chmod(0o755)
    store.resume(rec, rec.checkpoint)
    loop(store, tmp_path, consume, rec.id)
    done = store.get(rec.id)
    assert done is not None and done.state == "finished_verified", done and done.detail
    assert done.calls_used == 2 and spent(env) == (1, 1)
    # The receipts say the same: three steps finished, one of them given back.
    seen = kinds(r, namespace, rec.id)
    assert (seen.count("step_finished"), seen.count("envelope_refunded")) == (3, 1)


# --- an agent that cannot start costs nothing, in the task and in the envelope ---------------


def test_an_agent_that_exits_127_gives_its_envelope_unit_back(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    env, consume = envelope(r, namespace, 10)
    store = run(r, namespace, tmp_path, spec(tmp_path, ["sh", "-c", "exit 127"], ["true"]), consume)
    [rec] = store.all()
    assert (rec.state, rec.calls_used) == ("agent_failed", 0)
    assert spent(env) == (0, 0) and env.snapshot().remaining == 10
    refunds = [
        rc
        for rc in receipts.read(r, Keys(namespace), task_id=rec.id)
        if rc.kind == "envelope_refunded"
    ]
    assert [rc.data["kind"] for rc in refunds] == ["model"]
    # Once per charge: giving the same request back again gives nothing.
    assert env.refund("model", str(refunds[0].data["request_id"])) is False


def test_its_twin_that_exits_3_is_charged(r: redis.Redis, namespace: str, tmp_path: Path) -> None:
    env, consume = envelope(r, namespace, 10)
    store = run(r, namespace, tmp_path, spec(tmp_path, ["sh", "-c", "exit 3"], ["true"]), consume)
    [rec] = store.all()
    assert (rec.state, rec.calls_used) == ("finished_verified", 2)
    assert spent(env) == (1, 1)


def test_a_step_that_cannot_be_prepared_pauses_uncharged(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    env, consume = envelope(r, namespace, 10)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the prompt folders would go\n")
    task = spec(tmp_path, ["sh", "-c", "touch ok.txt"], ["true"])
    store = run(r, namespace, tmp_path, task, consume, prompts=blocked)
    [rec] = store.all()
    assert rec.state == "paused_for_reconciliation"
    assert rec.detail.startswith("cannot prepare the agent step: ")
    assert str(blocked) in rec.detail
    assert (rec.calls_used, spent(env)) == (0, (0, 0))


# --- at submit ------------------------------------------------------------------------------


def task_file(folder: Path, agent: list[str], rule: list[str], workdir: str = "work") -> Path:
    (folder / workdir).mkdir(parents=True, exist_ok=True)
    path = folder / "task.json"
    data = {
        "id": "t1",
        "assignment": "a",
        "workdir": workdir,
        "agent": agent,
        "verifier": [{"name": "tests", "run": rule}],
    }
    path.write_text(json.dumps(data))
    return path


def problems(path: Path, state: Path) -> list[str]:
    try:
        load(path, state)
    except TaskFileError as exc:
        return exc.problems
    return []


def test_submit_names_a_command_it_cannot_find(tmp_path: Path) -> None:
    state = tmp_path / "state"
    folder = tmp_path / "in"
    path = task_file(folder, ["my-agnet", "{prompt}"], ["no-such-checker"])
    got = problems(path, state)
    assert len(got) == 2, got
    assert got[0].startswith(f"{path}: agent: command 'my-agnet' not found on PATH")
    assert got[1] == f"{path}: verifier[0].run: rule tests: command 'no-such-checker' not found"
    path = task_file(folder, ["./agent.sh"], ["true"])
    assert problems(path, state) == [
        f"{path}: agent: command './agent.sh' does not exist in {folder / 'work'}"
    ]
    # The twin: commands that exist load.
    assert problems(task_file(folder, [PY, "-c", "pass"], ["true"]), state) == []


def repo_with(folder: Path, ignore: str) -> Path:
    folder.mkdir(parents=True)
    sh(folder, "init", "-q", "-b", "main")
    sh(folder, "config", "user.name", "T")
    sh(folder, "config", "user.email", "t@example.invalid")
    (folder / ".gitignore").write_text(ignore)
    (folder / "README").write_text("x\n")
    sh(folder, "add", "-A")
    sh(folder, "commit", "-q", "-m", "base")
    return folder


@pytest.mark.parametrize(
    ("ignore", "why"),
    [("work/\n", "work is ignored by git"), ("", "work is not committed (untracked)")],
)
def test_submit_says_a_workdir_the_worktree_will_not_have(
    tmp_path: Path, ignore: str, why: str
) -> None:
    repo = repo_with(tmp_path / "repo", ignore)
    path = task_file(repo, [PY, "-c", "pass"], ["true"])
    [line] = problems(path, tmp_path / "state")
    assert line.startswith(f"{path}: workdir: {why}, so the task's worktree"), line
    assert 'workspace = "in-place"' in line
    # The twin: the same folder committed loads, in worktree mode.
    (repo / ".gitignore").write_text("")
    (repo / "work" / "keep").write_text("")
    sh(repo, "add", "-A")
    sh(repo, "commit", "-q", "-m", "work")
    loaded = load(path, tmp_path / "state")
    assert loaded.base is not None and loaded.base.mode == "worktree"
    assert os.path.isdir(loaded.workdir)


# --- a worker that died before its step started ----------------------------------------------


def test_a_step_whose_worker_died_before_it_started_runs_again_charged_once(
    r: redis.Redis, namespace: str, tmp_path: Path, env: dict[str, str]
) -> None:
    from overnight.config.settings import load_settings
    from overnight.coordinator.dispatch.recovery import recover
    from overnight.coordinator.tasks.judge import begin, request_id
    from overnight.coordinator.tasks.record import Checkpoint

    envelope_, consume = envelope(r, namespace, 10)
    store = TaskStore(r, Keys(namespace))
    task = spec(tmp_path, ["sh", "-c", "touch ok.txt"], ["test", "-f", "ok.txt"])
    [rec] = store.create([task.model_copy(update={"on_unknown": "pause"})], queue="q")
    # A worker claims it and begins the agent step (charged, in flight), then dies before the
    # step's lease is taken: no lease of the task exists.
    rec = store.claim(rec.id, rec.attempt, "tok", 0.3, Runner(worker="gone"))
    request = request_id(rec.id, rec.run, rec.checkpoint)
    store.begin(rec, "tok", begin(Checkpoint(), rec.spec, request, store.now()), rec.spec.max_calls)
    consume("default", "model", request)
    wait_for(lambda: not r.exists(Keys(namespace).task_claim(rec.id)))
    recover(r, r, Keys(namespace), load_settings())
    back = store.get(rec.id)
    assert back is not None and back.state == "queued", back and back.detail
    assert "died before the agent step of turn 1 started; it runs again" in back.detail
    assert back.checkpoint.in_flight is None and back.calls_used == 1

    loop(store, tmp_path, consume, rec.id)
    done = store.get(rec.id)
    assert done is not None and done.state == "finished_verified", done and done.detail
    assert done.calls_used == 2 and spent(envelope_) == (1, 1)  # the agent step charged once


def test_submit_looks_the_agent_up_as_the_step_user(tmp_path: Path, step_user: StepUser) -> None:
    # pytest's own tmp folders are 0700: a folder of the test's own that others can enter.
    top = Path(tempfile.mkdtemp(prefix="overnight-lookup-"))
    top.chmod(0o755)
    try:
        _look_up_as(top, tmp_path, step_user)
    finally:
        shutil.rmtree(top)


def _look_up_as(top: Path, tmp_path: Path, step_user: StepUser) -> None:
    for mode, refused in ((0o700, True), (0o755, False)):
        bin_dir = top / f"bin-{mode:o}"
        bin_dir.mkdir()
        bin_dir.chmod(mode)
        tool = bin_dir / "my-agent"
        tool.write_text("#!/bin/sh\nexit 0\n")
        tool.chmod(0o755)
        task = spec(tmp_path, ["my-agent"], ["true"])
        task = task.model_copy(update={"env": {"PATH": str(bin_dir)}})
        got = command_problems(task, "/usr/bin:/bin", step_user)
        if refused:  # root finds it; the step user cannot enter the folder
            [(key, line)] = got
            assert key == "agent" and f"cannot enter {bin_dir}" in line, line
            assert line.startswith(f"command 'my-agent' not found where {tool} is found but")
            # A later PATH entry the step user can use is taken, as execvp would.
            shadow = bin_dir / "sh"
            shadow.write_text("#!/bin/sh\nexit 0\n")
            shadow.chmod(0o755)
            env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
            later = spec(tmp_path, ["sh", "-c", "true"], ["true"]).model_copy(update={"env": env})
            assert command_problems(later, "", step_user) == []
            assert command_problems(task, "/usr/bin:/bin", None) == []
        else:
            assert got == []


def test_a_workdir_missing_from_the_worktree_is_named_at_run_time(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    env, consume = envelope(r, namespace, 10)
    repo = repo_with(tmp_path / "repo", "build/\n")
    (repo / "build").mkdir()
    path = task_file(repo, ["sh", "-c", "touch ok.txt"], ["true"], workdir=".")
    loaded = load(path, tmp_path / "state")
    assert loaded.base is not None and loaded.base.mode == "worktree"
    # The folder was ignored after the task was loaded (as a base can move under a task).
    moved = loaded.base.model_copy(update={"subdir": "build"})
    task = loaded.model_copy(update={"base": moved, "workdir": str(repo / "build")})
    store = TaskStore(r, Keys(namespace))
    [rec] = store.create([task], queue="q")
    config = LoopConfig(
        claim_ttl=5,
        prompt_dir=tmp_path / "prompts",
        log_dir=tmp_path / "logs",
        state_dir=tmp_path / "state",
    )
    TaskLoop(store, plain_runner, consume, config).run(rec.id, rec.attempt, Runner(worker="t"))
    done = store.get(rec.id)
    assert done is not None and done.state == "agent_failed", done and done.detail
    assert "workdir build is ignored by git, so the task's worktree" in done.detail
    assert done.calls_used == 0 and spent(env) == (0, 0)
