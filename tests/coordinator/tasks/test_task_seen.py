"""What a task's steps printed is kept, unclean lease endings are said in words,
an agent that cannot start ends the task as agent_failed without burning a call, and a
verifier rule that runs past its limit says it timed out."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.report.logs import print_logs, step_files, task_folder
from overnight.coordinator.report.view import status_dict
from overnight.coordinator.tasks.judge import ending
from overnight.coordinator.tasks.loop import CallRefused, LoopConfig, TaskLoop
from overnight.coordinator.tasks.states import TRANSITIONS, State
from overnight.coordinator.tasks.steps import plain_runner, start_problem
from overnight.coordinator.tasks.store import Runner, TaskStore
from overnight.coordinator.tasks.taskfile import Rule, TaskSpec
from overnight.worker.redisio import receipts

PY = sys.executable


class Budget:
    def __init__(self, n: int) -> None:
        self.remaining, self.seen = n, set[str]()

    def __call__(self, name: str, kind: str, request_id: str) -> None:
        if request_id in self.seen:
            return
        if self.remaining <= 0:
            raise CallRefused("envelope", "empty")
        self.remaining -= 1
        self.seen.add(request_id)


def make_spec(tmp_path: Path, **kw: object) -> TaskSpec:
    data: dict[str, object] = {
        "assignment": "make ok.txt",
        "workdir": str(tmp_path),
        "agent": [PY, "-c", "print('hi')"],
        "max_calls": 6,
        "verifier": [Rule(name="has-ok", run=["test", "-f", "ok.txt"])],
        **kw,
    }
    return TaskSpec.model_validate(data)


def run(
    r: redis.Redis, namespace: str, tmp_path: Path, task: TaskSpec, budget: Budget
) -> TaskStore:
    store = TaskStore(r, Keys(namespace))
    [rec] = store.create([task], queue="q")
    config = LoopConfig(claim_ttl=5, prompt_dir=tmp_path / "prompts", log_dir=tmp_path / "logs")
    TaskLoop(store, plain_runner, budget, config).run(rec.id, rec.attempt, Runner(worker="t"))
    return store


ENDINGS = [
    # (turn, name, rule, status, note, limit) -> words
    ((1, "agent", False, "done", "worker-complete", 30.0), ""),
    ((1, "tests", True, "killed", "worker-exit-1", 30.0), ""),
    ((1, "tests", True, "killed", "worker-exit-127", 30.0), ""),
    ((1, "agent", False, "killed", "worker-exit-1", 30.0), ""),
    (
        (1, "agent", False, "killed", "worker-exit-127", 30.0),
        "turn 1 agent could not start (exit 127)",
    ),
    (
        (1, "agent", False, "killed", "heartbeat-gap-2.0s", 30.0),
        "turn 1 agent killed: heartbeat gap 2.0 s",
    ),
    (
        (2, "tests", True, "expired", "budget-exceeded", 20.0),
        "turn 2 rule tests timed out after 20 s",
    ),
    ((1, "agent", False, "expired", "budget-exceeded", 0.5), "turn 1 agent timed out after 0.5 s"),
    ((1, "agent", False, "killed", "worker-signal-9", 5.0), "turn 1 agent killed by SIGKILL"),
    (
        (1, "agent", False, "killed", "supervisor-signal-15", 5.0),
        "turn 1 agent stopped: its supervisor got SIGTERM",
    ),
    (
        (1, "agent", False, "killed", "lease-lost", 5.0),
        "turn 1 agent killed: lease lost (Redis unreachable longer than the gap)",
    ),
    (
        (3, "agent", False, "expired", "reaped: host-lost", 5.0),
        "turn 3 agent expired: reaped: host-lost",
    ),
]


@pytest.mark.parametrize(("args", "words"), ENDINGS)
def test_ending_in_words(args: tuple[int, str, bool, str, str, float], words: str) -> None:
    assert ending(*args) == words


START = [
    (["my-agnet"], "was not found on PATH"),
    (["./missing.sh"], "does not exist"),
    (["./data.txt"], "is not executable"),
    ([PY, "-c", "pass"], None),
    (["sh", "-c", "true"], None),
    ([], "is empty"),
]


@pytest.mark.parametrize(("argv", "problem"), START)
def test_start_problem(tmp_path: Path, argv: list[str], problem: str | None) -> None:
    (tmp_path / "data.txt").write_text("x")
    got = start_problem(argv, str(tmp_path), "/usr/bin:/bin")
    assert got == problem if problem is None else problem in (got or "")


def test_agent_failed_is_legal_from_running_only() -> None:
    assert TRANSITIONS["save"][State.AGENT_FAILED] == frozenset({State.RUNNING})


def test_typod_agent_ends_at_once_and_burns_nothing(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    budget = Budget(10)
    store = run(r, namespace, tmp_path, make_spec(tmp_path, agent=["my-agnet", "{prompt}"]), budget)
    [rec] = store.all()
    assert rec.state == "agent_failed"
    assert "'my-agnet'" in rec.detail and "not found" in rec.detail
    assert (rec.calls_used, budget.remaining) == (0, 10)
    kinds = [rc.kind for rc in receipts.read(r, Keys(namespace), task_id=rec.id)]
    assert "agent_failed" in kinds


def test_agent_exit_127_after_start_gives_its_call_back(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    agent = ["sh", "-c", "echo 'sh: my-agnet: not found'; exit 127"]
    store = run(r, namespace, tmp_path, make_spec(tmp_path, agent=agent), Budget(10))
    [rec] = store.all()
    assert rec.state == "agent_failed"
    assert "exit 127" in rec.detail and "'sh'" in rec.detail
    assert rec.calls_used == 0
    assert rec.checkpoint.endings == ["turn 1 agent could not start (exit 127)"]


def test_rule_timeout_said_in_detail_receipt_and_prompt(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    seen = tmp_path / "prompts-seen.txt"
    agent = [PY, "-c", f"import os; open({str(seen)!r}, 'a').write(os.environ['OVERNIGHT_PROMPT'])"]
    rules = [Rule(name="tests", run=[PY, "-c", "import time; time.sleep(60)"])]
    task = make_spec(tmp_path, agent=agent, verifier=rules, lease_seconds=0.5, max_calls=4)
    store = run(r, namespace, tmp_path, task, Budget(10))
    [rec] = store.all()
    assert rec.state == "halted_at_call_ceiling"
    assert "turn 1 rule tests timed out after 0.5 s" in rec.checkpoint.endings
    data = [rc.data for rc in receipts.read(r, Keys(namespace), task_id=rec.id)]
    assert {"ending": "turn 1 rule tests timed out after 0.5 s"}.items() <= next(
        d for d in data if d.get("step") == "tests"
    ).items()
    assert "rule tests timed out after 0.5 s" in seen.read_text()


def test_every_step_output_is_kept(r: redis.Redis, namespace: str, tmp_path: Path) -> None:
    agent = [PY, "-c", "print('shall I continue?'); print('\\x1b[31mred\\x1b[0m')"]
    rules = [Rule(name="has-ok", run=["sh", "-c", "echo checking; test -f ok.txt"])]
    task = make_spec(tmp_path, agent=agent, verifier=rules, max_calls=4)
    store = run(r, namespace, tmp_path, task, Budget(10))
    [rec] = store.all()
    assert rec.state == "halted_at_call_ceiling"
    steps = rec.checkpoint.steps
    assert [(s.turn, s.name) for s in steps] == [
        (1, "agent"),
        (1, "has-ok"),
        (2, "agent"),
        (2, "has-ok"),
    ]
    assert "shall I continue?" in steps[0].tail
    folder = task_folder(rec, tmp_path / "unused")
    assert folder == tmp_path / "logs" / rec.id
    assert [(t, n) for t, _s, n, _p in step_files(folder)] == [
        (1, "agent"),
        (1, "has-ok"),
        (2, "agent"),
        (2, "has-ok"),
    ]
    out = io.StringIO()
    assert print_logs(folder, out, turn=2) == 2
    text = out.getvalue()
    assert text.startswith("==> turn 2 agent (")
    assert "shall I continue?\n" in text and "\\x1b[31mred" in text and "\x1b" not in text
    assert "checking" in text


def test_status_shows_the_endings_and_the_last_tails(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    agent = [PY, "-c", "print('shall I continue?')"]
    store = run(r, namespace, tmp_path, make_spec(tmp_path, agent=agent, max_calls=2), Budget(9))
    [rec] = store.all()
    status = status_dict(rec, claim_alive=False)
    assert status["endings"] == []
    assert [(s["turn"], s["name"]) for s in status["steps"]] == [(1, "agent"), (1, "has-ok")]
    assert status["steps"][0]["tail"] == "shall I continue?"
    assert status["steps"][0]["log"].endswith("turn-001-step-00-agent.log")


def test_follow_prints_what_comes_until_settled(tmp_path: Path) -> None:
    log = tmp_path / "turn-001-step-00-agent.log"
    log.write_text("first\n")
    polls: list[int] = []

    def settled() -> bool:
        polls.append(1)
        if len(polls) == 1:  # the step goes on: more output, then a rule's log
            with open(log, "a") as fh:
                fh.write("second\n")
            (tmp_path / "turn-001-step-01-tests.log").write_text("ok\n")
            return False
        return True

    out = io.StringIO()
    assert print_logs(tmp_path, out, follow=True, settled=settled) == 2
    assert out.getvalue().splitlines()[1:3] == ["first", "second"]
    assert out.getvalue().splitlines()[3].startswith("==> turn 1 tests (")
    assert out.getvalue().endswith("ok\n")
