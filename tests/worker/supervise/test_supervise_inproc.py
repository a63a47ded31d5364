"""``run_supervised`` called in-process, as an RQ work horse calls it."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.night.embedded_redis import EmbeddedRedis, free_port
from overnight.worker.lease.store import LeaseDoc, LeaseRefused
from overnight.worker.redisio.receipts import SURVIVORS, read
from overnight.worker.supervise import tree
from overnight.worker.supervise.supervisor import StepSpec, SupervisedResult, run_supervised, url_of
from tests.helpers import assert_all_gone, pid_alive, read_pids

PY = sys.executable


def _zombie_children() -> list[int]:
    me = os.getpid()
    return [p.pid for p in tree.scan().values() if p.ppid == me and p.dead]


def test_on_output_gets_every_line_and_receipts_carry_the_task(
    r: redis.Redis, namespace: str
) -> None:
    lines: list[bytes] = []
    spec = StepSpec(
        argv=[
            PY,
            "-c",
            "import sys; print('one'); print('two', file=sys.stderr); sys.stdout.write('tail')",
        ],
        gap=2,
        deadline=30,
        grace=1,
        task_id="task-7",
        env={"EXTRA": "1"},
    )
    result = run_supervised(r, Keys(namespace), spec, on_output=lines.append)
    assert isinstance(result, SupervisedResult) and isinstance(result.doc, LeaseDoc)
    assert result.exit_code == 0 and result.returncode == 0 and result.ended_here
    assert sorted(lines) == sorted([b"one\n", b"two\n", b"tail"])
    assert result.doc.status == "done" and result.doc.task_id == "task-7"
    rows = r.xrange(Keys(namespace).receipts)
    mine = [json.loads(f["data"]) for _id, f in rows if result.doc.lease_id in f["data"]]
    assert [m.get("task_id") for m in mine] == ["task-7", "task-7"]


def test_the_subreaper_state_is_restored_after_a_step(r: redis.Redis, namespace: str) -> None:
    seen: list[bool] = []
    assert not tree.is_child_subreaper()
    spec = StepSpec(argv=["echo", "x"])
    run_supervised(
        r, Keys(namespace), spec, on_output=lambda _: seen.append(tree.is_child_subreaper())
    )
    assert seen == [True] and not tree.is_child_subreaper()


def test_the_child_env_gets_extra_variables_and_no_credential(
    r: redis.Redis, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OVERNIGHT_MODEL_API_KEY", "sk-never-here")
    lines: list[bytes] = []
    spec = StepSpec(
        argv=["sh", "-c", "echo $EXTRA; env"], env={"EXTRA": "x1", "X_API_KEY": "k"}, task_id="t-1"
    )
    result = run_supervised(r, Keys(namespace), spec, on_output=lines.append)
    assert result.exit_code == 0 and lines[0] == b"x1\n"
    names = {line.split(b"=", 1)[0].decode() for line in lines[1:]}
    assert {"OVERNIGHT_LEASE_ID", "OVERNIGHT_BEAT_SOCKET", "OVERNIGHT_TASK_ID", "HOME"} <= names
    assert not names & {
        "OVERNIGHT_REDIS_URL",
        "OVERNIGHT_NAMESPACE",
        "OVERNIGHT_LEASE_TOKEN",
        "OVERNIGHT_MODEL_API_KEY",
        "X_API_KEY",
    }
    assert b"sk-never-here" not in b"".join(lines)


def test_a_hang_in_process_is_killed_and_reaped(
    r: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    spec = StepSpec(
        argv=["sh", "-c", f"echo $$ > {pids}; sleep 120 & echo $! >> {pids}; wait"],
        gap=1,
        deadline=30,
        grace=0.5,
    )
    t = time.monotonic()
    result = run_supervised(r, Keys(namespace), spec, on_output=lambda line: None)
    assert result.exit_code == 3 and result.doc.note.startswith("heartbeat-gap-")
    assert time.monotonic() - t >= 1.0
    found = read_pids(pids, 2)
    assert_all_gone(found, timeout=1)
    assert not set(found) & set(_zombie_children())


def test_in_a_forked_work_horse(redis_server: EmbeddedRedis, namespace: str) -> None:
    """Fork like RQ does, run one step in the child process, report through a pipe."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the "horse"
        code = 1
        try:
            os.close(read_end)
            client = redis.Redis.from_url(redis_server.url, decode_responses=True)
            lines: list[bytes] = []
            spec = StepSpec(argv=["sh", "-c", "echo in-horse"], gap=1, deadline=10, grace=0.5)
            result = run_supervised(client, Keys(namespace), spec, on_output=lines.append)
            os.write(write_end, json.dumps([result.exit_code, lines[0].decode()]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert json.loads(data) == [0, "in-horse\n"]


def test_install_signals_in_process(r: redis.Redis, namespace: str) -> None:
    before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    spec = StepSpec(argv=["sleep", "30"], gap=10, deadline=30, grace=0.5, install_signals=True)
    result = run_supervised(r, Keys(namespace), spec, on_output=lambda line: None)
    timer.join()
    assert result.exit_code == 143 and result.doc.note == "supervisor-signal-15"
    assert signal.getsignal(signal.SIGTERM) == before


def test_no_signal_handlers_unless_asked(r: redis.Redis, namespace: str) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    seen: dict[int, object] = {}

    def look(line: bytes) -> None:
        seen.update({s: signal.getsignal(s) for s in before})

    run_supervised(r, Keys(namespace), StepSpec(argv=["echo", "x"]), on_output=look)
    assert seen == before


def test_an_existing_lease_id_raises(r: redis.Redis, namespace: str) -> None:
    spec = StepSpec(argv=["true"], lease_id="dup")
    run_supervised(r, Keys(namespace), spec, on_output=lambda line: None)
    with pytest.raises(LeaseRefused):
        run_supervised(r, Keys(namespace), spec, on_output=lambda line: None)


def test_redis_unreachable_before_the_start_raises(namespace: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", decode_responses=True)
    marker = tmp_path / "ran"
    with pytest.raises(redis.ConnectionError):
        run_supervised(client, Keys(namespace), StepSpec(argv=["touch", str(marker)]))
    assert not marker.exists()


def test_a_failing_callback_does_not_leak_the_tree(r: redis.Redis, namespace: str) -> None:
    def boom(line: bytes) -> None:
        raise KeyboardInterrupt

    pids: list[int] = []
    spec = StepSpec(argv=["sh", "-c", "echo $$; sleep 60"], gap=10, grace=0.5)

    def grab(line: bytes) -> None:
        pids.append(int(line))
        boom(line)

    with pytest.raises(KeyboardInterrupt):
        run_supervised(r, Keys(namespace), spec, on_output=grab)
    assert pids and not pid_alive(pids[0])


def test_url_of_rebuilds_the_connection(redis_server: EmbeddedRedis) -> None:
    client = redis.Redis.from_url(redis_server.url)
    assert url_of(client) == redis_server.url
    secret = redis.Redis(host="h", port=7, db=3, username="u", password="p@ss", ssl=True)
    assert url_of(secret) == "rediss://u:p%40ss@h:7/3"


def test_a_survivor_is_logged_loudly_and_recorded_in_a_receipt(
    r: redis.Redis,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # No process resists SIGKILL on demand: the tree's end reports one that did.
    real = tree.end_tree

    def resisted(*args: object, **kwargs: object) -> tree.KillReport:
        report = real(*args, **kwargs)  # type: ignore[arg-type]
        report.survivors = {2**22 + 7}
        return report

    monkeypatch.setattr(tree, "end_tree", resisted)
    result = run_supervised(r, Keys(namespace), StepSpec(argv=["true"]), on_output=print)
    assert result.exit_code == 0 and result.kill is not None
    assert result.kill.survivors == {2**22 + 7}
    assert "SURVIVED" in caplog.text
    rows = [rc for rc in read(r, Keys(namespace)) if rc.kind == SURVIVORS]
    assert [(rc.lease_id, rc.data["pids"]) for rc in rows] == [(result.doc.lease_id, [2**22 + 7])]
    assert rows[0].data["via"] in ("cgroup", "proc")
