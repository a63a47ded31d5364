"""Killing whole trees for real: background jobs, setsid, double forks, SIGTERM-deaf children.

Every test records the PIDs of the processes it starts, asserts they are alive before the
kill and reads the process table after it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from overnight.worker.supervise import procs, tree
from tests.helpers import (
    assert_all_gone,
    final_doc,
    kill_quietly,
    pid_alive,
    read_pids,
    start,
    supervise,
    wait_for,
)

PY = sys.executable

# A Python child that starts escapees and reports their PIDs, one per line, in PIDS.
ESCAPES = """
import os, signal, sys, time
pids = sys.argv[1]
def note(pid):
    with open(pids, "a") as fh:
        fh.write(f"{pid}\\n")
note(os.getpid())
mode = sys.argv[2]
if mode == "setsid":
    pid = os.fork()
    if pid == 0:
        os.setsid()
        os.execvp("sleep", ["sleep", "120"])
    note(pid)
elif mode == "double-fork":
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            # No tag left in the environment: only the subreaper can find this one.
            os.execve("/bin/sleep", ["sleep", "120"], {})
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    note(int(os.read(r, 32)))
elif mode == "deaf":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pid = os.fork()
    if pid == 0:
        os.execvp("sleep", ["sleep", "120"])  # SIG_IGN survives exec
    note(pid)
elif mode == "respawn":
    # On SIGTERM, start a new process in a new session and carry on.
    def again(*_):
        pid = os.fork()
        if pid == 0:
            os.setsid()
            os.execvp("sleep", ["sleep", "120"])
        note(pid)
    signal.signal(signal.SIGTERM, again)
elif mode == "stopped":
    pid = os.fork()
    if pid == 0:
        os.execvp("sleep", ["sleep", "120"])
    os.kill(pid, signal.SIGSTOP)
    note(pid)
print("ready", flush=True)
if sys.argv[3] == "exit":
    sys.exit(0)
while True:
    time.sleep(1)
"""


@pytest.fixture
def escapes(tmp_path: Path) -> Path:
    path = tmp_path / "escapes.py"
    path.write_text(ESCAPES)
    return path


def _run_and_kill(
    env: dict[str, str],
    escapes: Path,
    tmp_path: Path,
    mode: str,
    count: int,
    extra: tuple[str, ...] = (),
) -> tuple[int, dict[str, object], list[int]]:
    """Start the escapes script silent under a 1 s gap; return (exit, doc, pids)."""
    pids = tmp_path / "pids"
    proc = start(
        [
            "--gap",
            "1",
            "--grace",
            "0.5",
            "--no-output-beats",
            *extra,
            "--",
            PY,
            str(escapes),
            str(pids),
            mode,
            "stay",
        ],
        env,
    )
    try:
        found = read_pids(pids, count)
        assert all(pid_alive(p) for p in found), found
        out, _ = proc.communicate(timeout=30)
    finally:
        kill_quietly(proc.pid)
    return proc.returncode, final_doc(out), found


# Off: these tests watch the step's tree from the host by the pids it writes to tmp_path,
# outside the tree a sandbox binds and renumbered by its pid namespace. Under bwrap a
# missing command exits 1 (not 127) and a signal death reads as exit 128+N: left to the
# supervisor's owners.
@pytest.fixture(autouse=True)
def _steps_on_the_host(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    env["OVERNIGHT_SANDBOX"] = "off"
    monkeypatch.setenv("OVERNIGHT_SANDBOX", "off")


def test_background_sleep_dies_with_the_lease(env: dict[str, str], tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = f"echo $$ > {pids}; sleep 120 & echo $! >> {pids}; wait"
    code, _doc, _ = supervise(["--gap", "1", "--", "sh", "-c", script], env)
    assert code == 3
    found = read_pids(pids, 2)
    assert_all_gone(found, timeout=1)


def test_setsid_grandchild_dies(env: dict[str, str], escapes: Path, tmp_path: Path) -> None:
    code, _doc, found = _run_and_kill(env, escapes, tmp_path, "setsid", 2)
    assert code == 3
    assert_all_gone(found, timeout=1)


def test_double_forked_untagged_grandchild_dies(
    env: dict[str, str], escapes: Path, tmp_path: Path
) -> None:
    code, _doc, found = _run_and_kill(env, escapes, tmp_path, "double-fork", 2)
    assert code == 3
    assert_all_gone(found, timeout=1)


def test_sigterm_deaf_tree_gets_sigkill_after_the_grace(
    env: dict[str, str], escapes: Path, tmp_path: Path
) -> None:
    t = time.monotonic()
    code, _doc, found = _run_and_kill(env, escapes, tmp_path, "deaf", 2)
    assert code == 3
    assert time.monotonic() - t >= 1.5  # the gap, then the whole grace
    assert_all_gone(found, timeout=1)


def test_processes_started_during_the_grace_die_too(
    env: dict[str, str], escapes: Path, tmp_path: Path
) -> None:
    code, _doc, _ = _run_and_kill(env, escapes, tmp_path, "respawn", 1)
    assert code == 3
    more = (tmp_path / "pids").read_text().split()
    assert len(more) >= 2  # the child answered SIGTERM with a new session
    assert_all_gone([int(p) for p in more], timeout=1)


def test_stopped_descendant_dies(env: dict[str, str], escapes: Path, tmp_path: Path) -> None:
    code, _doc, found = _run_and_kill(env, escapes, tmp_path, "stopped", 2)
    assert code == 3
    assert_all_gone(found, timeout=1)


def test_leftovers_of_a_child_that_exits_are_ended(
    env: dict[str, str], escapes: Path, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    code, doc, _ = supervise(
        ["--gap", "10", "--grace", "0.5", "--", PY, str(escapes), str(pids), "setsid", "exit"], env
    )
    assert code == 0 and doc["status"] == "done"
    assert_all_gone(read_pids(pids, 2), timeout=1)


def test_sigterm_to_supervisor_kills_escapees(
    env: dict[str, str], escapes: Path, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    proc = start(
        ["--gap", "10", "--grace", "0.5", "--", PY, str(escapes), str(pids), "double-fork", "stay"],
        env,
    )
    found = read_pids(pids, 2)
    assert all(pid_alive(p) for p in found)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 143 and final_doc(out)["note"] == "supervisor-signal-15"
    assert_all_gone(found, timeout=1)


# --- the tree module on its own -------------------------------------------------------------


def test_read_proc_and_scan_see_this_process() -> None:
    me = tree.read_proc(os.getpid())
    assert me is not None and me.pid == os.getpid() and me.ppid == os.getppid()
    assert os.getpid() in tree.scan()
    assert tree.read_proc(2**22 + 12345) is None


def test_is_tagged_reads_the_environment() -> None:
    env = {**os.environ, tree.TAG_VAR: "lease-xyz"}
    proc = subprocess.Popen(["sleep", "30"], env=env)
    try:
        wait_for(lambda: tree.is_tagged(proc.pid, "lease-xyz"), timeout=5)
        assert not tree.is_tagged(proc.pid, "lease-xy")
        assert not tree.is_tagged(proc.pid, "other")
    finally:
        proc.kill()
        proc.wait()


def test_a_reused_pid_is_never_signalled() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        row = tree.read_proc(proc.pid)
        assert row is not None
        impostor = tree.Proc(row.pid, row.ppid, row.pgid, row.sid, row.state, row.start - 1)
        sig = procs.Signaller()
        assert not sig.send(impostor, signal.SIGKILL)
        sig.close()
        time.sleep(0.05)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_group_members_count_only_while_the_root_is_the_same_process() -> None:
    table = {
        10: tree.Proc(10, 1, 10, 10, "S", 500),
        11: tree.Proc(11, 10, 10, 10, "S", 501),
        12: tree.Proc(12, 1, 10, 10, "S", 502),  # orphan still in the group
        13: tree.Proc(13, 12, 13, 13, "S", 503),  # its child, in a new session
        20: tree.Proc(20, 1, 20, 20, "S", 400),
    }
    assert set(tree.Tree(root=10, root_start=500).members(table)) == {10, 11, 12, 13}
    # Same PID, different start time: the PID was reused, so group 10 is somebody else's.
    assert tree.Tree(root=10, root_start=499).members(table) == {}


def test_subreaper_can_be_set_and_unset() -> None:
    script = (
        "from overnight.worker.supervise.tree import set_child_subreaper as s\n"
        "from overnight.worker.supervise.tree import is_child_subreaper as i\n"
        "print(i(), s(), s(), i(), s(False), i())"
    )
    code = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=30)
    assert code.stdout.split() == ["False", "True", "True", "True", "True", "False"]
