"""A night can be read afterwards: in the folder where `up` ran, with no Redis configured,
status, logs, diff, receipts and report read the latest night there (its Redis started again
on its data, or the running one), say so in one line, and --state-dir picks another."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from overnight.coordinator.night.record import Found, NightRecord, candidates, latest, use_night
from tests import reachable
from tests.helpers import OVERNIGHT, task_file, wait_for
from tests.repos import sh


def night(state: str, started: float) -> Found:
    return Found(Path(state), NightRecord(namespace="n", started=started, redis_dir="/r"))


@pytest.mark.parametrize(
    ("found", "want"),
    [
        ([], None),
        ([night("a", 1.0)], "a"),
        ([night("a", 1.0), night("b", 2.0)], "b"),
        ([night("b", 2.0), night("a", 1.0)], "b"),
        ([night("a", 2.0), night("b", 2.0)], "b"),
    ],
)
def test_the_latest_night_is_the_one_that_started_last(found: list[Found], want: str) -> None:
    got = latest(found)
    assert (None if got is None else str(got.state_dir)) == want


def test_nights_are_looked_for_in_the_folder_and_each_demo_night(tmp_path: Path) -> None:
    (tmp_path / "demo" / "20260101-1").mkdir(parents=True)
    (tmp_path / "demo" / "20260102-2").mkdir(parents=True)
    assert candidates(tmp_path) == [
        tmp_path,
        tmp_path / "state",
        tmp_path / "demo" / "20260101-1" / "state",
        tmp_path / "demo" / "20260102-2" / "state",
    ]


def test_with_no_night_and_no_redis_configured_it_says_it_reads_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in list(os.environ):
        if key.startswith("OVERNIGHT_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)  # no .env here
    err = io.StringIO()
    use_night(Path(".overnight"), explicit=False, err=err)
    assert err.getvalue() == (
        "overnight: no night recorded in .overnight and OVERNIGHT_REDIS_URL is unset: "
        "reading the default, Redis redis://127.0.0.1:6379/0, namespace 'overnight'\n"
    )


def tasks_repo(folder: Path, name: str) -> Path:
    """A git repository holding one task that writes ok.txt and prints a line."""
    folder.mkdir()
    agent = ["sh", "-c", f"echo done > ok.txt; echo {name}-step-said-hello"]
    task_file(folder, name, agent, [["test", "-f", "ok.txt"]], max_calls=4)
    (folder / name / ".keep").touch()
    sh(folder, "init", "-q", "-b", "main")
    sh(folder, "add", ".")
    sh(folder, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tasks")
    return folder


def run(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def reading_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("overnight: reading the night started "), err
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_night_is_read_while_it_runs_and_after_it_and_state_dir_picks_another(
    tmp_path: Path, env: dict[str, str]
) -> None:
    decoy = env["OVERNIGHT_REDIS_URL"]  # a Redis that answers, holding no task
    quiet = {
        k: v for k, v in env.items() if k not in ("OVERNIGHT_REDIS_URL", "OVERNIGHT_NAMESPACE")
    }
    quiet["OVERNIGHT_STATE_DIR"] = str(tmp_path / "workspace")
    here = tmp_path / "here"
    here.mkdir()
    first = subprocess.Popen(
        [OVERNIGHT, "up", "--tasks", str(tasks_repo(tmp_path / "a", "one")), "--budget", "4"],
        cwd=here,
        env=quiet,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # While it runs, status in its folder reads its Redis (through the address it left).
        def live() -> str | None:
            shown = run(here, quiet, "status", "one")
            return shown.stderr if '"finished_verified"' in shown.stdout else None

        assert "(running), Redis redis://:****@127.0.0.1:" in reading_line(
            wait_for(live, timeout=120, interval=0.5)
        )
        first.send_signal(signal.SIGTERM)
        _, up_err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 128 + signal.SIGTERM, up_err

    status = run(here, quiet, "status", "one")
    assert json.loads(status.stdout)["state"] == "finished_verified", status.stderr
    line = reading_line(status.stderr)
    assert "in .overnight, Redis redis://:****@127.0.0.1:" in line
    assert "a private redis-server on its data in" in line and "namespace 'overnight'" in line
    logs = run(here, quiet, "logs", "one")
    assert "one-step-said-hello" in logs.stdout, logs.stderr
    reading_line(logs.stderr)
    diff = run(here, quiet, "diff", "one")
    assert "+done" in diff.stdout and "ok.txt" in diff.stdout, diff.stderr
    receipts = run(here, quiet, "receipts", "one")
    assert '"task_submitted"' in receipts.stdout, receipts.stderr
    report = run(here, quiet, "report", "--plain")
    assert "finished_verified" in report.stdout and "one " in report.stdout, report.stderr
    reading_line(report.stderr)

    # Its twin: a Redis configured is read as configured (no line), unless --state-dir is given.
    configured = {**quiet, "OVERNIGHT_REDIS_URL": decoy}
    shown = run(here, configured, "status")
    assert json.loads(shown.stdout) == [] and shown.stderr == ""
    shown = run(here, configured, "status", "--state-dir", ".overnight")
    assert [t["id"] for t in json.loads(shown.stdout)] == ["one"]

    # A second night with another state folder: the folder's default stays the first one.
    second = run(
        here,
        quiet,
        "up",
        "--tasks",
        str(tasks_repo(tmp_path / "b", "two")),
        "--budget",
        "4",
        "--exit-when-done",
        "--state-dir",
        str(tmp_path / "other"),
    )
    assert second.returncode == 0, second.stderr
    assert [t["id"] for t in json.loads(run(here, quiet, "status").stdout)] == ["one"]
    other = run(here, quiet, "status", "--state-dir", str(tmp_path / "other"))
    assert [t["id"] for t in json.loads(other.stdout)] == ["two"]
    assert f"in {tmp_path / 'other'}, Redis" in reading_line(other.stderr)
    missing = run(here, quiet, "status", "--state-dir", str(tmp_path / "none"))
    assert missing.returncode == 64
    assert (
        missing.stderr == f"overnight: --state-dir {tmp_path / 'none'}: no night recorded there\n"
    )


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="root and setpriv")
@pytest.mark.timeout(120)
def test_a_night_another_user_ran_is_one_line_not_the_default_redis() -> None:
    parent = Path(tempfile.mkdtemp(prefix="overnight-test-night-"))
    try:
        parent.chmod(0o755)
        state = parent / ".overnight"
        state.mkdir(mode=0o711)
        state.chmod(0o711)
        (state / "redis").mkdir(mode=0o700)
        record = NightRecord(namespace="n", started=1.0, redis_dir=str(state / "redis"))
        (state / "night.json").write_text(record.model_dump_json())
        quiet = {k: v for k, v in os.environ.items() if not k.startswith("OVERNIGHT_")}
        as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
        refused = subprocess.run(
            [*as_nobody, reachable.overnight(), "status"],
            cwd=parent,
            env=quiet,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 64, refused.stderr
        assert refused.stderr == (
            "overnight: cannot read the night in .overnight: permission denied; "
            "run this as the user who ran it\n"
        )
        # Its twin: the user who ran it reads that night (its Redis started on its data).
        mine = run(parent, quiet, "status")
        assert mine.returncode == 0 and json.loads(mine.stdout) == [], mine.stderr
        assert "namespace 'n'" in reading_line(mine.stderr)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
