"""The morning report's pure parts as tables: how a lease ending is classed, the report model
built from records and receipts, HTML escaping, the night's end (--until and the stop rule),
the metrics fold and the notification's retries."""

from __future__ import annotations

import json
import os
import re
import stat
import threading
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from overnight.config.stopat import StopAtError, parse_stop_at, stop_unix
from overnight.coordinator.report import html as html_report
from overnight.coordinator.report import notify
from overnight.coordinator.report.build import build
from overnight.coordinator.report.metrics import Tally, lease_reason
from overnight.coordinator.report.model import concurrency, ending_class
from overnight.coordinator.tasks import stop
from overnight.coordinator.tasks.record import Checkpoint, InFlight, Memory, TaskRecord, Verdict
from overnight.coordinator.tasks.states import QUEUED, State, legal
from overnight.coordinator.tasks.steps import StepOutcome
from overnight.coordinator.tasks.taskfile import TaskSpec
from overnight.worker.redisio.receipts import Receipt

T0 = 1_800_000_000.0


@pytest.mark.parametrize(
    ("status", "note", "stopped", "want"),
    [
        ("done", "worker-complete", False, "clean"),
        ("killed", "worker-exit-1", False, "failed"),
        ("killed", "heartbeat-gap-2.0s", False, "gap"),
        ("expired", "budget-exceeded", False, "deadline"),
        ("expired", "budget-exceeded", True, "stop"),
        ("killed", "worker-signal-9", False, "killed"),
        ("killed", "supervisor-signal-15", False, "killed"),
        ("killed", "reaped: host-lost", False, "lost"),
        ("expired", "reaped: deadline passed", False, "deadline"),
        ("killed", "reaped: no beat", False, "gap"),
        ("killed", "call-refused: envelope empty", False, "refused"),
        ("running", "boot", False, "running"),
        ("", "", False, "running"),
    ],
)
def test_ending_class(status: str, note: str, stopped: bool, want: str) -> None:
    assert ending_class(status, note, stopped=stopped) == want


@pytest.mark.parametrize(
    ("note", "reason"),
    [
        ("worker-complete", "complete"),
        ("worker-exit-3", "exit"),
        ("heartbeat-gap-0.5s", "heartbeat-gap"),
        ("budget-exceeded", "deadline"),
        ("reaped: host-lost", "host-lost"),
        ("reaped: no beat for 3s", "reaped"),
        ("supervisor-signal-15", "supervisor-signal"),
        ("over-limit: process limit reached (512 processes)", "over-limit"),
        ("anything the agent wrote \u202e", "other"),
    ],
)
def test_lease_reason_is_a_bounded_label(note: str, reason: str) -> None:
    assert lease_reason(note) == reason


def spec(task_id: str, **kw: Any) -> TaskSpec:
    data = {
        "id": task_id,
        "assignment": "do it",
        "workdir": "/tmp",
        "max_calls": 10,
        "verifier": [{"name": "tests", "run": ["true"]}],
        **kw,
    }
    return TaskSpec.model_validate(data)


def record(task_id: str, state: State, **cp: Any) -> TaskRecord:
    return TaskRecord(
        id=task_id,
        run="r1",
        attempt=1,
        state=state,
        spec=spec(task_id),
        checkpoint=Checkpoint(**cp),
        submitted_unix=T0,
        started_unix=T0 + 1,
        ended_unix=T0 + 20 if state not in (State.RUNNING, State.QUEUED) else None,
        calls_used=3,
    )


def rc(
    kind: str, ts: float, task: str | None = None, lease: str | None = None, **data: Any
) -> Receipt:
    return Receipt(kind=kind, ts=T0 + ts, host="h1", task_id=task, lease_id=lease, data=data)


def night() -> tuple[list[TaskRecord], list[Receipt]]:
    failing = Verdict(turn=2, passed=[], failed=["tests"])
    records = [
        record("ok", State.FINISHED_VERIFIED, last_verdict=Verdict(turn=1, passed=["tests"])),
        record(
            "bad",
            State.HALTED_STUCK,
            last_verdict=failing,
            memory=Memory(unmet=["tests"], rule="tests", evidence="AssertionError: 1 != 2"),
        ),
        record(
            "held",
            State.PAUSED,
            protected_changed=["tests/test_x.py"],
            branch="overnight/held",
            diffstat="1 file changed, 1 insertion(+)",
        ),
        record(
            "busy",
            State.RUNNING,
            in_flight=InFlight(
                turn=1, step=0, name="agent", request_id="busy:r1:1:0", started_unix=T0 + 3
            ),
        ),
    ]
    receipts = [
        rc("envelope_reset", 0, envelope="default", budget=10),
        rc("task_state", 1, "ok", state="running", worker="w1"),
        rc("lease_acquired", 1, "ok", "L1"),
        rc("lease_ended", 2, "ok", "L1", status="done", note="worker-complete"),
        rc("step_finished", 2, "ok", "L1", step="agent", turn=1, status="done"),
        rc("lease_acquired", 2.1, "ok", "L2"),
        rc("lease_ended", 2.2, "ok", "L2", status="done", note="worker-complete"),
        rc("step_finished", 2.2, "ok", "L2", step="tests", turn=1, status="done"),
        rc("verdict", 2.2, "ok", turn=1, passed=["tests"], failed=[]),
        rc("task_state", 1.5, "bad", state="running", worker="w2"),
        rc("lease_acquired", 1.5, "bad", "L3"),
        rc("lease_ended", 4, "bad", "L3", status="killed", note="heartbeat-gap-2.0s"),
        rc(
            "step_finished",
            4,
            "bad",
            "L3",
            step="agent",
            turn=1,
            status="killed",
            note="heartbeat-gap-2.0s",
        ),
        rc("task_state", 5, "held", state="paused_for_reconciliation", detail="worker died"),
        rc("task_state", 3, "busy", state="running", worker="w1"),
        rc("lease_acquired", 3, "busy", "L4"),
        rc(
            "model_call",
            3.5,
            "busy",
            "L4",
            tokens=120,
            input_tokens=100,
            output_tokens=20,
            tool_calls=1,
            model_units=1,
            status=200,
            tool_units_charged=1,
        ),
        rc("model_call", 3.6, "busy", "L4", tokens=0, model_units=0, status=502, refunded=True),
        rc("lease_acquired", 9, None, "L9"),  # a bare `supervise`: not a task's step
    ]
    return records, receipts


def test_build_the_night() -> None:
    records, receipts = night()
    env = {"default": {"remaining": 4, "consumed_model": 4, "consumed_tool": 2, "budget": 10}}
    report = build(records, receipts, env, T0 + 30, namespace="ns", diffs={"held": "+x\n"})
    assert report.counts == {
        "finished_verified": 1,
        "halted_stuck": 1,
        "paused_for_reconciliation": 1,
        "running": 1,
    }
    assert [(b.task_id, b.kind, b.ending) for b in report.bars] == [
        ("ok", "agent", "clean"),
        ("bad", "agent", "gap"),
        ("ok", "verifier", "clean"),
        ("busy", "agent", "running"),
    ]
    busy = next(b for b in report.bars if b.task_id == "busy")
    assert busy.end == T0 + 30  # still running: up to now
    assert {b.worker for b in report.bars} == {"w1", "w2"}
    assert report.end == T0 + 30 and report.start == T0  # a task runs: the night goes on
    assert [(a.task_id, a.what) for a in report.attention] == [
        ("held", "paused"),
        ("held", "tampering"),
    ]
    assert [m.kind for m in report.marks] == ["verdict", "pause"]
    cards = {c.task_id: c for c in report.cards}
    assert cards["bad"].failing_rule == "tests" and "1 != 2" in cards["bad"].evidence
    assert cards["ok"].failing_rule == "" and cards["ok"].ledger is None
    assert cards["held"].branch == "overnight/held" and cards["held"].diff == "+x\n"
    ledger = cards["busy"].ledger
    assert ledger is not None
    assert (ledger.requests, ledger.tokens, ledger.refunded, ledger.failed) == (2, 120, 1, 1)
    (envelope,) = report.envelopes
    assert (envelope.budget, envelope.remaining) == (10, 4)
    # Steps since the reset: ok's two, bad's one; busy's agent is metered per request
    # (its model_call: one model unit and one tool unit; the refunded one: none).
    assert [spent for _, spent in envelope.burn] == [0, 1, 2, 3, 5]


def test_a_finished_night_ends_at_its_last_event() -> None:
    records, receipts = night()
    done = [r for r in records if r.state != State.RUNNING]
    report = build(done, receipts, {}, T0 + 999)
    assert report.end == T0 + 20
    assert all(b.task_id != "busy" for b in report.bars)


def test_concurrency_counts_overlaps() -> None:
    records, receipts = night()
    report = build(records, receipts, {}, T0 + 30)
    assert concurrency(report.bars) == report.concurrency
    assert max(n for _, n in report.concurrency) == 2
    assert report.concurrency[-1][1] == 0


HOSTILE = "rm -rf\u202e\u2066/ <script>alert(1)</script> \x1b[31m\x00 \"'&"


def test_everything_from_a_task_is_escaped() -> None:
    shown = html_report.esc(HOSTILE)
    assert "<script>" not in shown and "\u202e" not in shown and "\x1b" not in shown
    assert "\x00" not in shown and '"' not in shown and "'" not in shown
    assert "&lt;U+202E&gt;" in shown and "&lt;U+001B&gt;" in shown
    records, receipts = night()
    evil = record(
        "evil",
        State.HALTED_STUCK,
        last_verdict=Verdict(turn=1, failed=["tests"]),
        memory=Memory(unmet=["tests"], rule="tests", evidence=HOSTILE),
    )
    evil = evil.model_copy(update={"spec": spec("evil", assignment=HOSTILE.replace("\x00", ""))})
    evil.detail = "<b>" + HOSTILE
    page = html_report.render(build([*records, evil], receipts, {}, T0 + 30))
    assert "<script>" not in page and "\u202e" not in page and "\u2066" not in page
    assert "<b>rm -rf" not in page and "&lt;b&gt;rm -rf" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:|url\(\s*["']?https?:""", page)


def test_the_page_is_written_with_its_own_modes_and_never_through_a_planted_link(
    tmp_path: Path,
) -> None:
    records, receipts = night()
    report = build(records, receipts, {}, T0 + 30)
    page = tmp_path / "night" / "out" / "report.html"
    old = os.umask(0)
    try:
        html_report.write(report, page)
    finally:
        os.umask(old)
    assert stat.S_IMODE(page.stat().st_mode) == 0o644
    for folder in (page.parent, page.parent.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert "Needs you" in page.read_text()
    # A link planted where the page's temporary file goes is an error, not a target.
    target = tmp_path / "target"
    target.write_text("kept")
    (page.parent / f".report.html.{os.getpid()}.tmp").symlink_to(target)
    with pytest.raises(FileExistsError):
        html_report.write(report, page)
    assert target.read_text() == "kept"


def test_page_holds_every_task_and_one_bar_per_step() -> None:
    records, receipts = night()
    page = html_report.render(build(records, receipts, {}, T0 + 30))
    for rec in records:
        assert f'data-task="{rec.id}" data-state="{rec.state.value}"' in page
    assert page.count('<rect class="step"') == 4
    assert page.count('<rect class="wstep"') == 4
    assert "Needs you" in page and "changed protected paths" in page


# --- the night's end ------------------------------------------------------------------------

NOW = datetime(2026, 12, 3, 22, 30, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("07:00", datetime(2026, 12, 4, 7, 0, tzinfo=UTC)),
        ("23:15", datetime(2026, 12, 3, 23, 15, tzinfo=UTC)),
        ("22:30", datetime(2026, 12, 4, 22, 30, tzinfo=UTC)),  # now: tomorrow's
        ("7:05:09", datetime(2026, 12, 4, 7, 5, 9, tzinfo=UTC)),
        ("2026-12-04T06:00+00:00", datetime(2026, 12, 4, 6, 0, tzinfo=UTC)),
        ("2026-12-04 08:00:00+01:00", datetime(2026, 12, 4, 7, 0, tzinfo=UTC)),
    ],
)
def test_parse_stop_at(text: str, want: datetime) -> None:
    assert parse_stop_at(text, NOW) == want


@pytest.mark.parametrize(
    ("text", "in_past"),
    [
        ("2026-12-03T22:00+00:00", True),
        ("25:00", False),
        ("7pm", False),
        ("", False),
        ("12:60", False),
    ],
)
def test_parse_stop_at_refuses(text: str, in_past: bool) -> None:
    with pytest.raises(StopAtError) as err:
        parse_stop_at(text, NOW)
    assert err.value.in_past == in_past


@pytest.mark.parametrize(
    ("text", "since", "want"),
    [
        (None, NOW, None),
        # A clock time: its next occurrence after the process started (NOW is 22:30).
        ("07:00", NOW, datetime(2026, 12, 4, 7, 0, tzinfo=UTC)),
        ("22:31", NOW, datetime(2026, 12, 3, 22, 31, tzinfo=UTC)),
        ("22:29", NOW, datetime(2026, 12, 4, 22, 29, tzinfo=UTC)),
        # A worker started at 18:00 under 07:00 works through the night (the nearest
        # occurrence, this morning's, would call that night over before it began).
        ("07:00", NOW.replace(hour=18, minute=0), datetime(2026, 12, 4, 7, 0, tzinfo=UTC)),
        # Started after midnight: this morning's.
        ("07:00", NOW.replace(day=4, hour=2), datetime(2026, 12, 4, 7, 0, tzinfo=UTC)),
        # A passed ISO time stays passed: the night is over.
        ("2026-12-03T22:00+00:00", NOW, NOW - timedelta(minutes=30)),
    ],
)
def test_stop_unix_reads_from_the_process_start(
    text: str | None, since: datetime, want: datetime | None
) -> None:
    got = stop_unix(text, since)
    assert got == (want.timestamp() if want is not None else None)


@pytest.mark.parametrize(
    ("now", "stop_at", "grace", "limit", "want"),
    [
        (0.0, None, 5.0, 100.0, None),
        (0.0, 50.0, 5.0, 100.0, 55.0),  # the night's end comes first
        (0.0, 200.0, 5.0, 100.0, None),  # the step's own limit comes first
        (60.0, 50.0, 5.0, 100.0, 0.0),  # already past the grace
    ],
)
def test_stop_cut(
    now: float, stop_at: float | None, grace: float, limit: float, want: float | None
) -> None:
    assert stop.stop_cut(now, stop_at, grace, limit) == want


def test_stop_due() -> None:
    assert not stop.stop_due(10.0, None)
    assert not stop.stop_due(9.9, 10.0)
    assert stop.stop_due(10.0, 10.0)


def test_a_stop_is_a_legal_way_back_to_the_queue() -> None:
    assert legal("save", "running", "queued")
    assert not legal("save", "paused_for_reconciliation", "queued")


def test_stopped_between_steps_keeps_the_checkpoint() -> None:
    cp = Checkpoint(turn=2, step=1, turns=2)
    nxt = stop.stopped(cp, spec("t"), T0)
    assert nxt.state == QUEUED and nxt.checkpoint == cp
    assert [e.kind for e in nxt.events] == ["task_stopped"]
    assert "resumes at turn 2 (tests)" in nxt.detail


def test_a_step_the_stop_ended_runs_again() -> None:
    flight = InFlight(turn=3, step=0, name="agent", request_id="t:r1:3:0", started_unix=T0)
    cp = Checkpoint(turn=3, step=0, turns=3, in_flight=flight)
    out = StepOutcome(
        exit_code=2, status="expired", note="budget-exceeded", lease_id="L", tail="", digest="d"
    )
    nxt = stop.stopped(cp, spec("t"), T0, out)
    assert nxt.state == QUEUED
    assert nxt.checkpoint.in_flight is None
    assert (nxt.checkpoint.turn, nxt.checkpoint.step) == (3, 0)  # the same step, next night
    finished, stopped = nxt.events
    assert finished.kind == "step_finished" and finished.lease_id == "L"
    assert finished.data["stopped"] is True and finished.data["step"] == "agent"
    assert stopped.kind == "task_stopped"
    assert ending_class("expired", "budget-exceeded", stopped=True) == "stop"


# --- metrics --------------------------------------------------------------------------------


def test_tally_folds_receipts() -> None:
    _records, receipts = night()
    tally = Tally()
    for receipt in receipts:
        tally.add(receipt)
    assert tally.steps == {("agent", "clean"): 1, ("verifier", "clean"): 1, ("agent", "gap"): 1}
    assert tally.lease_endings == {("done", "complete"): 2, ("killed", "heartbeat-gap"): 1}
    assert tally.verdicts == {"pass": 1}
    assert tally.gateway_requests == {"ok": 1, "refunded": 1}
    assert tally.gateway_tokens["input"] == 100 and tally.gateway_tokens["output"] == 20
    assert tally.durations[("agent", "gap")][-1] == 1
    assert tally.sums[("agent", "gap")] == pytest.approx(2.5)


def test_a_worker_tally_counts_only_its_tasks() -> None:
    _records, receipts = night()
    tally = Tally(worker="w2")
    for receipt in receipts:
        tally.add(receipt)
    assert tally.steps == {("agent", "gap"): 1}
    assert tally.receipts == len(receipts)


# --- notification ---------------------------------------------------------------------------


class Receiver(BaseHTTPRequestHandler):
    bodies: ClassVar[list[dict[str, Any]]] = []
    fail_first: ClassVar[int] = 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if Receiver.fail_first > 0:
            Receiver.fail_first -= 1
            self.send_response(503)
        else:
            Receiver.bodies.append(body)
            self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_notify_retries_then_delivers() -> None:
    server = HTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        Receiver.bodies, Receiver.fail_first = [], 2
        url = f"http://127.0.0.1:{server.server_port}/hook"
        records, receipts = night()
        report = build(records, receipts, {}, T0 + 30, namespace="ns")
        payload = notify.night_summary(report, "until", None)
        assert notify.post(url, payload, attempts=3, backoff=0.01)
        assert Receiver.bodies == [json.loads(json.dumps(payload))]
        assert payload["counts"]["running"] == 1
        assert payload["needs_person"][0] == {
            "task": "held",
            "what": "paused",
            "text": "paused for reconciliation",
        }
        Receiver.fail_first = 5
        assert not notify.post(url, payload, attempts=2, backoff=0.01)
    finally:
        server.shutdown()
        server.server_close()


def test_notify_to_nowhere_fails_quietly() -> None:
    assert not notify.post("http://127.0.0.1:9/none", {"event": "x"}, attempts=2, backoff=0.01)
    assert notify.send(None, {"event": "x"}) is None


def test_night_notifies_a_pause_once_and_ends_after_its_stop(tmp_path: Any) -> None:
    from overnight.config.keys import Keys
    from overnight.config.settings import load_settings
    from overnight.coordinator.night.ending import Night

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        Receiver.bodies, Receiver.fail_first = [], 0
        url = f"http://127.0.0.1:{server.server_port}/hook"
        settings = load_settings(notify_url=url, grace=1.0, heartbeat_gap=1.0, task_claim_ttl=1.0)
        night = Night(T0 + 100, settings, None, Keys("ns"), tmp_path)  # type: ignore[arg-type]
        night.next_report = float("inf")  # no Redis here: no report refresh
        held = record("held", State.PAUSED)
        busy = record("busy", State.RUNNING)
        assert not night.tick([held, busy], now=T0)
        assert not night.tick([held, busy], now=T0 + 1)  # the same pause: told once
        for thread in night.threads:
            thread.join(10)
        assert [b["event"] for b in Receiver.bodies] == ["task_paused"]
        assert Receiver.bodies[0]["task"] == "held"
        assert not night.tick([held, busy], now=T0 + 101)  # a step still runs: wait for it
        assert night.tick([held, record("busy", State.QUEUED)], now=T0 + 102)
        assert night.ended
        assert night.tick([held, busy], now=T0 + 200)  # past the patience: it ends anyway
    finally:
        server.shutdown()
        server.server_close()


def test_an_empty_night_still_renders() -> None:
    report = build([], [], {}, T0)
    assert report.wall_sec == 0 and report.bars == () and report.counts == {}
    page = html_report.render(report)
    assert "0 tasks" in page and "Nothing needs you" in page
