"""OVERNIGHT_SANDBOX: its rule, and exit 78 in one line naming the fix where the sandbox is
asked for and cannot start; a sandbox that can start runs the step."""

from __future__ import annotations

import subprocess
import sys
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


def test_the_default_is_off_and_the_fast_path_reads_it() -> None:
    assert read_fast({}, dotenv=False).sandbox == "off"  # type: ignore[union-attr]
    fast = read_fast({"OVERNIGHT_SANDBOX": "bwrap"}, dotenv=False)
    assert fast is not None and fast.sandbox == "bwrap"


def test_off_never_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "find_bwrap", lambda: None)
    assert launch.require("off", None) is False


# Runs the real command with bwrap reported missing (as on a host without it).
WITHOUT_BWRAP = (
    "import sys\n"
    "from overnight.worker.sandbox import launch\n"
    "launch.find_bwrap = lambda: None\n"
    "from overnight.coordinator.cli.main import main\n"
    "main(sys.argv[1:])\n"
)


@pytest.mark.parametrize("missing", [True, False])
def test_supervise_exits_78_in_one_line_when_no_sandbox_can_start(
    env: dict[str, str], missing: bool
) -> None:
    step_env = {**env, "OVERNIGHT_SANDBOX": "bwrap"}
    if missing:
        argv = [sys.executable, "-c", WITHOUT_BWRAP]
    else:
        if launch.find_bwrap() is None:
            lacking("bubblewrap is not installed")
        argv = [OVERNIGHT]
    done = subprocess.run(
        [*argv, "supervise", "--quiet", "--", "echo", "step-ran"],
        env=step_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if missing:
        assert done.returncode == 78, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        assert "OVERNIGHT_SANDBOX=bwrap" in lines[0] and "bwrap is not installed" in lines[0]
        assert "apt-get install bubblewrap" in lines[0] and "OVERNIGHT_SANDBOX=off" in lines[0]
        assert "step-ran" not in done.stdout
    else:
        assert done.returncode == 0, done.stderr
        assert "step-ran" in done.stdout


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
