"""The per-lease kernel container (cgroup v2): whatever a step does, it ends as a whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from overnight.worker.sandbox import cgroup
from tests.helpers import capability, pid_alive, wait_for

pytestmark = capability(
    None if cgroup.available() else "this host or user cannot create cgroup v2 groups"
)

HOP = textwrap.dedent(
    """
    import os, sys, time
    for _ in range(16):            # 16 chains at once
        if os.fork() == 0:
            break
    else:
        print("started", flush=True)
        os._exit(0)
    end = time.monotonic() + 60    # bounded: the test kills it long before
    while time.monotonic() < end:
        if os.fork() != 0:         # a new pid every iteration
            os._exit(0)
        if os.getpid() % 3 == 0:
            os.setsid()
    """
)


@pytest.fixture
def group() -> Iterator[cgroup.StepGroup]:
    made = cgroup.create(f"t-{uuid.uuid4().hex[:8]}", "lease-1")
    assert made is not None
    yield made
    made.kill()
    made.remove()


def test_component_keeps_names_inside_one_directory() -> None:
    assert cgroup.component("../../etc") == ".._.._etc"
    assert cgroup.component("..") == "_"
    assert cgroup.component("") == "_"
    assert cgroup.component("lease-1.a_b") == "lease-1.a_b"
    path = cgroup.group_path("ns/x", "../y", mount=Path("/m"))
    assert path == Path("/m/overnight/ns_x/.._y")


def test_a_lease_never_reuses_an_existing_group(group: cgroup.StepGroup) -> None:
    namespace = group.path.parent.name
    assert cgroup.create(namespace, "lease-1") is None


def test_pid_hopping_dies_as_a_whole(group: cgroup.StepGroup, tmp_path: Path) -> None:
    script = tmp_path / "hop.py"
    script.write_text(HOP)
    with subprocess.Popen(
        [sys.executable, str(script)],
        preexec_fn=group.enter,
        stdout=subprocess.PIPE,
        start_new_session=True,
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"started"
        proc.wait(timeout=10)
    # The launcher is gone; its chains keep changing pids, all inside the group.
    wait_for(lambda: len(group.pids()) >= 16, timeout=10)
    seen = set(group.pids())
    report = group.kill()
    assert report.survivors == ()
    assert report.killed >= 16
    assert not group.populated() and group.pids() == []
    assert not any(pid_alive(pid) for pid in seen)


def test_members_cannot_leave_by_setsid_or_env_clearing(
    group: cgroup.StepGroup, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    escape = (
        f"setsid env -i /bin/sh -c 'echo $$ > {pidfile}; exec sleep 60' "
        "</dev/null >/dev/null 2>&1 &"
    )
    subprocess.run(["/bin/sh", "-c", escape], preexec_fn=group.enter, check=True, timeout=10)
    escaped = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=10))
    assert escaped in group.pids()
    group.kill()
    wait_for(lambda: not pid_alive(escaped), timeout=10)


def test_signal_all_reaches_every_member_first(group: cgroup.StepGroup, tmp_path: Path) -> None:
    marker = tmp_path / "term"
    code = textwrap.dedent(
        f"""
        import pathlib, signal, sys, time
        def done(*_):
            pathlib.Path({str(marker)!r}).write_text("x")
            sys.exit(0)
        signal.signal(signal.SIGTERM, done)
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], preexec_fn=group.enter, stdout=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        assert len(group.signal_all(signal.SIGTERM)) == 1
        assert proc.wait(timeout=10) == 0
    assert marker.read_text() == "x"


def test_open_existing_finds_only_groups_that_exist(group: cgroup.StepGroup) -> None:
    namespace = group.path.parent.name
    again = cgroup.open_existing(namespace, "lease-1")
    assert again is not None and again.path == group.path
    assert cgroup.open_existing(namespace, "no-such-lease") is None


def test_remove_leaves_a_populated_group_in_place(group: cgroup.StepGroup) -> None:
    proc = subprocess.Popen(["sleep", "30"], preexec_fn=group.enter)
    try:
        wait_for(lambda: proc.pid in group.pids(), timeout=10)
        other = cgroup.open_existing(group.path.parent.name, "lease-1")
        assert other is not None
        other.remove()  # refused by the kernel while populated: logged, not raised
        assert group.path.is_dir()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.mark.parametrize(
    ("word", "ran"),
    [
        (cgroup.GATE_WORD, True),  # the benign twin: told to go, the step runs
        (b"", False),  # the supervisor died before the move: nothing runs
        (b"no\n", False),
    ],
)
def test_the_gate_runs_the_step_only_once_told(tmp_path: Path, word: bytes, ran: bool) -> None:
    marker = tmp_path / "ran"
    argv = cgroup.gate_argv(["touch", str(marker)], stdin_null=True, pwd=None)
    read, write = os.pipe()
    proc = subprocess.Popen(argv, stdin=read)
    os.close(read)
    os.write(write, word)
    os.close(write)
    assert (proc.wait(timeout=10) == 0) is ran
    assert marker.exists() is ran


def test_a_gated_child_is_in_its_group_before_its_program_runs(
    group: cgroup.StepGroup, tmp_path: Path
) -> None:
    from overnight.worker.supervise.child import Child

    def run(argv: list[str], env: dict[str, str], stdin_data: bytes | None) -> str:
        out: list[bytes] = []
        child = Child(
            argv,
            cwd=str(tmp_path),
            env=env,
            on_output=out.append,
            describe="test",
            stdin_data=stdin_data,
            group=group,
        )
        assert child.proc.wait(timeout=10) == 0
        child.pipes.drain(1.0)
        child.close()
        return b"".join(out).decode()

    # Its first program reads its own cgroup, then the stdin data sent after the gate's word.
    first = run(["/bin/sh", "-c", "grep ^0:: /proc/self/cgroup; cat"], {"PATH": "/bin"}, b"x\n")
    lines = first.splitlines()
    assert lines[0].endswith(f"/{group.path.parent.name}/{group.path.name}"), lines
    assert lines[1:] == ["x"]
    # The environment is the one given: the gate's shell adds nothing (no PWD).
    env = {"PATH": "/usr/bin:/bin", "A": "1 2"}
    assert sorted(run(["env"], env, None).splitlines()) == ["A=1 2", "PATH=/usr/bin:/bin"]
    kept = {**env, "PWD": "/elsewhere"}
    assert "PWD=/elsewhere" in run(["env"], kept, None).splitlines()
