"""OVERNIGHT_SANDBOX: its rule, and exit 78 in one line naming the fix where the sandbox is
asked for and cannot start; a sandbox that can start runs the step."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from overnight.config.validate import read_fast, sandbox_mode
from overnight.worker.sandbox import launch
from tests.helpers import OVERNIGHT, lacking


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("bwrap", "bwrap"), ("off", "off"), (" BWRAP ", "bwrap"), ("on", None), ("", None)],
)
def test_the_rule(raw: str, expected: str | None) -> None:
    if expected is None:
        with pytest.raises(ValueError, match="bwrap or off"):
            sandbox_mode(raw)
    else:
        assert sandbox_mode(raw) == expected


def test_the_default_is_bwrap_and_the_fast_path_reads_it() -> None:
    assert read_fast({}, dotenv=False).sandbox == "bwrap"  # type: ignore[union-attr]
    fast = read_fast({"OVERNIGHT_SANDBOX": "off"}, dotenv=False)
    assert fast is not None and fast.sandbox == "off"


def test_off_never_probes() -> None:
    def tried(user: object) -> str | None:
        raise AssertionError("off started a sandbox")

    assert launch.require("off", None, tried) is False


@pytest.mark.parametrize(
    ("problem", "fix"),
    [
        (None, None),
        ("bwrap is not installed", "install bubblewrap (apt-get install bubblewrap)"),
        ("bwrap: No permissions to create new namespace", "allow unprivileged user namespaces"),
    ],
)
def test_require_starts_one_and_names_the_fix(problem: str | None, fix: str | None) -> None:
    tried: list[object] = []

    def probe(user: object) -> str | None:
        tried.append(user)
        return problem

    if problem is None:
        assert launch.require("bwrap", None, probe) is True
    else:
        with pytest.raises(launch.SandboxUnavailable) as caught:
            launch.require("bwrap", None, probe)
        assert caught.value.exit_code == 78
        assert problem in caught.value.message and "OVERNIGHT_SANDBOX=off" in caught.value.message
        if not launch.in_container():
            assert fix in caught.value.message
    assert tried == [None]


NAMESPACES = "bwrap: No permissions to create new namespace, likely because the kernel forbids it"
PROC = "bwrap: Can't mount proc on /newroot/proc: Operation not permitted"
UID_MAP = "bwrap: setting up uid map: Permission denied"
CONTAINER = "security_opt seccomp=unconfined, apparmor=unconfined and systempaths=unconfined"
USERNS = "allow unprivileged user namespaces"


@pytest.mark.parametrize(
    ("problem", "container", "named", "not_named"),
    [
        ("bwrap is not installed", True, "apt-get install bubblewrap", CONTAINER),
        ("the gateway bridge needs python3 in the system folders", False, "python3", USERNS),
        (NAMESPACES, False, USERNS, CONTAINER),
        (NAMESPACES, True, CONTAINER, USERNS),
        (PROC, True, CONTAINER, USERNS),
        (UID_MAP, True, CONTAINER, None),
        (UID_MAP, True, "apparmor_restrict_unprivileged_userns=0", None),
        ("bwrap: exit 1", True, CONTAINER, None),
        ("bwrap: exit 1", False, USERNS, CONTAINER),
    ],
)
def test_the_fix_named_for_each_problem(
    problem: str, container: bool, named: str, not_named: str | None
) -> None:
    fix = launch.fix_for(problem, container)
    assert named in fix
    assert not_named is None or not_named not in fix


# Each command runs with the system's bwrap replaced, in a mount namespace of its own, by
# MISSING (not a program: as on a host without bubblewrap) or REFUSED (a bwrap that fails as
# one does where the kernel or a container's policy forbids its namespaces); the host's
# bwrap is untouched. No seam in overnight: it finds bwrap as it always does.
MISSING = ""
REFUSED = f"#!/bin/sh\necho '{NAMESPACES}' >&2\nexit 1\n"


def replaced_bwrap(tmp_path: Path, text: str) -> list[str]:
    """The argv prefix that runs a command with ``/usr/bin/bwrap`` replaced by ``text``."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        lacking("replacing bwrap in a mount namespace of its own needs root and unshare(1)")
    if launch.find_bwrap() != "/usr/bin/bwrap":
        lacking("bubblewrap is not installed at /usr/bin/bwrap")
    stand_in = tmp_path / "bwrap"
    stand_in.write_text(text)
    stand_in.chmod(0o755 if text else 0o644)
    mount = 'mount --bind "$0" /usr/bin/bwrap && exec "$@"'
    unshare = ["unshare", "--mount", "--propagation", "private", "--"]
    return [*unshare, "sh", "-c", mount, str(stand_in)]


RQ = str(Path(OVERNIGHT).with_name("rq"))
COMMANDS = {
    "supervise": [OVERNIGHT, "supervise", "--quiet", "--", "echo", "step-ran"],
    "worker": [OVERNIGHT, "worker", "--burst"],
    "up": [OVERNIGHT, "up", "--exit-when-done", "--tasks", "."],
    "demo": [OVERNIGHT, "demo", "--state-dir", "demo-state"],
    "rq-worker": [RQ, "worker", "-w", "overnight.coordinator.dispatch.OvernightWorker", "--burst"],
}


# up and demo past the check are tests/coordinator/night's.
CASES = [(c, b) for c in COMMANDS for b in ("missing", "refused")] + [
    (c, "real") for c in ("supervise", "worker", "rq-worker")
]


@pytest.mark.parametrize(("command", "bwrap"), CASES)
def test_each_command_that_runs_steps_exits_78_in_one_line_when_no_sandbox_can_start(
    env: dict[str, str], tmp_path: Path, command: str, bwrap: str
) -> None:
    """``supervise``, ``worker``, ``up``, ``demo`` and ``rq worker -w``: with bwrap missing or
    refused, exit 78 and one line naming the problem and its fix, no step run; with the real
    bwrap in the same set-up (the twin), the command goes past the check."""
    text = {"missing": MISSING, "refused": REFUSED, "real": None}[bwrap]
    prefix = [] if text is None else replaced_bwrap(tmp_path, text)
    argv = COMMANDS[command]
    if command == "rq-worker":
        argv = [*argv, "--url", env["OVERNIGHT_REDIS_URL"], env["OVERNIGHT_NAMESPACE"]]
    step_env = {**env, "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"]}
    step_env.pop("OVERNIGHT_SANDBOX", None)  # the default: a sandbox
    done = subprocess.run(
        [*prefix, *argv],
        env=step_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if text is None:
        assert done.returncode == 0, done.stderr[-3000:]
        assert command != "supervise" or "step-ran" in done.stdout
        return
    assert done.returncode == 78, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    problem = "bwrap is not installed" if text == MISSING else NAMESPACES
    assert "OVERNIGHT_SANDBOX=bwrap" in lines[0] and problem in lines[0]
    assert launch.fix_for(problem, launch.in_container()) in lines[0]
    assert "OVERNIGHT_SANDBOX=off" in lines[0]
    assert "step-ran" not in done.stdout


@pytest.mark.parametrize("where", ["/", "/tmp", "/usr/share"])
def test_a_step_run_from_a_host_folder_is_not_started(
    env: dict[str, str], tmp_path: Path, where: str
) -> None:
    """``/``, all of ``/tmp`` or a system folder as the worktree would bind the host
    read-write: the step does not start (126) and one line says why; from a folder of its
    own the same step runs (the twin)."""
    if launch.find_bwrap() is None:
        lacking("bubblewrap is not installed")
    step_env = {**env, "OVERNIGHT_SANDBOX": "bwrap"}
    argv = [OVERNIGHT, "supervise", "--quiet", "--", "echo", "step-ran"]
    done = subprocess.run(argv, env=step_env, cwd=where, capture_output=True, text=True, timeout=60)
    assert done.returncode == 126, done.stderr
    assert "would expose the host read-write" in done.stdout + done.stderr
    assert "step-ran" not in done.stdout
    twin = subprocess.run(
        argv, env=step_env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert twin.returncode == 0 and "step-ran" in twin.stdout, twin.stderr


@pytest.mark.parametrize("mode", ["off", "bwrap"])
def test_supervise_says_with_its_result_that_its_step_ran_without_a_sandbox(
    env: dict[str, str], tmp_path: Path, mode: str
) -> None:
    if mode == "bwrap" and launch.find_bwrap() is None:
        lacking("bubblewrap is not installed")
    argv = [OVERNIGHT, "supervise", "--", "echo", "step-ran"]
    step_env = {**env, "OVERNIGHT_SANDBOX": mode}
    done = subprocess.run(
        argv, env=step_env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "step-ran" in done.stdout, done.stderr
    said = "the step ran WITHOUT a sandbox (OVERNIGHT_SANDBOX=off)"
    assert (said in done.stderr) == (mode == "off"), done.stderr
