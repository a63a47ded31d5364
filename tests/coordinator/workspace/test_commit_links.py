"""overnight (root) commits, restores, freezes and removes trees the step user writes, and
never reads, writes or removes through a link the step planted there.

Each hostile tree is planted by a real process of the step user; its benign twin (the same
set-up with honest files) shows the act really ran: a real file is committed with its
content, a protected file is put back, a worktree is removed.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from overnight.coordinator.workspace import checkout
from overnight.coordinator.workspace import worktree as workspace
from overnight.worker.sandbox import nofollow
from overnight.worker.sandbox.stepuser import StepUser
from tests.repos import make_repo, sh

SETPRIV = shutil.which("setpriv")
SECRET = "root-only: the step must never read this"
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


def give(path: Path, user: StepUser) -> None:
    for folder, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(folder, name), user.uid, user.gid)
    os.chown(path, user.uid, user.gid)


@pytest.fixture
def top() -> Iterator[Path]:
    """A folder the step user may enter (pytest's are root's 0700), with root's secrets:
    ``secret`` (a 0600 file) and ``vault/`` (0700, holding ``tests/test_calc.py``)."""
    folder = Path(tempfile.mkdtemp(prefix="overnight-links-"))
    os.chmod(folder, 0o755)
    (folder / "secret").write_text(SECRET)
    os.chmod(folder / "secret", 0o600)
    (folder / "vault" / "tests").mkdir(parents=True)
    (folder / "vault" / "tests" / "test_calc.py").write_text(SECRET)
    os.chmod(folder / "vault", 0o700)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def wt(top: Path, step_user: StepUser) -> workspace.Worktree:
    """A task's worktree, handed to the step user as a fresh one is."""
    repo = make_repo(top / "repo")
    base = sh(repo, "rev-parse", "HEAD").strip()
    path = top / "state" / "worktrees" / "ns" / "t1-r1"
    tree = workspace.open_worktree(str(repo), base, "overnight/t1", path)
    give(path, step_user)
    return tree


def entries(wt: workspace.Worktree, commit: str) -> dict[str, tuple[str, bytes]]:
    """Each path of ``commit``: its mode and its blob's bytes."""
    found = workspace.tree_entries(wt.root, commit)
    blobs = workspace.read_blobs(wt.root, [e.sha for e in found])
    return {e.path: (e.mode, blobs[e.sha]) for e in found}


# --- the commit after an agent step -----------------------------------------------------------


def test_links_to_root_only_files_are_committed_as_links(
    wt: workspace.Worktree, top: Path, step_user: StepUser
) -> None:
    plant = (
        'cd "$1" && ln -s "$2/secret" leak && mkdir -p a/b && ln -s "$2/secret" a/b/leak '
        '&& rm -rf tests && ln -s "$2/vault/tests" tests'
    )
    as_user(step_user, plant, wt.path, str(top))
    os.link(top / "secret", Path(wt.path) / "hard")  # as on a host without protected hard links
    commit = workspace.commit_step(wt, "turn 1", keep=None)
    got = entries(wt, commit)
    assert got["leak"] == ("120000", str(top / "secret").encode())
    assert got["a/b/leak"] == ("120000", str(top / "secret").encode())
    assert got["tests"] == ("120000", str(top / "vault" / "tests").encode())
    assert "tests/test_calc.py" not in got and "hard" not in got
    assert all(SECRET.encode() not in data for _, data in got.values())
    # the step user reads the branch afterwards: nothing of the secret is in its objects
    shown = sh(Path(wt.root), "log", "-p", "--all")
    assert SECRET not in shown


def test_a_tracked_file_swapped_for_a_link_is_a_link(
    wt: workspace.Worktree, top: Path, step_user: StepUser
) -> None:
    as_user(step_user, 'cd "$1" && rm calc.py && ln -s "$2/secret" calc.py', wt.path, str(top))
    got = entries(wt, workspace.commit_step(wt, "turn 1", keep=None))
    assert got["calc.py"] == ("120000", str(top / "secret").encode())


def test_benign_twin_real_files_are_committed_with_their_content(
    wt: workspace.Worktree, step_user: StepUser
) -> None:
    plant = (
        'cd "$1" && printf "fixed\\n" > calc.py && mkdir -p a/b && printf "new\\n" > a/b/new.txt '
        '&& printf "#!/bin/sh\\n" > run.sh && chmod 0755 run.sh && ln -s a/b/new.txt rel '
        '&& printf "mine\\n" > own.txt && ln own.txt own-again.txt'
    )
    as_user(step_user, plant, wt.path)
    got = entries(wt, workspace.commit_step(wt, "turn 1", keep=None))
    assert got["calc.py"] == ("100644", b"fixed\n")
    assert got["a/b/new.txt"] == ("100644", b"new\n")
    assert got["run.sh"] == ("100755", b"#!/bin/sh\n")
    assert got["rel"] == ("120000", b"a/b/new.txt")
    assert got["own.txt"] == got["own-again.txt"] == ("100644", b"mine\n")
    assert got["tests/test_calc.py"][0] == "100644"


# --- the verifier's tree: protected files put back ---------------------------------------------


def test_a_protected_file_is_put_back_through_no_planted_link(
    top: Path, step_user: StepUser
) -> None:
    tree = top / "tree"
    outside = top / "outside"
    outside.mkdir()
    (outside / "test_calc.py").write_text("root's own\n")
    tree.mkdir()
    give(tree, step_user)
    as_user(
        step_user,
        'ln -s "$2" "$1/tests" && ln -s "$2/test_calc.py" "$1/x.py"',
        str(tree),
        str(outside),
    )
    checkout.write_entry(tree, "tests/test_calc.py", "100644", b"the base's test\n")
    checkout.write_entry(tree, "x.py", "100644", b"x\n")
    assert (outside / "test_calc.py").read_text() == "root's own\n"
    assert not (tree / "tests").is_symlink()
    assert (tree / "tests" / "test_calc.py").read_text() == "the base's test\n"
    assert (tree / "x.py").read_text() == "x\n" and not (tree / "x.py").is_symlink()
    # benign twin: an honest folder keeps what it holds and gets the file
    (tree / "src").mkdir()
    (tree / "src" / "keep.py").write_text("k\n")
    checkout.write_entry(tree, "src/m.py", "100755", b"m\n")
    assert (tree / "src" / "keep.py").read_text() == "k\n"
    assert stat.S_IMODE((tree / "src" / "m.py").stat().st_mode) == 0o755


# --- an in-place task's tree, frozen after its agent step --------------------------------------


def test_a_frozen_tree_holds_links_not_what_they_reach(top: Path, step_user: StepUser) -> None:
    work = top / "work"
    work.mkdir()
    give(work, step_user)
    plant = (
        'cd "$1" && printf "real\\n" > real.txt && printf "#!/bin/sh\\n" > run.sh '
        '&& chmod 4755 run.sh && ln -s "$2/secret" leak && ln -s "$2/vault" vault '
        '&& mkfifo pipe && mkdir d && ln -s "$2/secret" d/leak'
    )
    as_user(step_user, plant, str(work), str(top))
    os.link(top / "secret", work / "hard")
    into = top / "frozen"
    nofollow.copy_tree(work, into)
    assert os.readlink(into / "leak") == str(top / "secret")
    assert os.readlink(into / "d" / "leak") == str(top / "secret")
    assert os.readlink(into / "vault") == str(top / "vault")
    assert not (into / "pipe").exists() and not (into / "hard").exists()
    # benign twin: the step's own files are copied, their mode without a set-id bit
    assert (into / "real.txt").read_text() == "real\n"
    assert stat.S_IMODE((into / "run.sh").stat().st_mode) == 0o755


# --- prune: removing a finished task's worktree ------------------------------------------------


def test_removing_a_worktree_removes_links_not_their_targets(
    wt: workspace.Worktree, top: Path, step_user: StepUser
) -> None:
    outside = top / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "data").write_text("keep me")
    os.chmod(outside, 0o755)
    plant = (
        'mkdir -p "$1/build/deep" && ln -s "$2" "$1/build/out" && ln -s "$2/sub" "$1/build/deep/in"'
    )
    as_user(step_user, plant, wt.path, str(outside))
    workspace.commit_step(wt, "turn 1", keep=None)
    workspace.remove_worktree(wt.root, wt.path)
    assert not os.path.lexists(wt.path)
    assert (outside / "sub" / "data").read_text() == "keep me"
    assert stat.S_IMODE(outside.stat().st_mode) == 0o755
    assert workspace.branch_exists(wt.root, "overnight/t1")
    assert not [w for w in workspace.list_worktrees(wt.root) if w.path == wt.path]


def test_benign_twin_a_clean_worktree_is_removed_and_a_dirty_one_kept(
    wt: workspace.Worktree, step_user: StepUser
) -> None:
    as_user(step_user, 'mkdir -p "$1/build" && echo x > "$1/build/o.txt"', wt.path)
    as_user(step_user, 'echo y > "$1/untracked.txt"', wt.path)
    with pytest.raises(workspace.GitError, match="modified or untracked"):
        workspace.remove_worktree(wt.root, wt.path)
    assert os.path.exists(os.path.join(wt.path, "calc.py"))
    workspace.commit_step(wt, "turn 1", keep=None)
    workspace.remove_worktree(wt.root, wt.path)
    assert not os.path.lexists(wt.path)


def test_files_hashed_in_several_batches_keep_their_own_content(
    wt: workspace.Worktree, step_user: StepUser, monkeypatch: pytest.MonkeyPatch
) -> None:
    from overnight.coordinator.workspace import tree

    monkeypatch.setattr(tree, "_chunk", lambda: 3)  # 3 descriptors a batch: many batches
    plant = 'cd "$1" && mkdir m && for i in 1 2 3 4 5 6 7 8 9 10; do echo "n$i" > "m/f$i"; done'
    as_user(step_user, plant, wt.path)
    got = entries(wt, workspace.commit_step(wt, "turn 1", keep=None))
    assert all(got[f"m/f{i}"] == ("100644", f"n{i}\n".encode()) for i in range(1, 11))
