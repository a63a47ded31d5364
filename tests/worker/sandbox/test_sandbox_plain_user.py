"""overnight as a plain user: the sandbox starts through an unprivileged user namespace (no
setpriv, no root), and the step sees its worktree and nothing else of what that user can
read; the same step without the sandbox reads it (the benign twin)."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from overnight.worker.sandbox import launch
from overnight.worker.sandbox.stepuser import StepUser
from tests.helpers import capability
from tests.reachable import source_for_others

PY3 = "/usr/bin/python3"
pytestmark = [
    capability(None if launch.find_bwrap() else "bubblewrap is not installed"),
    capability(None if os.access(PY3, os.X_OK) else "no system python3"),
]


@cache
def source() -> str:
    """Where the plain user imports overnight from (the checkout may be closed to it)."""
    return str(source_for_others())


# Run by the plain user: launch CMD in its sandbox (argv[1] "bwrap") or plainly ("off").
LAUNCHER = """
import subprocess, sys
sys.path.insert(0, sys.argv[4])
from overnight.worker.sandbox import launch
mode, wt, cmd = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "bwrap":
    ready = launch.prepare(["sh", "-c", cmd], cwd=wt, worktree=wt, user=None,
                           env={"PATH": launch.SYSTEM_PATH})
    done = subprocess.run(ready.argv, env=ready.env, pass_fds=ready.pass_fds)
else:
    done = subprocess.run(["sh", "-c", cmd], cwd=wt)
sys.exit(done.returncode)
"""


@pytest.fixture
def place(step_user: StepUser) -> Iterator[Path]:
    folder = Path(f"/tmp/overnight-plain-{uuid.uuid4().hex[:10]}")
    folder.mkdir(mode=0o755)
    for name in ("wt", "mine"):
        (folder / name).mkdir(mode=0o755)
        os.chown(folder / name, step_user.uid, step_user.gid)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def as_plain_user(
    user: StepUser, mode: str, wt: Path, cmd: str
) -> subprocess.CompletedProcess[str]:
    ids = [f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups"]
    return subprocess.run(
        ["setpriv", *ids, "--", PY3, "-I", "-c", LAUNCHER, mode, str(wt), cmd, source()],
        env={"PATH": launch.SYSTEM_PATH, "HOME": "/nonexistent"},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_plain_users_step_sees_its_worktree_only(step_user: StepUser, place: Path) -> None:
    probe = subprocess.run(
        [
            "setpriv",
            f"--reuid={step_user.uid}",
            f"--regid={step_user.gid}",
            "--clear-groups",
            "--",
            PY3,
            "-I",
            "-c",
            f"import sys; sys.path.insert(0, {source()!r}); import overnight.worker.sandbox.launch",
        ],
        env={"PATH": launch.SYSTEM_PATH},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, f"the plain user cannot import overnight: {probe.stderr[-300:]}"
    secret = place / "mine" / "notes.txt"
    secret.write_text("PLAIN-USER-SECRET\n")
    os.chown(secret, step_user.uid, step_user.gid)
    cmd = f"id -u; echo made > made.txt; cat {secret}; echo more > {place}/mine/planted; true"
    done = as_plain_user(step_user, "bwrap", place / "wt", cmd)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == str(step_user.uid)
    assert (place / "wt" / "made.txt").stat().st_uid == step_user.uid
    assert "PLAIN-USER-SECRET" not in done.stdout and not (place / "mine" / "planted").exists()
    twin = as_plain_user(step_user, "off", place / "wt", cmd)
    assert "PLAIN-USER-SECRET" in twin.stdout and (place / "mine" / "planted").exists()
