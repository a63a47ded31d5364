"""The pool of step uids: the pick is a pure function of the task id and the uids taken; a uid
is held by a flock that dies with its holder; a uid some process runs as, one an account
has, or one that owns a file where the next task's steps would find it is passed over.

Holders are real processes (each takes a uid and waits), killed with SIGKILL to prove that a
crashed holder frees its uid. The uids are from a high range no account or test uses.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from overnight.config.validate import uid_range
from overnight.worker.sandbox import uidpool
from overnight.worker.sandbox.stepuser import StepUser, decide, steps_line
from overnight.worker.sandbox.uidpool import PoolExhausted, UidPool, ids_in_status, pick
from tests.helpers import OVERNIGHT, kill_quietly, wait_for

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="running as another uid needs root")


@pytest.mark.parametrize(
    ("first", "last", "taken", "expected"),
    [
        (100, 100, (), 100),  # one uid, free
        (100, 100, (100,), None),  # one uid, taken
        (100, 102, (100, 101, 102), None),  # all taken
        (100, 102, (100, 102), 101),  # the one left, wherever the start is
        (100, 102, (101, 102, 7), 100),  # uids outside the range change nothing
        (5, 4, (), None),  # an empty range
    ],
)
def test_pick_table(first: int, last: int, taken: tuple[int, ...], expected: int | None) -> None:
    assert pick("some-task", first, last, taken) == expected


def test_pick_starts_where_the_task_id_says_and_walks_on_past_taken_uids() -> None:
    first, last = 61184, 65519
    size = last - first + 1
    mine = pick("fix-parser", first, last, ())
    assert mine is not None and first <= mine <= last
    assert pick("fix-parser", first, last, ()) == mine  # the same task: the same uid
    after = first + (mine - first + 1) % size
    assert pick("fix-parser", first, last, (mine,)) == after  # the next one, wrapping
    others = {pick(f"task-{n}", first, last, ()) for n in range(50)}
    assert len(others) > 40  # task ids spread over the range
    # At the end of the range it wraps to the start.
    last_task = next(f"t{n}" for n in range(100_000) if pick(f"t{n}", 0, 9, ()) == 9)
    assert pick(last_task, 0, 9, (9,)) == 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("61184-65519", "61184-65519"),
        (" 1 - 5 ", "1-5"),
        ("OFF", "off"),
        ("65536-70000", "65536-70000"),
        ("9-8", None),  # empty
        ("0-5", None),  # root
        ("65530-65540", None),  # nobody's
        ("2147483646-2147483647", None),  # (uid_t)-1 as a signed int
        ("61184", None),
        (61184, None),
    ],
)
def test_the_setting_of_step_uids(value: object, expected: str | None) -> None:
    if expected is None:
        with pytest.raises(ValueError, match="FIRST-LAST"):
            uid_range(value)
    else:
        assert uid_range(value) == expected


@pytest.mark.parametrize(
    ("status", "ids"),
    [
        (
            b"Name:\tsh\nUid:\t1\t2\t3\t4\nGid:\t5\t5\t5\t6\nFDSize:\t64\nGroups:\t9\n",
            {1, 2, 3, 4, 5, 6},
        ),
        (b"Name:\tsh\nUid:\t7\t7\t7\t8", {7, 8}),
        (b"Name:\tsh\n", set()),
    ],
)
def test_ids_in_status(status: bytes, ids: set[int]) -> None:
    assert ids_in_status(status) == ids


@pytest.mark.parametrize(
    ("step_user", "allow_root", "euid", "uids", "said"),
    [
        (None, False, 0, "61184-65519", "uids 61184-65519, a uid of its own for each task"),
        (None, True, 0, "61184-65519", "root (OVERNIGHT_ALLOW_ROOT_STEPS=1)"),
        (None, False, 1000, "61184-65519", "this user (uid 1000)"),
        ("step", False, 0, "off", "step (uid 998), the same uid for every task"),
    ],
)
def test_the_line_that_says_who_steps_run_as(
    step_user: str | None, allow_root: bool, euid: int, uids: str, said: str
) -> None:
    def find(name: str) -> StepUser | None:
        return StepUser(name, 998, 998) if name == "step" else None

    user = decide(step_user, allow_root, euid, find, uids=uids)
    assert steps_line(user, euid).startswith(f"steps run as {said}")


@pytest.fixture
def pool_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "run" / "uids"
    folder.parent.mkdir(mode=0o700)
    return folder


@pytest.fixture
def span() -> tuple[int, int]:
    """Three uids of a high range no account and no other test uses."""
    first = 3_000_000_000 // 2 + secrets.randbelow(10_000_000) * 4
    return first, first + 2


HOLDER = """
import sys
from pathlib import Path
from overnight.worker.sandbox.uidpool import PoolExhausted, UidPool
first, last, folder, task, place = sys.argv[1:6]
places = ((Path(place), 1),) if place else ()
try:
    held = UidPool(int(first), int(last), Path(folder), places).take(task)
except PoolExhausted as exc:
    print("EXHAUSTED", exc, flush=True)
    sys.exit(3)
print(held.user.uid, held.user.gid, held.user.name, flush=True)
sys.stdin.read()  # hold it until the test closes stdin, or kills this process
"""


class Holders:
    """Processes that each take a uid of one pool and hold it."""

    def __init__(self, span: tuple[int, int], folder: Path, place: Path | None = None) -> None:
        self.span, self.folder, self.place = span, folder, place
        self.procs: list[subprocess.Popen[str]] = []

    def take(self, task: str) -> tuple[subprocess.Popen[str], str]:
        first, last = self.span
        argv = [sys.executable, "-c", HOLDER, str(first), str(last), str(self.folder), task]
        proc = subprocess.Popen(
            [*argv, str(self.place or "")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        return proc, proc.stdout.readline().strip()

    def close(self) -> None:
        for proc in self.procs:
            kill_quietly(proc.pid)
            proc.wait(timeout=10)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


@pytest.fixture
def holders(span: tuple[int, int], pool_dir: Path) -> Iterator[Holders]:
    found = Holders(span, pool_dir)
    yield found
    found.close()


def test_live_tasks_never_share_a_uid_and_a_killed_holder_frees_its_own(
    holders: Holders, span: tuple[int, int], pool_dir: Path
) -> None:
    taken = {}
    for task in ("a", "b", "c"):
        proc, line = holders.take(task)
        uid, gid, name = line.split()
        assert uid == gid and name == f"overnight-{uid}", line  # no groups, its own gid
        taken[task] = (proc, int(uid))
    assert sorted(uid for _, uid in taken.values()) == list(range(span[0], span[1] + 1))
    _, line = holders.take("d")
    assert line.startswith("EXHAUSTED") and "held or in use" in line, line
    assert (pool_dir.stat().st_mode & 0o777) == 0o700
    # SIGKILL, not a release: the flock dies with its holder.
    proc, freed = taken["b"]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    _, line = holders.take("d")
    assert int(line.split()[0]) == freed, line


def test_a_task_taken_again_gets_its_uid_back(holders: Holders) -> None:
    proc, first = holders.take("same-task")
    assert proc.stdin is not None
    proc.stdin.close()  # an ordinary end: the holder exits and its lock goes
    proc.wait(timeout=10)
    _, again = holders.take("same-task")
    assert again == first


@ROOT_ONLY
def test_a_uid_a_process_runs_as_is_passed_over(holders: Holders, span: tuple[int, int]) -> None:
    setpriv = shutil.which("setpriv")
    assert setpriv is not None
    wanted = pick("busy-task", *span, ())
    assert wanted is not None
    squatter = subprocess.Popen(
        [setpriv, f"--reuid={wanted}", f"--regid={wanted}", "--clear-groups", "sleep", "60"]
    )
    try:
        wait_for(lambda: wanted in uidpool.ids_running(), timeout=10)
        _, line = holders.take("busy-task")
        assert int(line.split()[0]) != wanted, line
    finally:
        squatter.kill()
        squatter.wait(timeout=10)
    _, line = holders.take("busy-task")  # the benign twin: nothing runs as it now
    assert int(line.split()[0]) == wanted, line


@ROOT_ONLY
def test_a_uid_owning_a_file_where_steps_look_is_passed_over(
    span: tuple[int, int], pool_dir: Path, tmp_path: Path
) -> None:
    place = tmp_path / "trees"
    place.mkdir()
    wanted = pick("left-task", *span, ())
    assert wanted is not None
    left = place / "an-earlier-tree"
    left.mkdir()
    os.chown(left, wanted, wanted)
    found = Holders(span, pool_dir, place)
    try:
        _, line = found.take("left-task")
        assert int(line.split()[0]) != wanted, line
        os.chown(left, 0, 0)  # the benign twin: taken back, the uid is clean again
        _, line = found.take("left-task")
        assert int(line.split()[0]) == wanted, line
    finally:
        found.close()


@ROOT_ONLY
def test_a_uid_of_an_account_is_passed_over(
    step_user: StepUser, pool_dir: Path, tmp_path: Path
) -> None:
    pool = UidPool(step_user.uid, step_user.uid, pool_dir)
    with pytest.raises(PoolExhausted):
        pool.take("any")
    assert uidpool.has_account(step_user.uid)


def test_held_passes_a_plain_user_through_and_holds_a_pool_uid(
    span: tuple[int, int], monkeypatch: pytest.MonkeyPatch, pool_dir: Path
) -> None:
    plain = StepUser("alice", 1500, 1500)
    with uidpool.held(plain, "t") as user:
        assert user is plain
    with uidpool.held(None, "t") as user:
        assert user is None
    monkeypatch.setattr(uidpool, "pool_folder", lambda: pool_dir)
    template = StepUser(f"overnight-{span[0]}", span[0], span[0], (), span)
    with uidpool.held(template, "t") as user:
        assert user is not None and user.pool is None and span[0] <= user.uid <= span[1]
        inner = UidPool(user.uid, user.uid, pool_dir)
        with pytest.raises(PoolExhausted):
            inner.take("other")  # held while the block runs
    again = UidPool(user.uid, user.uid, pool_dir).take("other")  # released at the block's end
    assert again.user.uid == user.uid
    again.release()


@ROOT_ONLY
def test_supervise_runs_its_step_as_a_uid_it_holds_for_it(
    env: dict[str, str], span: tuple[int, int]
) -> None:
    first = span[0]
    senv = {k: v for k, v in env.items() if k != "OVERNIGHT_ALLOW_ROOT_STEPS"}
    senv.update(OVERNIGHT_SANDBOX="off", OVERNIGHT_STEP_UIDS=f"{first}-{first}")
    work = Path(tempfile.mkdtemp(dir="/tmp"))
    work.chmod(0o777)

    def supervise() -> subprocess.CompletedProcess[str]:
        argv = [OVERNIGHT, "supervise", "--quiet", "--", "sh", "-c", "id -u; id -g; id -G"]
        return subprocess.run(argv, env=senv, cwd=work, capture_output=True, text=True, timeout=60)

    try:
        ran = supervise()
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.split() == [str(first)] * 3, ran.stdout
        held = UidPool(first, first).take("a task holding it")  # in this host's pool
        try:
            refused = supervise()
        finally:
            held.release()
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.count("\n") == 1 and "no free step uid" in refused.stderr
    finally:
        shutil.rmtree(work, ignore_errors=True)


@ROOT_ONLY
@pytest.mark.parametrize(
    ("owned", "depth", "found"),
    [
        ("a", 1, "a"),  # an entry of the folder itself
        ("d/b", 1, None),  # one level further than looked
        ("d/b", 2, "d/b"),
        ("d/e/c", 2, None),
        ("d/e/c", 3, "d/e/c"),
    ],
)
def test_left_by_looks_depth_levels_down(
    tmp_path: Path, owned: str, depth: int, found: str | None
) -> None:
    uid = 64999
    (tmp_path / "d" / "e").mkdir(parents=True)
    target = tmp_path / owned
    target.write_text("")
    os.chown(target, uid, uid)
    (tmp_path / "link").symlink_to(tmp_path / "d")  # a link is never followed
    hit = uidpool.left_by(uid, ((tmp_path, depth),))
    assert hit == (tmp_path / found if found else None)
    assert uidpool.left_by(uid + 1, ((tmp_path, depth),)) is None  # nobody else's
