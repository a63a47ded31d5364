"""overnight, as root, removes a step's scratch HOME and writes step logs in folders the step
user can write, without following what the step plants there.

Each attack is planted by a real process of the step user; its benign twin (the same set-up
with an honest file) shows the act really ran: the HOME's files are gone, the log holds the
output.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from overnight.worker.sandbox import nofollow
from overnight.worker.sandbox.stepenv import make_home, remove_home
from overnight.worker.sandbox.stepuser import StepUser

SETPRIV = shutil.which("setpriv")
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None, reason="plants as the step user: needs root, setpriv"
)


def as_user(user: StepUser, script: str, *args: str) -> None:
    """Run ``sh -c script`` as ``user`` (a real process of the step's uid)."""
    assert SETPRIV is not None
    argv = [SETPRIV, f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups"]
    proc = subprocess.run(
        [*argv, "sh", "-c", script, "sh", *args], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def shared(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder in /tmp anyone may enter (pytest's own are root's 0700), where scratch HOMEs
    are made too: a removal that wrongly chmods a HOME's parent hits this folder, not /tmp."""
    top = Path(tempfile.mkdtemp(prefix="overnight-nofollow-"))
    os.chmod(top, 0o755)
    (top / "tmp").mkdir()
    os.chmod(top / "tmp", 0o1777)  # as /tmp: a step may rename its own HOME there
    monkeypatch.setattr(tempfile, "tempdir", str(top / "tmp"))
    yield top
    shutil.rmtree(top, ignore_errors=True)


def victim(folder: Path) -> Path:
    """A root-owned folder elsewhere, 0755 in a 0755 parent, holding a root-only file."""
    parent = folder / "elsewhere"
    parent.mkdir(mode=0o755)
    os.chmod(parent, 0o755)
    inside = parent / "precious"
    inside.mkdir(mode=0o755)
    os.chmod(inside, 0o755)
    (inside / "data").write_text("keep me")
    os.chmod(inside / "data", 0o600)
    return inside


def intact(inside: Path) -> None:
    assert (inside / "data").read_text() == "keep me"
    assert stat.S_IMODE(inside.stat().st_mode) == 0o755
    assert stat.S_IMODE(inside.parent.stat().st_mode) == 0o755


# --- the scratch HOME ---------------------------------------------------------------------------


def test_a_home_swapped_for_a_link_before_removal_leaves_the_target_alone(
    step_user: StepUser, shared: Path
) -> None:
    inside = victim(shared)
    home = make_home("lease-swap", step_user)
    parent_mode = stat.S_IMODE(os.stat(os.path.dirname(home)).st_mode)
    # The step (or another of its user) moves its HOME away and leaves a link in its place.
    as_user(step_user, 'mv "$1" "$1.moved" && ln -s "$2" "$1"', home, str(inside))
    assert os.path.islink(home)
    remove_home(home)
    assert not os.path.lexists(home)
    intact(inside)
    assert stat.S_IMODE(os.stat(os.path.dirname(home)).st_mode) == parent_mode
    remove_home(home + ".moved")
    assert not os.path.lexists(home + ".moved")


def test_links_at_depth_in_a_home_are_removed_as_links(step_user: StepUser, shared: Path) -> None:
    inside = victim(shared)
    home = make_home("lease-deep", step_user)
    plant = (
        'mkdir -p "$1/a/b/c" "$1/ro/sub" && ln -s "$2" "$1/top" && ln -s "$2" "$1/a/b/c/deep" '
        '&& ln -s "$2/data" "$1/a/file-link" && ln -s "$2" "$1/ro/sub/link" '
        '&& chmod 0500 "$1/ro/sub" "$1/ro" && chmod 0 "$1/a/b"'
    )
    as_user(step_user, plant, home, str(inside))
    remove_home(home)
    assert not os.path.lexists(home)
    intact(inside)
    assert sorted(os.listdir(inside)) == ["data"]


def test_benign_twin_a_home_of_real_files_and_read_only_folders_is_removed(
    step_user: StepUser, shared: Path
) -> None:
    home = make_home("lease-real", step_user, {".config/tool.toml": "a = 1\n"})
    plant = (
        'mkdir -p "$1/go/pkg/mod/x" "$1/a/b" && echo hi > "$1/go/pkg/mod/x/f" '
        '&& echo hi > "$1/a/b/f" && chmod 0500 "$1/go/pkg/mod/x" "$1/go/pkg/mod" && chmod 0 "$1/a"'
    )
    as_user(step_user, plant, home)
    assert os.path.exists(os.path.join(home, "go/pkg/mod/x/f"))
    remove_home(home)
    assert not os.path.lexists(home)


def test_as_the_step_user_read_only_folders_go_and_a_link_target_keeps_its_mode(
    step_user: StepUser, shared: Path
) -> None:
    # The non-root path: folders its owner cannot list or write are made so through their
    # own descriptors; a link to a folder of the same user's with mode 0500 stays 0500.
    code = shared / "code"
    code.mkdir(mode=0o755)
    shutil.copy(nofollow.__file__, code / "nofollow.py")
    os.chmod(code, 0o755)
    work = shared / "work"
    work.mkdir()
    os.chown(work, step_user.uid, step_user.gid)
    plant = (
        'mkdir -p "$1/tree/ro/x" "$1/tree/closed/y" "$1/outside" && echo o > "$1/outside/f" '
        '&& echo f > "$1/tree/ro/x/f" && ln -s "$1/outside" "$1/tree/ro/link" '
        '&& chmod 0500 "$1/tree/ro/x" "$1/tree/ro" "$1/outside" && chmod 0 "$1/tree/closed"'
    )
    as_user(step_user, plant, str(work))
    py = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    remove = f"import sys; sys.path.insert(0, {str(code)!r}); import nofollow; "
    remove += f"nofollow.remove_path({str(work / 'tree')!r})"
    as_user(step_user, '"$1" -c "$2"', py, remove)
    assert not (work / "tree").exists()
    assert (work / "outside" / "f").read_text() == "o\n"
    assert stat.S_IMODE((work / "outside").stat().st_mode) == 0o500


# --- step logs ------------------------------------------------------------------------------------


def logs_folder(shared: Path) -> Path:
    """``task-logs/<namespace>`` as older code made it under a umask of 000: open to all."""
    folder = shared / "state" / "task-logs" / "ns"
    folder.mkdir(parents=True)
    os.chmod(folder, 0o777)
    return folder


def append(path: Path, data: bytes) -> bool:
    """Write ``data`` as a step's output to the log ``path`` as the worker does; False if
    the log was refused (the step would run without it)."""
    from overnight.coordinator.tasks.steps import StepRequest, open_capture

    cap = open_capture(StepRequest("t1", "agent", ["true"], "/", {}, 5.0, 5.0, 1.0, log_path=path))
    if cap.log is None:
        return False
    cap.log.write(data)
    cap.close()
    return True


@pytest.mark.parametrize("where", ["the task's folder", "the log file"])
def test_a_planted_link_never_makes_root_append_to_its_target(
    step_user: StepUser, shared: Path, where: str
) -> None:
    logs = logs_folder(shared)
    target = shared / "root-owned.conf"
    target.write_text("root's own\n")
    os.chmod(target, 0o600)
    holder = shared / "holder"  # root's, holding a root-owned file of the log's very name
    holder.mkdir(mode=0o700)
    (holder / "turn-001-step-00-agent.log").write_text("root's too\n")
    os.chmod(holder / "turn-001-step-00-agent.log", 0o600)
    if where == "the task's folder":
        as_user(step_user, 'ln -s "$2" "$1/t1"', str(logs), str(holder))
    else:
        plant = (
            'mkdir "$1/t1" && chmod 0777 "$1/t1" && ln -s "$2" "$1/t1/turn-001-step-00-agent.log"'
        )
        as_user(step_user, plant, str(logs), str(target))
    assert not append(logs / "t1" / "turn-001-step-00-agent.log", b"step output\n")
    assert target.read_text() == "root's own\n"
    assert (holder / "turn-001-step-00-agent.log").read_text() == "root's too\n"
    # and overnight's own folder is closed to others' writes from then on
    assert not (logs.stat().st_mode & 0o022)


def test_a_planted_hard_link_is_not_appended_to(step_user: StepUser, shared: Path) -> None:
    logs = logs_folder(shared)
    (logs / "t1").mkdir(mode=0o700)
    target = shared / "root-owned.conf"
    target.write_text("root's own\n")
    os.link(target, logs / "t1" / "turn-001-step-00-agent.log")  # a host without protected links
    assert not append(logs / "t1" / "turn-001-step-00-agent.log", b"step output\n")
    assert target.read_text() == "root's own\n"


def test_benign_twin_output_reaches_the_log(step_user: StepUser, shared: Path) -> None:
    logs = logs_folder(shared)
    as_user(step_user, "true")  # the same user was there, and planted nothing
    path = logs / "t1" / "turn-001-step-00-agent.log"
    assert append(path, b"step output\n") and append(path, b"more\n")
    assert path.read_bytes() == b"step output\nmore\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((logs / "t1").stat().st_mode) == 0o700


def test_under_umask_000_no_folder_overnight_makes_is_world_writable(tmp_path: Path) -> None:
    # A real process with umask 000 makes a step's log (through open_capture), its scratch
    # HOME, a task's worktree and a prepared tree, as the worker does.
    state = tmp_path / "state"
    repo = tmp_path / "repo"
    repo.mkdir()
    for args in (
        ["init", "-q", "-b", "main"],
        [
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "base",
        ],
    ):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    (repo / "pkg").mkdir()
    (repo / "pkg" / "m.py").write_text("x = 1\n")
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "m"],
        cwd=repo,
        check=True,
    )
    code = f"""
import os, sys
from pathlib import Path
os.umask(0)
from overnight.coordinator.tasks.steps import StepRequest, open_capture
from overnight.coordinator.tasks.prepare import say
from overnight.coordinator.workspace import worktree, checkout
from overnight.worker.sandbox.stepenv import make_home
state = Path({str(state)!r})
log = state / "task-logs" / "ns" / "t1" / "turn-001-step-01-agent.log"
req = StepRequest("t1", "agent", ["true"], "/", {{}}, 5.0, 5.0, 1.0, log_path=log)
cap = open_capture(req)
cap.log.write(b"output\\n"); cap.close()
say(state / "task-logs" / "ns" / "t2" / "turn-001-step-01-agent.log", "overnight: a line")
print(make_home("lease-umask", None, {{"a/b/c.txt": "x"}}))
sha = worktree.head({str(repo)!r})
wt = worktree.open_worktree({str(repo)!r}, sha, "overnight/t1", state / "worktrees" / "ns" / "t1-r")
checkout.write_entry(state / "worktrees" / "ns" / "t1-r", "new/deep/f.txt", "100644", b"x")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    home = Path(proc.stdout.strip().splitlines()[-1])
    try:
        log = state / "task-logs" / "ns" / "t1" / "turn-001-step-01-agent.log"
        assert log.read_bytes() == b"output\n"
        assert (
            "a line"
            in (state / "task-logs" / "ns" / "t2" / "turn-001-step-01-agent.log").read_text()
        )
        open_to_others = []
        for top in (state, home):
            for folder, dirs, files in os.walk(top):
                for name in [".", *dirs, *files]:
                    info = os.lstat(os.path.join(folder, name))
                    if not stat.S_ISLNK(info.st_mode) and info.st_mode & 0o002:
                        open_to_others.append(os.path.join(folder, name))
        assert open_to_others == []
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        assert (state / "worktrees" / "ns" / "t1-r" / "pkg" / "m.py").exists()  # the twin: made
    finally:
        remove_home(str(home))
