"""Under `overnight supervise --lease-file`, a child that rewrites
``heartbeat_unix`` (and ``note``) in the file beats (and notes); nothing else it writes there
counts: it cannot end its lease, extend its deadline or make the supervisor block."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from overnight.worker.lease import file as leasefile
from overnight.worker.lease.file import FileBeat, asked
from overnight.worker.sandbox import launch
from tests.helpers import OVERNIGHT, lacking, supervise, wait_for

PY = sys.executable

BASE: dict[str, Any] = {"heartbeat_unix": 100.0, "note": "boot", "status": "running"}
ASKED = [
    ({**BASE}, None),
    ({**BASE, "heartbeat_unix": 101.5}, FileBeat(beat=True)),
    ({**BASE, "heartbeat_unix": 101}, FileBeat(beat=True)),
    ({**BASE, "note": "step 2 of 5"}, FileBeat(beat=False, note="step 2 of 5")),
    ({**BASE, "heartbeat_unix": 102.0, "note": "x"}, FileBeat(beat=True, note="x")),
    ({**BASE, "status": "done", "exit_code": 0}, None),
    ({**BASE, "deadline_unix": 1e12, "budget_sec": 1e9}, None),
    ({**BASE, "heartbeat_unix": "soon"}, None),
    ({**BASE, "heartbeat_unix": True}, None),
    ({**BASE, "heartbeat_unix": None}, None),
    ({"status": "done"}, None),
    ({**BASE, "note": 7}, None),
    ({**BASE, "note": "n" * 5000}, FileBeat(beat=False, note="n" * leasefile.MAX_NOTE)),
]


@pytest.mark.parametrize(("now", "want"), ASKED)
def test_what_a_rewrite_asks_for(now: dict[str, Any], want: FileBeat | None) -> None:
    assert asked(BASE, now) == want


def test_read_refuses_what_is_not_a_small_regular_json_object(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(BASE))
    assert leasefile.read(str(good)) == BASE
    link = tmp_path / "link.json"
    link.symlink_to(good)
    assert leasefile.read(str(link)) is None
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert leasefile.read(str(fifo)) is None  # and it did not block
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"note": "x" * (leasefile.MAX_BYTES + 1)}))
    assert leasefile.read(str(big)) is None
    for text in ("[1, 2]", "not json", ""):
        good.write_text(text)
        assert leasefile.read(str(good)) is None


def test_write_never_follows_a_planted_link(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("keep me")
    path = tmp_path / "lease.json"
    (tmp_path / f"lease.json.{os.getpid()}.tmp").symlink_to(target)
    leasefile.write(str(path), BASE)
    assert target.read_text() == "keep me"
    assert json.loads(path.read_text()) == BASE


# The lease recipe's worker: it knows only lease.json and rewrites heartbeat_unix (and its
# note) there, in place or by rename; it prints nothing.
RECIPE = """
import json, os, sys, time
path, seconds, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
end = time.time() + seconds
n = 0
while time.time() < end:
    n += 1
    doc = json.load(open(path))
    doc["heartbeat_unix"] = time.time()
    doc["note"] = f"step {n}"
    if mode == "hostile":
        doc.update(status="done", exit_code=0, deadline_unix=doc["deadline_unix"] + 1e6,
                   budget_sec=1e6, heartbeat_max_gap_sec=1e6, ended_unix=time.time())
    if mode == "rename":
        with open(path + ".mine", "w") as fh:
            json.dump(doc, fh)
        os.replace(path + ".mine", path)
    else:
        with open(path, "w") as fh:
            json.dump(doc, fh)
    time.sleep(0.3)
"""


def lease_show(env: dict[str, str], lease_id: str) -> dict[str, Any]:
    proc = subprocess.run(
        [OVERNIGHT, "lease", "show", lease_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


@pytest.mark.parametrize("mode", ["in-place", "rename"])
@pytest.mark.timeout(60)
def test_the_recipes_worker_beats_through_the_file(
    env: dict[str, str], tmp_path: Path, mode: str
) -> None:
    path = tmp_path / "lease.json"
    code, doc, out = supervise(
        [
            "--gap",
            "1",
            "--deadline",
            "30",
            "--no-output-beats",
            "--lease-file",
            str(path),
            "--",
            PY,
            "-c",
            RECIPE,
            str(path),
            "3",
            mode,
        ],
        env,
        cwd=tmp_path,  # the tree a sandboxed step sees: the lease file in it
    )
    assert code == 0, out
    assert (doc["status"], doc["note"]) == ("done", "worker-complete")
    assert json.loads(path.read_text())["status"] == "done"


@pytest.mark.timeout(60)
def test_a_note_written_to_the_file_reaches_the_lease(env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "lease.json"
    lease_id = "file-note-" + os.urandom(4).hex()
    proc = subprocess.Popen(
        [
            OVERNIGHT,
            "supervise",
            "--gap",
            "1",
            "--deadline",
            "30",
            "--no-output-beats",
            "--lease-id",
            lease_id,
            "--lease-file",
            str(path),
            "--",
            PY,
            "-c",
            RECIPE,
            str(path),
            "4",
            "in-place",
        ],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        note = wait_for(
            lambda: lease_show(env, lease_id).get("note", "").startswith("step "), timeout=20
        )
        assert note
    finally:
        out, err = proc.communicate(timeout=40)
    assert proc.returncode == 0, out + err


@pytest.mark.timeout(60)
def test_the_file_cannot_end_or_extend_the_lease(env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "lease.json"
    code, doc, out = supervise(
        [
            "--gap",
            "1",
            "--deadline",
            "2.5",
            "--grace",
            "0.5",
            "--no-output-beats",
            "--lease-file",
            str(path),
            "--",
            PY,
            "-c",
            RECIPE,
            str(path),
            "60",
            "hostile",
        ],
        env,
        cwd=tmp_path,  # the tree a sandboxed step sees: the lease file in it
    )
    # It beat (so no gap kill) but its deadline held, and its "done" was never taken.
    assert code == 2, out
    assert (doc["status"], doc["note"]) == ("expired", "budget-exceeded")
    assert doc["deadline_unix"] - doc["started_unix"] == pytest.approx(2.5, abs=0.01)
    assert doc["exit_code"] != 0


@pytest.mark.timeout(60)
def test_a_status_without_a_beat_is_a_gap(env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "lease.json"
    child = (
        "import json, sys, time; p = sys.argv[1]; d = json.load(open(p));"
        "d.update(status='done', exit_code=0); json.dump(d, open(p, 'w')); time.sleep(60)"
    )
    code, doc, out = supervise(
        [
            "--gap",
            "1",
            "--deadline",
            "30",
            "--grace",
            "0.5",
            "--no-output-beats",
            "--lease-file",
            str(path),
            "--",
            PY,
            "-c",
            child,
            str(path),
        ],
        env,
        cwd=tmp_path,  # the tree a sandboxed step sees: the lease file in it
    )
    assert code == 3, out
    assert doc["status"] == "killed" and doc["note"].startswith("heartbeat-gap-")


@pytest.mark.parametrize(("sandbox", "code"), [("bwrap", 64), ("off", 0)])
@pytest.mark.timeout(60)
def test_a_lease_file_a_sandboxed_step_could_not_see_is_refused(
    env: dict[str, str], tmp_path: Path, sandbox: str, code: int
) -> None:
    if sandbox == "bwrap" and launch.find_bwrap() is None:
        lacking("bubblewrap is not installed")
    tree = tmp_path / "tree"
    tree.mkdir()
    path = tmp_path / "lease.json"  # beside the tree, not in it
    proc = subprocess.run(
        [OVERNIGHT, "supervise", "--quiet", "--lease-file", str(path), "--", "true"],
        env={**env, "OVERNIGHT_SANDBOX": sandbox},
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == code, proc.stderr
    if code:
        assert len(proc.stderr.strip().splitlines()) == 1 and "--lease-file" in proc.stderr
        assert not path.exists()
    else:  # the twin without a sandbox: the file mirrors the lease
        assert json.loads(path.read_text())["status"] == "done"
