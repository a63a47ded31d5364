"""A step's limits (processes, memory, disk written; open files and CPU as rlimits): a
hostile step under ``overnight supervise`` (as the step user, sandboxed and not) is ended
at the limit with the limit named in the lease's note; its benign twin under the same
limits finishes. The rules are tables."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from overnight.config.validate import size
from overnight.worker.sandbox import bwrap, launch
from overnight.worker.sandbox.limits import Limits, Sample, human, note, over, rlimit_args
from overnight.worker.sandbox.stepuser import StepUser
from tests import reachable
from tests.helpers import final_doc, lacking

MIB = 1024**2
PY3 = "/usr/bin/python3"


@pytest.mark.parametrize(
    ("raw", "parsed"),
    [("0", 0), ("4096", 4096), ("512M", 512 * MIB), ("4G", 4 * 1024**3), ("2GiB", 2 * 1024**3)],
)
def test_size_rule(raw: str, parsed: int) -> None:
    assert size(raw) == parsed


@pytest.mark.parametrize("raw", ["", "-1", "4X", "lots", "1.5G"])
def test_size_rule_refuses(raw: str) -> None:
    with pytest.raises(ValueError):
        size(raw)


@pytest.mark.parametrize(
    ("limits", "seen", "kind"),
    [
        (Limits(pids=10), Sample(pids=9), None),
        (Limits(pids=10), Sample(pids=10), "pids"),
        (Limits(memory=100), Sample(memory=100), "memory"),
        (Limits(cpu=5), Sample(cpu=4.9), None),
        (Limits(cpu=5), Sample(cpu=5.0), "cpu"),
        (Limits(disk=100), Sample(disk=None), None),
        (Limits(disk=100), Sample(disk=150), "disk"),
        (Limits(), Sample(pids=10**6, memory=10**12, cpu=10**6, disk=10**12), None),
        (Limits(pids=10, disk=1), Sample(pids=10, disk=5), "pids"),
    ],
)
def test_over(limits: Limits, seen: Sample, kind: str | None) -> None:
    assert over(limits, seen) == kind


@pytest.mark.parametrize(
    ("limits", "args"),
    [
        (Limits(), []),
        (Limits(pids=50), ["--nproc=350"]),
        (Limits(memory=MIB, open_files=99999), [f"--data={MIB}", "--nofile=4096"]),
        (Limits(open_files=64, cpu=10), ["--nofile=64", "--cpu=15:20"]),
    ],
)
def test_rlimit_args(limits: Limits, args: list[str]) -> None:
    assert rlimit_args(limits, uid_procs=300, nofile_hard=4096) == args


def test_words_and_overrides() -> None:
    assert human(4 * 1024**3) == "4 GiB" and human(1000) == "1000 bytes"
    assert note("pids", Limits(pids=40)) == "over-limit: process limit reached (40 processes)"
    assert "16 MiB written" in note("disk", Limits(disk=16 * MIB))
    merged = Limits(pids=5, memory=7).overridden({"pids": 9, "memory": None, "bogus": 1})
    assert merged == Limits(pids=9, memory=7)


def test_tmpfs_size_in_the_argv() -> None:
    spec = bwrap.SandboxSpec(
        argv=("true",),
        worktree="/srv/wt",
        cwd="/srv/wt",
        uid=1000,
        gid=1000,
        home="/home/u",
        passwd_fd=3,
        group_fd=4,
        top={},
        tmpfs_size=MIB,
    )
    argv = bwrap.launch_argv(spec)
    for path in (*bwrap.TMPFS_PRIVATE, "/home/u"):
        at = argv.index(path)
        assert argv[at - 3 : at] == ["--size", str(MIB), "--tmpfs"]


# --- hostile steps and their twins ---------------------------------------------------------

BOMB = """
import os, sys, time
count = int(sys.argv[1])
for _ in range(count):
    try:
        if os.fork() == 0:
            if count < 100:
                os._exit(0)
            time.sleep(3600)
            os._exit(0)
    except OSError:
        time.sleep(0.05)
if count < 100:
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
    print("forked and waited", flush=True)
    sys.exit(0)
while True:
    try:
        if os.fork() == 0:
            time.sleep(3600)
            os._exit(0)
    except OSError:
        time.sleep(0.05)
"""

HOG = """
import os, sys, time
children, each = int(sys.argv[1]), int(sys.argv[2]) * 1024 * 1024
def hold():
    kept = []
    while sum(len(k) for k in kept) < each:
        kept.append(b"x" * (4 * 1024 * 1024))
        time.sleep(0.02)
    return kept
if children == 0:
    hold()
    print("held and let go", flush=True)
    sys.exit(0)
for _ in range(children):
    if os.fork() == 0:
        kept = hold()
        time.sleep(3600)
        os._exit(0)
time.sleep(3600)
"""

WRITER = """
import os, sys, time
total = int(sys.argv[1]) * 1024 * 1024
places = [os.environ["HOME"], os.environ.get("TMPDIR", "/tmp"), os.getcwd()]
chunk, written, i = b"x" * (1024 * 1024), 0, 0
while total == 0 or written < total:
    place = places[i % len(places)]
    try:
        with open(os.path.join(place, f"fill-{i}"), "wb") as fh:
            fh.write(chunk)
        written += len(chunk)
    except OSError:
        time.sleep(0.02)
    i += 1
print("wrote", written, flush=True)
"""


@pytest.fixture(params=["bwrap", "off"])
def sandbox(request: pytest.FixtureRequest) -> str:
    mode = str(request.param)
    if mode == "bwrap" and launch.find_bwrap() is None:
        lacking("bubblewrap is not installed")
    return mode


@pytest.fixture
def worktree(step_user: StepUser) -> Iterator[Path]:
    """A worktree the step user owns, in a folder everyone may enter."""
    if os.geteuid() != 0:
        pytest.skip("runs steps as the step user: needs root")
    folder = Path(f"/tmp/overnight-limits-{uuid.uuid4().hex[:10]}")
    folder.mkdir(mode=0o755)
    (folder / "wt").mkdir()
    os.chown(folder / "wt", step_user.uid, step_user.gid)
    yield folder / "wt"
    shutil.rmtree(folder, ignore_errors=True)


def run(
    env: dict[str, str], sandbox: str, cwd: Path, limits: dict[str, str], *argv: str
) -> tuple[int, dict[str, object], str]:
    step_env = {**env, "OVERNIGHT_SANDBOX": sandbox, "OVERNIGHT_STEP_USER": "overnight-step"}
    step_env.update({f"OVERNIGHT_STEP_{k.upper()}": v for k, v in limits.items()})
    proc = subprocess.run(
        [
            str(Path(sys.executable).with_name("overnight")),
            "supervise",
            "--deadline",
            "90",
            "--gap",
            "60",
            "--",
            *argv,
        ],
        env=step_env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=150,
    )
    return proc.returncode, final_doc(proc.stdout), proc.stdout + proc.stderr


def test_a_fork_bomb_stops_at_the_pids_limit(
    env: dict[str, str], sandbox: str, worktree: Path
) -> None:
    code, doc, out = run(env, sandbox, worktree, {"pids": "40"}, PY3, "-c", BOMB, "5000")
    assert (code, doc["note"]) == (2, "over-limit: process limit reached (40 processes)"), out
    code, doc, out = run(env, sandbox, worktree, {"pids": "40"}, PY3, "-c", BOMB, "20")
    assert (code, doc["note"]) == (0, "worker-complete") and "forked and waited" in out, out


def test_a_memory_hog_stops_at_the_memory_limit(
    env: dict[str, str], sandbox: str, worktree: Path
) -> None:
    code, doc, out = run(env, sandbox, worktree, {"memory": "160M"}, PY3, "-c", HOG, "3", "96")
    assert (code, doc["note"]) == (2, "over-limit: memory limit reached (160 MiB)"), out
    code, doc, out = run(env, sandbox, worktree, {"memory": "160M"}, PY3, "-c", HOG, "0", "32")
    assert (code, doc["note"]) == (0, "worker-complete") and "held and let go" in out, out


def test_one_allocation_past_the_memory_limit_is_refused(
    env: dict[str, str], sandbox: str, worktree: Path
) -> None:
    big = "b = bytearray(512 * 1024 * 1024); print('allocated', flush=True)"
    code, _doc, out = run(env, sandbox, worktree, {"memory": "160M"}, PY3, "-c", big)
    assert code != 0 and "MemoryError" in out, out
    code, _doc, out = run(env, sandbox, worktree, {"memory": "1G"}, PY3, "-c", big)
    assert code == 0 and "allocated" in out, out


def test_a_writer_stops_at_the_disk_limit(
    env: dict[str, str], sandbox: str, worktree: Path
) -> None:
    code, doc, out = run(env, sandbox, worktree, {"disk": "24M"}, PY3, "-c", WRITER, "0")
    assert (code, doc["note"]) == (
        2,
        "over-limit: disk limit reached (24 MiB written to the worktree, HOME and tmp)",
    ), out
    code, doc, out = run(env, sandbox, worktree, {"disk": "24M"}, PY3, "-c", WRITER, "6")
    assert (code, doc["note"]) == (0, "worker-complete") and "wrote 6291456" in out, out


# --- overnight as a plain user: the rlimit counts the uid, and binds only the step ---------

MARKED_BOMB = """
import os, sys, time
marked = False
while True:
    try:
        if os.fork() == 0:
            time.sleep(3600)
            os._exit(0)
    except OSError:
        if not marked:
            open(sys.argv[1], "w").write("full")
            marked = True
        time.sleep(0.05)
"""

SIBLING = """
import os, sys, time
mark, count = sys.argv[1], int(sys.argv[2])
while not os.path.exists(mark):
    time.sleep(0.05)
children = []
for _ in range(count):
    pid = os.fork()
    if pid == 0:
        time.sleep(0.5)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
print(f"sibling forked {count}", flush=True)
"""


@pytest.mark.parametrize("mode", ["bwrap", "off"])
def test_a_plain_users_bomb_stops_and_its_own_processes_still_fork(
    env: dict[str, str], step_user: StepUser, mode: str
) -> None:
    """overnight as a plain user (no step user): the step's fork bomb fills its rlimit and is
    killed with the limit named, while another process of the same uid, outside the step's
    tree (as overnight's own are), forks more than the limit meanwhile."""
    if mode == "bwrap" and launch.find_bwrap() is None:
        lacking("bubblewrap is not installed")
    if os.geteuid() != 0:
        pytest.skip("switches to a plain user: needs root")
    stage = Path(f"/tmp/overnight-limits-plain-{uuid.uuid4().hex[:10]}")
    stage.mkdir(mode=0o755)
    os.chown(stage, step_user.uid, step_user.gid)
    ids = [f"--reuid={step_user.uid}", f"--regid={step_user.gid}", "--clear-groups", "--"]
    plain = {k: v for k, v in env.items() if k != "OVERNIGHT_ALLOW_ROOT_STEPS"}
    plain |= {"OVERNIGHT_SANDBOX": mode, "OVERNIGHT_STEP_PIDS": "40"}
    mark = stage / "full"
    try:
        sibling = subprocess.Popen(
            ["setpriv", *ids, PY3, "-c", SIBLING, str(mark), "60"],
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        step = [PY3, "-c", MARKED_BOMB, str(mark)]
        proc = subprocess.run(
            ["setpriv", *ids, reachable.overnight(), "supervise", "--deadline", "90", "--", *step],
            env=plain,
            cwd=stage,
            capture_output=True,
            text=True,
            timeout=150,
        )
        out, _ = sibling.communicate(timeout=60)
        doc = final_doc(proc.stdout)
        assert mark.exists(), proc.stderr[-2000:]  # the step's own forks were refused
        assert (proc.returncode, doc["note"]) == (
            2,
            "over-limit: process limit reached (40 processes)",
        ), proc.stderr[-2000:]
        assert "sibling forked 60" in out
    finally:
        shutil.rmtree(stage, ignore_errors=True)


BURN = """
import sys, time
end = time.process_time() + float(sys.argv[1])
while time.process_time() < end:
    pass
print("burnt", flush=True)
"""
OPENER = """
import sys
held = [open("/dev/null") for _ in range(int(sys.argv[1]))]
print("opened", len(held), flush=True)
"""


def test_a_cpu_burner_stops_at_the_cpu_limit(
    env: dict[str, str], sandbox: str, worktree: Path
) -> None:
    code, doc, out = run(env, sandbox, worktree, {"cpu": "2"}, PY3, "-c", BURN, "60")
    assert (code, doc["note"]) == (2, "over-limit: CPU time limit reached (2 s in one process)"), (
        out
    )
    code, doc, out = run(env, sandbox, worktree, {"cpu": "2"}, PY3, "-c", BURN, "0.2")
    assert (code, doc["note"]) == (0, "worker-complete") and "burnt" in out, out


def test_open_files_stop_at_the_open_files_limit(
    env: dict[str, str], sandbox: str, worktree: Path
) -> None:
    code, _doc, out = run(env, sandbox, worktree, {"open_files": "64"}, PY3, "-c", OPENER, "200")
    assert code != 0 and "Too many open files" in out, out
    code, _doc, out = run(env, sandbox, worktree, {"open_files": "64"}, PY3, "-c", OPENER, "40")
    assert code == 0 and "opened 40" in out, out
