"""A stop the user asked for, as rules and in one process: a step it ends is
recorded as stopped and its task goes back to queued from its checkpoint, not lost; and
step logs expire with their task's record."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.dispatch.job import stoppable
from overnight.coordinator.report.logs import expired_logs, prune_task_logs
from overnight.coordinator.tasks import stop
from overnight.coordinator.tasks.loop import LoopConfig, TaskLoop
from overnight.coordinator.tasks.record import Checkpoint, InFlight
from overnight.coordinator.tasks.states import QUEUED
from overnight.coordinator.tasks.steps import (
    StepOutcome,
    StepRequest,
    alarm_ends_step,
    plain_runner,
)
from overnight.coordinator.tasks.store import Runner, TaskStore
from overnight.coordinator.tasks.taskfile import Rule, TaskSpec
from overnight.worker.redisio import receipts

T0 = 1_700_000_000.0


def spec(workdir: str = "/tmp", **kw: object) -> TaskSpec:
    data: dict[str, object] = {
        "id": "t",
        "assignment": "make ok.txt",
        "workdir": workdir,
        "agent": [sys.executable, "-c", "print('hi')"],
        "max_calls": 10,
        "verifier": [Rule(name="tests", run=["test", "-f", "ok.txt"])],
        **kw,
    }
    return TaskSpec.model_validate(data)


def outcome(note: str, status: str = "killed", code: int = 143) -> StepOutcome:
    return StepOutcome(exit_code=code, status=status, note=note, lease_id="L", tail="", digest="d")


@pytest.mark.parametrize(
    ("note", "status", "signum", "want"),
    [
        ("supervisor-signal-15", "killed", 15, True),  # the stop ended it
        ("supervisor-signal-2", "killed", 2, True),
        ("supervisor-signal-14", "killed", 15, False),  # RQ's job timeout, not the stop
        ("worker-signal-15", "killed", 15, False),  # the agent itself died of a SIGTERM
        ("worker-complete", "done", 15, False),  # ended on its own as the stop came
        ("worker-exit-1", "killed", 15, False),
        ("heartbeat-gap-2.0s", "killed", 15, False),
        ("budget-exceeded", "expired", 15, False),
    ],
)
def test_ended_by_stop(note: str, status: str, signum: int, want: bool) -> None:
    assert stop.ended_by_stop(outcome(note, status), signum) is want


def test_a_stop_between_steps_keeps_the_checkpoint() -> None:
    cp = Checkpoint(turn=2, step=1, turns=2, lost_leases=1)
    nxt = stop.stop_asked(cp, spec(), signal.SIGTERM)
    assert nxt.state == QUEUED and nxt.checkpoint == cp
    [event] = nxt.events
    assert event.kind == stop.TASK_STOPPED and event.data["signal"] == signal.SIGTERM
    assert (
        nxt.detail == "overnight was stopped (SIGTERM); resumes at turn 2 (tests) "
        "once a worker takes the task up"
    )


@pytest.mark.parametrize(
    ("step", "name", "said"),
    [
        (0, "agent", "turn 3 agent stopped: overnight was stopped (SIGTERM)"),
        (1, "tests", "turn 3 rule tests stopped: overnight was stopped (SIGTERM)"),
    ],
)
def test_a_step_the_stop_ended_runs_again_and_is_not_lost(step: int, name: str, said: str) -> None:
    flight = InFlight(turn=3, step=step, name=name, request_id=f"t:r1:3:{step}", started_unix=T0)
    cp = Checkpoint(turn=3, step=step, turns=3, in_flight=flight)
    nxt = stop.stop_asked(cp, spec(), signal.SIGTERM, outcome("supervisor-signal-15"))
    assert nxt.state == QUEUED
    new = nxt.checkpoint
    assert new.in_flight is None and new.lost_leases == 0  # not an unknown outcome
    assert (new.turn, new.step, new.turns) == (3, step, 3)  # the same step runs again
    assert new.endings[-1] == said
    finished, stopped = nxt.events
    assert finished.kind == "step_finished" and finished.lease_id == "L"
    assert finished.data["stopped"] is True and finished.data["ending"] == said
    assert stopped.kind == stop.TASK_STOPPED
    assert f"during the turn 3 {'rule ' if step else ''}{name} step" in nxt.detail


def test_the_night_end_says_what_it_said() -> None:
    flight = InFlight(turn=1, step=0, name="agent", request_id="t:r1:1:0", started_unix=T0)
    cp = Checkpoint(turn=1, step=0, turns=1, in_flight=flight)
    nxt = stop.stopped(cp, spec(), T0, outcome("budget-exceeded", "expired", 2))
    assert nxt.detail.startswith("night ended at ")
    assert nxt.detail.endswith("during the turn 1 agent step; it runs again next night")
    assert nxt.events[-1].data["stop_at"] == T0


# --- the signal catcher a work horse's steps run under ------------------------------------


def test_a_stop_signal_is_held_for_the_step_then_handed_on() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, _frame: seen.append(signum))
    try:
        with alarm_ends_step((signal.SIGUSR1, signal.SIGUSR2)) as catcher:
            assert catcher is not None
            assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL  # no handler: left alone
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR1)
            deadline = time.monotonic() + 10
            while len(catcher.pending) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert catcher.pending == [signal.SIGUSR1, signal.SIGUSR1] and seen == []
        assert seen == [signal.SIGUSR1]  # handed on once the step is over
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_step_asked_to_stop_before_it_starts_does_not_start(tmp_path: Path) -> None:
    ran: list[StepRequest] = []

    def runner(req: StepRequest) -> StepOutcome:
        ran.append(req)
        return outcome("worker-complete", "done", 0)

    req = StepRequest("t", "agent", ["true"], str(tmp_path), {}, 5.0, 5.0, 1.0)
    assert stoppable(runner, lambda: None)(req).note == "worker-complete"
    out = stoppable(runner, lambda: signal.SIGTERM)(req)
    assert len(ran) == 1 and stop.ended_by_stop(out, signal.SIGTERM)


# --- the loop: a stop-ended step, then the same step again --------------------------------


def test_loop_requeues_a_stopped_step_and_reruns_it_uncharged(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    keys = Keys(namespace)
    store = TaskStore(r, keys)
    [rec] = store.create([spec(str(tmp_path), agent=["touch", "ok.txt"])], queue="q")
    asked: list[int] = []

    def stopped_runner(req: StepRequest) -> StepOutcome:
        asked.append(signal.SIGTERM)  # the horse got SIGTERM while the step ran
        return outcome("supervisor-signal-15")

    config = LoopConfig(
        claim_ttl=5, prompt_dir=tmp_path / "prompts", stop_asked=lambda: asked[0] if asked else None
    )
    seen: set[str] = set()

    def budget(name: str, kind: str, request_id: str) -> None:
        seen.add(request_id)

    state = TaskLoop(store, stopped_runner, budget, config).run(rec.id, rec.attempt, Runner()).label
    assert state == "queued"
    after = store.get(rec.id)
    assert after is not None
    assert (after.state, after.attempt, after.calls_used) == (QUEUED, rec.attempt, 1)
    assert after.checkpoint.in_flight is None and after.checkpoint.lost_leases == 0
    kinds = [rc.kind for rc in receipts.read(r, keys, task_id=rec.id)]
    assert kinds[-3:] == ["step_finished", "task_stopped", "task_state"]
    [step] = [rc for rc in receipts.read(r, keys, task_id=rec.id) if rc.kind == "step_finished"]
    assert step.data["stopped"] is True and step.lease_id == "L"

    config = LoopConfig(claim_ttl=5, prompt_dir=tmp_path / "prompts")
    state = TaskLoop(store, plain_runner, budget, config).run(rec.id, rec.attempt, Runner()).label
    assert state == "finished_verified"
    final = store.get(rec.id)
    assert final is not None
    assert (final.calls_used, final.turns, final.checkpoint.lost_leases) == (2, 1, 0)
    assert len(seen) == 2  # the stopped step's request id was not charged again


# --- step logs expire with their task's record ------------------------------------------------


@pytest.mark.parametrize(
    ("last_write", "live", "want"),
    [
        (T0 - 100, False, True),  # record gone, nothing written for the retention
        (T0 - 99, False, False),  # record gone, but written within it
        (T0 - 100, True, False),  # record lives (paused, queued): logs kept
        (T0 - 10_000, True, False),
    ],
)
def test_expired_logs(last_write: float, live: bool, want: bool) -> None:
    got = expired_logs({"a": last_write}, {"a"} if live else set(), T0, 100)
    assert got == (["a"] if want else [])


def test_prune_task_logs_removes_only_forgotten_old_folders(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    keys = Keys(namespace)
    root = tmp_path / "task-logs" / namespace
    now = time.time()
    for name, age in (("kept", 500), ("gone", 500), ("fresh", 10)):
        folder = root / name
        folder.mkdir(parents=True)
        log = folder / "turn-001-step-00-agent.log"
        log.write_text("output\n")
        for path in (log, folder):
            os.utime(path, (now - age, now - age))
    r.hset(keys.task("kept"), "state", "paused_for_reconciliation")
    assert prune_task_logs(r, keys, root, retention=100, now=now) == ["gone"]
    assert sorted(p.name for p in root.iterdir()) == ["fresh", "kept"]
    assert prune_task_logs(r, keys, tmp_path / "nothing-here", retention=100) == []


# --- `up` stops its workers warm, then forced ----------------------------------------------

TWO_TERMS = (
    "import pathlib, signal, sys, time\n"
    "seen = []\n"
    "def on_term(signum, frame):\n"
    "    seen.append(time.monotonic())\n"
    "    pathlib.Path(sys.argv[1]).write_text(' '.join(map(str, seen)))\n"
    "    if len(seen) == 2: sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, on_term)\n"
    "pathlib.Path(sys.argv[1]).write_text('')\n"
    "while True: time.sleep(0.05)\n"
)


def test_up_forces_the_stop_of_a_worker_still_busy_after_the_grace(tmp_path: Path) -> None:
    from overnight.coordinator.night.stack import Stack
    from overnight.coordinator.night.up import WARM_MARGIN, stop_workers
    from tests.helpers import wait_for

    stack = Stack(env=dict(os.environ), state_dir=tmp_path, grace=0.0)
    seen = tmp_path / "terms"
    busy = stack.spawn("worker-1", [sys.executable, "-c", TWO_TERMS, str(seen)])
    idle = stack.spawn("worker-2", ["sleep", "60"])
    other = stack.spawn("reaper", ["sleep", "60"])
    try:
        wait_for(seen.exists, timeout=20)
        asked = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process here
        stop_workers(stack, grace=0.0)
        assert busy.poll() == 0 and idle.poll() is not None  # both gone
        first, second = map(float, seen.read_text().split())
        # Warm first; forced only once the grace (0) and the margin were over (measured from
        # when the stop was asked: the child's own handling of the first may lag under load).
        assert asked <= first < second and second >= asked + WARM_MARGIN
        assert other.poll() is None  # not a worker: left to Stack.stop
    finally:
        stack.stop()
