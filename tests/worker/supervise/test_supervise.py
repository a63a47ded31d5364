"""`overnight supervise` end to end: real redis-server, real subprocesses, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.lease.store import CONTRACT_FIELDS, Leases
from tests.helpers import (
    OVERNIGHT,
    assert_all_gone,
    final_doc,
    pid_alive,
    read_pids,
    start,
    supervise,
    wait_for,
)

PY = sys.executable


# --- the table of contract section 2 ----------------------------------------------------


# Off: these tests watch the step's tree from the host by the pids it writes to tmp_path,
# outside the tree a sandbox binds and renumbered by its pid namespace. Under bwrap a
# missing command exits 1 (not 127) and a signal death reads as exit 128+N: left to the
# supervisor's owners.
@pytest.fixture(autouse=True)
def _steps_on_the_host(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    env["OVERNIGHT_SANDBOX"] = "off"
    monkeypatch.setenv("OVERNIGHT_SANDBOX", "off")


def test_happy_path(env: dict[str, str], r: redis.Redis, namespace: str) -> None:
    code, doc, out = supervise(["--", "sh", "-c", "echo hello"], env)
    assert code == 0
    assert "hello" in out
    assert list(doc)[: len(CONTRACT_FIELDS)] == list(CONTRACT_FIELDS)
    assert (doc["status"], doc["note"], doc["exit_code"]) == ("done", "worker-complete", 0)
    assert doc["holder_pid"] > 0 and doc["pgid"] == doc["holder_pid"]
    assert doc["ended_unix"] >= doc["started_unix"]
    stored = Leases(r, Keys(namespace)).get(doc["lease_id"])
    assert stored is not None and stored.status == "done"


@pytest.mark.parametrize("sandbox", ["bwrap", "off"])
def test_child_env_and_stdin(
    env: dict[str, str], namespace: str, tmp_path: Path, sandbox: str
) -> None:
    script = (
        "import json, os, sys; "
        "print(json.dumps(dict(os.environ))); "
        "print(os.readlink('/proc/self/fd/0')); print(repr(sys.stdin.read()))"
    )
    extra = {**env, "LANG": "C.UTF-8", "SOMETHING_ELSE": "x", "MINE": "from-here"}
    extra["OVERNIGHT_SANDBOX"] = sandbox
    code, doc, out = supervise(["--env", "MINE", "--env", "SET=1", "--", PY, "-c", script], extra)
    assert code == 0
    seen = json.loads(out.splitlines()[0])
    assert seen["OVERNIGHT_LEASE_ID"] == doc["lease_id"]
    assert os.path.isabs(seen["OVERNIGHT_BEAT_SOCKET"])
    assert (seen["LANG"], seen["MINE"], seen["SET"]) == ("C.UTF-8", "from-here", "1")
    for name in (
        "OVERNIGHT_LEASE_TOKEN",
        "OVERNIGHT_REDIS_URL",
        "OVERNIGHT_NAMESPACE",
        "SOMETHING_ELSE",
    ):
        assert name not in seen
    if sandbox == "off":  # a scratch HOME on the host, removed at the end
        assert seen["TMPDIR"] == os.path.join(seen["HOME"], "tmp")
        assert seen["HOME"] != os.environ.get("HOME") and not os.path.exists(seen["HOME"])
    else:  # the sandbox's own tmpfs HOME and /tmp, at the usual paths inside
        assert seen["TMPDIR"] == "/tmp"
        assert seen["HOME"] == "/root" or seen["HOME"].startswith("/home/")
    assert not os.path.exists(seen["OVERNIGHT_BEAT_SOCKET"])  # both removed at the end
    assert out.splitlines()[1] == "/dev/null"
    assert out.splitlines()[2] == "''"


@pytest.mark.parametrize("item", ["OVERNIGHT_REDIS_URL", "X_API_KEY=1", "HOME=/", "REDISCLI_AUTH"])
def test_env_option_refuses_credentials_and_reserved_names(env: dict[str, str], item: str) -> None:
    proc = subprocess.run(
        [OVERNIGHT, "supervise", "--env", item, "--", "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 64 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_child_exit_is_noticed_at_once(env: dict[str, str]) -> None:
    code, doc, _ = supervise(["--gap", "30", "--", "true"], env)
    # Ended by the exit, not by the 30 s gap; how fast is bench.supervise's overhead figure.
    assert (code, doc["status"], doc["exit_code"]) == (0, "done", 0)


def test_hang_without_output_dies_by_gap(env: dict[str, str], tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    t = time.monotonic()
    code, doc, _ = supervise(
        ["--gap", "1", "--grace", "1", "--", "sh", "-c", f"echo $$ > {pids}; exec sleep 120"], env
    )
    took = time.monotonic() - t
    assert code == 3
    assert doc["status"] == "killed" and doc["note"].startswith("heartbeat-gap-")
    assert float(doc["note"].removeprefix("heartbeat-gap-").rstrip("s")) >= 1.0
    assert doc["exit_code"] == 3
    assert took >= 1.0  # never before the gap; how soon after is bench.supervise's figure
    assert_all_gone(read_pids(pids, 1))


def test_output_beats_keep_a_chatty_child_until_the_deadline(
    env: dict[str, str], r: redis.Redis, namespace: str
) -> None:
    chatty = "while true; do echo tick; sleep 0.1; done"
    t = time.monotonic()
    code, doc, out = supervise(["--gap", "1", "--deadline", "2.5", "--", "sh", "-c", chatty], env)
    assert code == 2
    assert time.monotonic() - t >= 2.4
    assert (doc["status"], doc["note"]) == ("expired", "budget-exceeded")
    assert out.count("tick") > 10
    rows = r.xrange(Keys(namespace).receipts)
    kinds = [f["kind"] for _id, f in rows if doc["lease_id"] in f["data"]]
    assert kinds == ["lease_acquired", "subprocess_lease_expired"]


def test_no_output_beats_lets_a_chatty_child_die_by_gap(env: dict[str, str]) -> None:
    chatty = "while true; do echo tick; sleep 0.1; done"
    code, doc, _ = supervise(
        ["--gap", "1", "--deadline", "20", "--no-output-beats", "--", "sh", "-c", chatty], env
    )
    assert code == 3 and doc["note"].startswith("heartbeat-gap-")


def test_beat_while_alive_keeps_sleep_alive(env: dict[str, str]) -> None:
    code, doc, _ = supervise(["--gap", "1", "--beat-while-alive", "--", "sleep", "2.5"], env)
    assert code == 0 and doc["status"] == "done"
    assert doc["heartbeat_unix"] - doc["started_unix"] > 1.5


def test_beat_while_alive_is_still_bounded_by_the_deadline(env: dict[str, str]) -> None:
    code, doc, _ = supervise(
        ["--gap", "1", "--deadline", "2", "--beat-while-alive", "--", "sleep", "60"], env
    )
    assert code == 2 and doc["status"] == "expired"


def test_overnight_beat_keeps_a_silent_child_alive(env: dict[str, str]) -> None:
    loop = f"for i in 1 2 3 4 5 6; do {OVERNIGHT} beat --note step-$i || exit 9; sleep 0.3; done"
    code, doc, out = supervise(["--gap", "1.5", "--no-output-beats", "--", "sh", "-c", loop], env)
    assert code == 0, out
    assert doc["status"] == "done" and doc["heartbeat_unix"] - doc["started_unix"] > 1.5


def test_pulse_keeps_a_silent_child_alive(env: dict[str, str]) -> None:
    script = (
        "import time\nfrom overnight.worker.beat.pulse import pulse\n"
        "with pulse() as p:\n    time.sleep(2.5)\n"
        "assert p.beats >= 3 and p.refused is None, p.beats\n"
    )
    code, doc, out = supervise(["--gap", "1", "--no-output-beats", "--", PY, "-c", script], env)
    assert code == 0, out
    assert doc["status"] == "done"


def test_nonzero_exit_is_propagated(env: dict[str, str]) -> None:
    code, doc, _ = supervise(["--", "sh", "-c", "exit 7"], env)
    assert code == 7
    assert (doc["status"], doc["note"], doc["exit_code"]) == ("killed", "worker-exit-7", 7)


def test_child_killed_by_a_signal(env: dict[str, str]) -> None:
    code, doc, _ = supervise(["--", "sh", "-c", "kill -USR1 $$"], env)
    assert code == 128 + signal.SIGUSR1
    assert (doc["status"], doc["note"]) == ("killed", f"worker-signal-{int(signal.SIGUSR1)}")


def test_missing_command_exits_127(env: dict[str, str]) -> None:
    code, doc, _ = supervise(["--", "/nonexistent/cmd"], env)
    assert code == 127 and doc["note"] == "worker-exit-127"


def test_sigterm_to_the_supervisor_is_forwarded(env: dict[str, str], tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    got = str(tmp_path / "got")
    script = (
        f"import os, signal, sys, time\nopen({str(pids)!r}, 'w').write(str(os.getpid()))\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({got!r}, 'w'), sys.exit(0)))\n"
        "time.sleep(60)\n"
    )
    proc = start(["--gap", "10", "--", PY, "-c", script], env)
    child = read_pids(pids, 1)[0]
    assert pid_alive(child)
    proc.send_signal(signal.SIGTERM)
    out, _err = proc.communicate(timeout=20)
    assert proc.returncode == 143
    doc = final_doc(out)
    assert (doc["status"], doc["note"]) == ("killed", "supervisor-signal-15")
    assert (tmp_path / "got").exists()  # the child got the very signal
    assert_all_gone([child])


def test_sigint_is_forwarded_too(env: dict[str, str], tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    proc = start(["--gap", "10", "--", "sh", "-c", f"echo $$ > {pids}; exec sleep 60"], env)
    child = read_pids(pids, 1)[0]
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 130 and final_doc(out)["note"] == "supervisor-signal-2"
    assert_all_gone([child])


def _catches_sigterm(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    caught = int(status.split("SigCgt:")[1].split()[0], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def test_early_sigterm_is_still_forwarded(
    env: dict[str, str], tmp_path: Path, r: redis.Redis
) -> None:
    """SIGTERM the moment the handler is in place, long before start-up has finished: it is
    kept, and it ends the step before the step is started. Redis holds every write until the
    signal is sent, so start-up (the lease's acquisition) cannot finish before it."""
    pids = tmp_path / "pids"
    r.client_pause(20_000, all=False)
    try:
        proc = start(["--gap", "10", "--", "sh", "-c", f"echo $$ > {pids}; exec sleep 60"], env)
        wait_for(lambda: _catches_sigterm(proc.pid), timeout=10, interval=0.001)
        proc.send_signal(signal.SIGTERM)
    finally:
        r.client_unpause()
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 143, err
    doc = final_doc(out)
    assert (doc["status"], doc["note"]) == ("killed", "supervisor-signal-15")
    # The scenario happened: the signal came before the child existed, and none was started.
    assert (doc["holder_pid"], doc["child_start_ticks"]) == (0, None), doc
    assert not pids.exists()


def test_lease_file_mirrors_the_document(env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "lease.json"
    proc = start(
        ["--gap", "1", "--beat-while-alive", "--lease-file", str(path), "--", "sleep", "1.5"], env
    )

    def running() -> dict[str, Any] | None:
        try:
            doc: dict[str, Any] = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return doc if doc["holder_pid"] > 0 else None

    seen = wait_for(running, timeout=10)
    assert seen["status"] == "running"
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0
    final = json.loads(path.read_text())
    assert final == final_doc(out) and final["status"] == "done"
    assert not list(tmp_path.glob("*.tmp"))


def test_existing_lease_id_is_refused(env: dict[str, str]) -> None:
    code, doc, _ = supervise(["--lease-id", "fixed-1", "--", "true"], env)
    assert code == 0 and doc["lease_id"] == "fixed-1"
    proc = subprocess.run(
        [OVERNIGHT, "supervise", "--lease-id", "fixed-1", "--", "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert "exists" in proc.stderr


# --- Redis going away -------------------------------------------------------------------


@pytest.mark.slow
def test_redis_killed_mid_run_fails_closed(
    env: dict[str, str], redis_factory: Any, tmp_path: Path
) -> None:
    server = redis_factory()
    env = {**env, "OVERNIGHT_REDIS_URL": server.url}
    pids = tmp_path / "pids"
    chatty = (
        f"echo $$ > {pids}; sleep 120 & echo $! >> {pids}; while true; do echo x; sleep 0.1; done"
    )
    proc = start(["--gap", "1", "--grace", "0.5", "--", "sh", "-c", chatty], env)
    tree = read_pids(pids, 2)
    assert all(pid_alive(p) for p in tree)
    time.sleep(0.3)  # a few beats first
    server.stop(kill=True)
    gone = time.monotonic()
    out, err = proc.communicate(timeout=30)
    took = time.monotonic() - gone
    assert proc.returncode == 4, err
    assert took >= 0.9
    doc = final_doc(out)
    assert (doc["status"], doc["note"]) == ("killed", "lease-lost")
    assert_all_gone(tree, timeout=1)


@pytest.mark.slow
def test_redis_blink_shorter_than_the_gap_costs_nothing(
    env: dict[str, str], redis_factory: Any, tmp_path: Path
) -> None:
    server = redis_factory(appendonly=True)
    env = {**env, "OVERNIGHT_REDIS_URL": server.url}
    marker = tmp_path / "started"
    chatty = f"touch {marker}; i=0; while [ $i -lt 30 ]; do echo x; sleep 0.1; i=$((i+1)); done"
    proc = start(["--gap", "2", "--", "sh", "-c", chatty], env)
    wait_for(marker.exists, timeout=10)
    time.sleep(0.5)
    server.stop()
    server.start()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert final_doc(out)["status"] == "done"


# What `overnight supervise` must never load: every step has one such process beside it, and
# pydantic alone is some 9 MB of its peak resident size (bench.supervise: <= 40 MB).
HEAVY = ("pydantic", "pydantic_settings", "rich", "aiohttp", "rq")
REPORT_HEAVY = f"""
import atexit, sys
def report():
    print("loaded:", *[m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)
atexit.register(report)
from overnight.coordinator.cli.main import main
sys.argv = ["overnight", "supervise", "--", "true"]
main()
"""


@pytest.mark.parametrize("sandbox", ["bwrap", "off"])
def test_a_supervisor_loads_no_heavy_module(env: dict[str, str], sandbox: str) -> None:
    proc = subprocess.run(
        [PY, "-c", REPORT_HEAVY],
        env={**env, "OVERNIGHT_SANDBOX": sandbox},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert final_doc(proc.stdout)["status"] == "done"  # the step really ran
    assert proc.stderr.splitlines()[-1] == "loaded:", proc.stderr


def test_redis_unreachable_at_start_exits_69(env: dict[str, str]) -> None:
    from overnight.coordinator.night.embedded_redis import free_port

    env = {**env, "OVERNIGHT_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    proc = subprocess.run(
        [OVERNIGHT, "supervise", "--", "true"], env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 69
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


# --- CLI hygiene --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--gap", "0", "--", "true"],
        ["--gap", "abc", "--", "true"],
        ["--deadline", "-1", "--", "true"],
        ["--grace", "nan", "--", "true"],
        ["--lease-id", "a:b*", "--", "true"],
        ["--bogus", "--", "true"],
    ],
)
def test_usage_errors_exit_64(env: dict[str, str], args: list[str]) -> None:
    proc = subprocess.run(
        [OVERNIGHT, "supervise", *args], env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 64, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_bad_configuration_exits_78(env: dict[str, str]) -> None:
    for var, value in [
        ("OVERNIGHT_HEARTBEAT_GAP", "-3"),
        ("OVERNIGHT_REDIS_URL", "http://x"),
        ("OVERNIGHT_MODEL_URL", "ftp://x"),
    ]:
        proc = subprocess.run(
            [OVERNIGHT, "supervise", "--", "true"],
            env={**env, var: value},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 78, (var, proc.stderr)
        assert var.removeprefix("OVERNIGHT_") in proc.stderr or var in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        # `beat` reads no settings at all: outside a lease it is exit 64 whatever they say.
        beat = subprocess.run(
            [OVERNIGHT, "beat"], env={**env, var: value}, capture_output=True, text=True, timeout=30
        )
        assert beat.returncode == 64, beat.stderr


def test_help_explains(env: dict[str, str]) -> None:
    for cmd in (["supervise"], ["beat"], ["lease"], ["lease", "show"], ["lease", "list"]):
        proc = subprocess.run(
            [OVERNIGHT, *cmd, "--help"], env=env, capture_output=True, text=True, timeout=30
        )
        assert proc.returncode == 0 and "Usage:" in proc.stdout
    text = subprocess.run(
        [OVERNIGHT, "supervise", "--help"], env=env, capture_output=True, text=True, timeout=30
    ).stdout
    for option in (
        "--deadline",
        "--gap",
        "--grace",
        "--lease-id",
        "--lease-file",
        "--quiet",
        "--no-output-beats",
        "--beat-while-alive",
        "--env",
    ):
        assert option in text


def test_quiet_prints_only_the_child_output(env: dict[str, str]) -> None:
    proc = subprocess.run(
        [OVERNIGHT, "supervise", "--quiet", "--", "echo", "only"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0 and proc.stdout == "only\n"


def test_stdout_and_stderr_stay_apart(env: dict[str, str]) -> None:
    proc = subprocess.run(
        [OVERNIGHT, "supervise", "--quiet", "--", "sh", "-c", "echo out; echo err >&2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.stdout == "out\n" and proc.stderr == "err\n"


def test_supervisor_pid_is_not_the_child(env: dict[str, str]) -> None:
    code, doc, _ = supervise(["--", "true"], env)
    assert code == 0 and doc["supervisor_pid"] not in (0, doc["holder_pid"], os.getpid())


def test_a_stuck_reader_of_our_output_cannot_stall_the_kill(
    env: dict[str, str], r: redis.Redis, namespace: str
) -> None:
    """Nobody reads the supervisor's stdout: the child is back-pressured, never the loop."""
    proc = start(["--gap", "1", "--deadline", "60", "--lease-id", "stuck-1", "--", "yes"], env)
    try:
        leases = Leases(r, Keys(namespace))

        def ended() -> bool:
            doc = leases.get("stuck-1")
            return doc is not None and doc.status != "running"

        wait_for(ended, timeout=10)
        doc = leases.get("stuck-1")
        assert doc is not None and doc.note.startswith("heartbeat-gap-")
    finally:
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 3
    assert final_doc(out)["status"] == "killed"
