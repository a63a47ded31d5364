"""Tasks from a git remote: the rules as tables (URLs, redaction, where a host starts the
task's tree), the submit refusals, the cache and the push against a repository on this
host, and a whole task on one worker against a git server that wants a token (the step
never sees it; overnight's push uses it)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from overnight.coordinator.tasks.taskfile import TaskFileError, load
from overnight.coordinator.workspace import remote
from overnight.coordinator.workspace.plan import (
    Base,
    Start,
    Tips,
    cache_name,
    redact,
    redact_text,
    ref_problem,
    start_of,
    url_problem,
)
from tests import gitserver
from tests.helpers import OVERNIGHT, wait_for

B, H, R = "b" * 40, "h" * 40, "r" * 40


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("https://example.com/a/b.git", True),
        ("https://bot:tok@example.com/a.git", True),
        ("ssh://git@example.com:22/a.git", True),
        ("git@example.com:team/a.git", True),
        ("/srv/git/a.git", True),
        ("file:///srv/git/a.git", True),
        ("git://example.com/a.git", True),
        ("ext::sh -c evil", False),
        ("ext::sh", False),
        ("fd::3", False),
        ("-uhack", False),
        ("https:///nohost", False),
        ("ftp://example.com/a.git", False),
        ("relative/path", False),
        ("https://example.com/a b", False),
        ("", False),
    ],
)
def test_which_urls_name_a_remote(url: str, ok: bool) -> None:
    assert (url_problem(url) is None) is ok


def test_a_refused_url_is_said_without_its_password() -> None:
    problem = url_problem("ftp://bot:s3cret@example.com/a.git")
    assert problem is not None and "s3cret" not in problem and "bot:****@" in problem


@pytest.mark.parametrize(
    ("ref", "ok"),
    [
        ("main", True),
        ("HEAD", True),
        ("refs/heads/feature/x", True),
        ("v1.2", True),
        ("-main", False),
        ("a..b", False),
        ("a//b", False),
        ("main/", False),
        ("a b", False),
    ],
)
def test_which_refs_name_a_base(ref: str, ok: bool) -> None:
    assert (ref_problem(ref) is None) is ok


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://bot:tok@h/a.git", "https://bot:****@h/a.git"),
        ("https://bot@h/a.git", "https://bot@h/a.git"),
        ("https://h/a.git", "https://h/a.git"),
        ("git@h:a.git", "git@h:a.git"),
        ("/srv/a.git", "/srv/a.git"),
    ],
)
def test_redact(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_redact_text_hides_the_url_and_its_password_alone() -> None:
    url = "https://bot:tok3n@h/a.git"
    text = f"fatal: {url} said no; the token tok3n again"
    shown = "fatal: https://bot:****@h/a.git said no; the token **** again"
    assert redact_text(text, [url]) == shown


def test_one_cache_per_remote_whatever_its_credentials() -> None:
    a = cache_name("https://bot:one@h/a.git")
    assert a == cache_name("https://other:two@h/a.git") == cache_name("https://h/a.git/")
    assert a != cache_name("https://h/b.git")


@pytest.mark.parametrize(
    ("tips", "start"),
    [
        # Nothing pushed, nothing recorded: the base.
        (Tips(B, None, None), Start(B)),
        (Tips(B, B, None), Start(B)),
        # A previous host's turns: its tip, whether or not the record has caught up with it.
        (Tips(B, None, R, has_base=True), Start(R)),
        (Tips(B, H, R, has_base=True, has_head=True), Start(R)),
        (Tips(B, R, R, has_base=True, has_head=True), Start(R)),
    ],
)
def test_where_a_host_starts_the_tree(tips: Tips, start: Start) -> None:
    assert start_of(tips, "overnight/t") == start


@pytest.mark.parametrize(
    ("tips", "words"),
    [
        (Tips(B, H, None), "has no overnight/t"),
        (Tips(B, None, R), "does not grow from the base"),
        (Tips(B, H, R, has_base=True), "lacks the task's turn"),
    ],
)
def test_a_branch_someone_else_moved_is_refused(tips: Tips, words: str) -> None:
    got = start_of(tips, "overnight/t")
    assert got.commit is None and got.problem is not None and words in got.problem


# --- submit ---------------------------------------------------------------------------------


def write_task(folder: Path, name: str, **keys: Any) -> Path:
    data = {
        "id": name,
        "assignment": "fix add in calc.py",
        "agent": ["python3", "agent.py", "nowhere"],
        "max_calls": 9,
        "verifier": [{"name": "check", "run": ["python3", "check.py"]}],
        **keys,
    }
    path = folder / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def served(tmp_path: Path) -> Path:
    """A bare repository on this host's file system (the project of tests/gitserver.py)."""
    return gitserver.make_project(tmp_path / "git")


def test_submit_refuses_a_task_naming_workdir_and_repo(served: Path, tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    path = write_task(tmp_path, "both", repo=str(served), workdir="w", workspace="in-place")
    with pytest.raises(TaskFileError) as got:
        load(path, state=tmp_path / "state")
    assert [p.split(": ", 1)[1] for p in got.value.problems] == [
        "workdir: a task names a workdir or a repo, not both",
        'workspace: a task from a repo works on its branch ("worktree")',
    ]


def test_submit_refuses_ref_or_push_to_without_repo(tmp_path: Path, env: dict[str, str]) -> None:
    path = write_task(tmp_path, "norepo", ref="main", push_to="/srv/x.git")
    done = subprocess.run(
        [OVERNIGHT, "submit", str(path)], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 64
    assert done.stderr.splitlines() == [
        f"{path}: ref: needs repo",
        f"{path}: push_to: needs repo",
    ]


def test_submit_refuses_a_ref_the_remote_lacks(served: Path, tmp_path: Path) -> None:
    path = write_task(tmp_path, "noref", repo=str(served), ref="nope")
    with pytest.raises(TaskFileError) as got:
        load(path, state=tmp_path / "state")
    assert got.value.problems == [f"{path}: ref: {served} has no ref 'nope'"]


def test_submit_resolves_the_ref_into_this_hosts_cache(served: Path, tmp_path: Path) -> None:
    spec = load(write_task(tmp_path, "ok", repo=str(served)), state=tmp_path / "state")
    head = gitserver.git(served, "rev-parse", "main").strip()
    assert spec.base is not None
    assert (spec.base.sha, spec.base.ref, spec.workdir) == (head, "refs/heads/main", "")
    cache = remote.cache_path(tmp_path / "state", str(served))
    assert spec.base.root == str(cache)
    assert gitserver.git(cache, "cat-file", "-t", head).strip() == "commit"
    assert "url" not in (cache / "config").read_text()  # the remote is named in no file


def test_submit_refuses_an_id_whose_branch_the_remote_has(served: Path, tmp_path: Path) -> None:
    gitserver.git(served, "branch", "overnight/taken", "main")
    path = write_task(tmp_path, "taken", repo=str(served))
    with pytest.raises(TaskFileError) as got:
        load(path, state=tmp_path / "state")
    assert "branch overnight/taken already exists on" in got.value.problems[0]


# --- the cache and the push, against a repository on this host -------------------------------


def spec_of(served: Path, tmp_path: Path, name: str, state: Path) -> Any:
    return load(write_task(tmp_path, name, repo=str(served)), state=state)


def commit_file(tree: remote.Worktree, name: str, turn: int) -> str:
    from overnight.coordinator.workspace import worktree as ws

    Path(tree.path, name).write_text(f"turn {turn}\n")
    return ws.commit_step(tree, ws.commit_message("t", turn, "done"))


def test_a_second_host_starts_from_the_first_hosts_push_and_a_stale_push_is_refused(
    served: Path, tmp_path: Path
) -> None:
    spec = spec_of(served, tmp_path, "t", tmp_path / "a")
    base: Base = spec.base
    hosts = {}
    for name in ("a", "b"):
        state = tmp_path / name
        hosts[name] = (remote.Remote.of(spec, state), remote.local_base(base, spec, state), state)
    ra, base_a, state_a = hosts["a"]
    tree_a, tip = remote.open_tree(ra, base_a, None, "t", state_a / "wt")
    assert tip is None and gitserver.git(Path(tree_a.path), "rev-parse", "HEAD").strip() == base.sha
    one = commit_file(tree_a, "one.txt", 1)
    remote.push(ra, "t", one, None)
    # Host b has never seen the task: its cache is fetched, its tree starts at a's turn.
    rb, base_b, state_b = hosts["b"]
    tree_b, tip_b = remote.open_tree(rb, base_b, one, "t", state_b / "wt")
    assert tip_b == one and (Path(tree_b.path) / "one.txt").read_text() == "turn 1\n"
    two = commit_file(tree_b, "two.txt", 2)
    remote.push(rb, "t", two, one)
    # Host a still thinks the tip is its own turn: its push is refused, the remote keeps b's.
    late = commit_file(tree_a, "late.txt", 2)
    with pytest.raises(remote.PushRefused):
        remote.push(ra, "t", late, one)
    assert gitserver.git(served, "rev-parse", "overnight/t").strip() == two
    # Reopened, a's tree is made again at the remote's tip (its unpushed commit is not in it).
    tree_a, tip = remote.open_tree(ra, base_a, two, "t", state_a / "wt")
    assert tip == two and not (Path(tree_a.path) / "late.txt").exists()
    # A record the remote's branch no longer holds is refused, not silently dropped.
    gitserver.git(served, "update-ref", "refs/heads/overnight/t", one)
    with pytest.raises(remote.GitError, match="lacks the task's turn"):
        remote.open_tree(ra, base_a, two, "t", state_a / "wt")


# --- one worker, a git server that wants a token ---------------------------------------------


@pytest.fixture
def http_remote(tmp_path: Path) -> Iterator[tuple[Path, str, str]]:
    """The project behind git http-backend on 127.0.0.1 (basic auth): its bare repository,
    the URL with the token, and the token."""
    root = tmp_path / "srv"
    bare = gitserver.make_project(root)
    token = secrets.token_hex(16)
    proc, port = gitserver.start(root, "bot", token)
    try:
        yield bare, f"http://bot:{token}@127.0.0.1:{port}/{bare.name}", token
    finally:
        proc.kill()
        proc.wait(10)


def cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def files_holding(folder: Path, needle: bytes) -> list[str]:
    out = []
    for top, _dirs, names in os.walk(folder):
        for name in names:
            path = Path(top, name)
            if not path.is_symlink() and path.is_file() and needle in path.read_bytes():
                out.append(str(path))
    return out


@pytest.fixture(params=["bwrap", "off-step-user"])
def contained(
    request: pytest.FixtureRequest, env: dict[str, str], tmp_path: Path
) -> Iterator[dict[str, str]]:
    """The worker's environment: steps in the sandbox (the default), or without it as the
    step user (their parents' /proc is then the real worker's and supervisor's)."""
    wenv = {**env, "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"]}
    if request.param == "bwrap":
        yield {**wenv, "OVERNIGHT_STATE_DIR": str(tmp_path / "state")}
        return
    user = request.getfixturevalue("step_user")
    # pytest's tmp folders are root's and 0700: the step user needs a path it can walk.
    top = Path(tempfile.mkdtemp(prefix="overnight-remote-", dir="/tmp"))
    os.chmod(top, 0o755)
    wenv.pop("OVERNIGHT_ALLOW_ROOT_STEPS", None)
    wenv.update(
        OVERNIGHT_SANDBOX="off", OVERNIGHT_STEP_USER=user.name, OVERNIGHT_STATE_DIR=str(top)
    )
    try:
        yield wenv
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_repo_task_on_one_worker_pushes_every_turn_and_its_step_never_sees_the_token(
    http_remote: tuple[Path, str, str], contained: dict[str, str], tmp_path: Path
) -> None:
    bare, url, token = http_remote
    wenv = contained
    assert cli(wenv, "envelope", "reset", "50").returncode == 0
    path = write_task(tmp_path, "rt", repo=url)
    said: list[str] = []
    submitted = cli(wenv, "submit", str(path))
    said += [submitted.stdout, submitted.stderr]
    assert submitted.returncode == 0, submitted.stderr
    worked = cli(wenv, "worker", "--burst")
    said += [worked.stdout, worked.stderr]
    assert worked.returncode == 0, worked.stderr[-3000:]
    shown = cli(wenv, "status", "rt")
    said += [shown.stdout, shown.stderr]
    status = json.loads(shown.stdout)
    assert (status["state"], status["turns"]) == ("finished_verified", 2), status
    assert status["repo"] == f"http://bot:****@{url.split('@', 1)[1]}"
    # The remote's branch has every turn, the last one the record's head.
    log = gitserver.git(bare, "log", "--format=%H %s", "overnight/rt").splitlines()
    subjects = [line.split(" ", 1)[1] for line in log]
    assert [s.split(":")[1].strip() for s in subjects[:2]] == ["task rt turn 2", "task rt turn 1"]
    assert log[0].split()[0] == status["head"]
    # Hostile twin: each turn's step kept what it could see (its environment, its parents'
    # command lines and environments, every process it could look at, its git config) and
    # overnight pushed it: the token is in none of it, nor in overnight's own files.
    address = url.split("@", 1)[1].split("/", 1)[0]
    for turn in (1, 2):
        seen = gitserver.git(bare, "show", f"overnight/rt:seen-{turn}.txt")
        assert "env OVERNIGHT_TASK_ID=rt" in seen and "parent 1 environ" in seen
        assert "git-config file:" in seen  # its repository's config (the cache's) was read
        parents = [x for x in seen.splitlines() if x.startswith("parent ") and "cmdline" in x]
        assert any("overnight" in x for x in parents), parents  # bwrap's, or the supervisor's
        assert token not in seen and address not in seen  # nor even where the remote is
    assert not files_holding(Path(wenv["OVERNIGHT_STATE_DIR"]), token.encode())
    # Benign twin: overnight's pushes went through with the token, which the server wants.
    assert any("git-receive-pack 200" in line for line in gitserver.requests(bare.parent))
    anonymous = subprocess.run(
        ["git", "ls-remote", url.replace(f"bot:{token}@", "")],
        capture_output=True,
        text=True,
        env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
        check=False,
    )
    assert anonymous.returncode != 0
    # The diff reads from any host: here a state folder that never saw the task.
    other = {**wenv, "OVERNIGHT_STATE_DIR": str(tmp_path / "elsewhere")}
    diffed = cli(other, "diff", "rt")
    said += [diffed.stdout, diffed.stderr]
    assert diffed.returncode == 0, diffed.stderr
    assert "+    return a + b" in diffed.stdout and "seen-2.txt" in diffed.stdout
    page = tmp_path / "night.html"
    reported = cli(other, "report", "--html", str(page))
    said += [reported.stdout, reported.stderr]
    assert reported.returncode == 0, reported.stderr
    html = page.read_text()
    assert "return a + b" in html and token not in html
    assert not any(token in text for text in said)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_push_the_remote_refuses_leaves_the_turn_unknown_and_the_task_paused(
    served: Path, env: dict[str, str], tmp_path: Path
) -> None:
    wenv = {
        **env,
        "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"],
        "OVERNIGHT_STATE_DIR": str(tmp_path / "state"),
        "OVERNIGHT_TASK_CLAIM_TTL": "1",
        "OVERNIGHT_RECOVERY_INTERVAL": "0.3",
        "OVERNIGHT_GRACE": "0.5",
    }
    assert cli(wenv, "envelope", "reset", "20").returncode == 0
    # The agent beats until the test writes 'go' into its tree.
    wait = "import os, time\nwhile not os.path.exists('go'): print(1, flush=True); time.sleep(0.1)"
    path = write_task(tmp_path, "moved", repo=str(served), agent=["python3", "-c", wait])
    assert cli(wenv, "submit", str(path)).returncode == 0
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen([OVERNIGHT, "worker"], env=wenv, stdout=log, stderr=log)
    try:
        trees = tmp_path / "state" / "worktrees" / env["OVERNIGHT_NAMESPACE"]
        tree = wait_for(lambda: next(trees.glob("moved-*"), None), timeout=30)
        # Meanwhile "another host" pushed the task's branch: the push overnight makes after
        # the step expects no branch there, and is refused.
        base = gitserver.git(served, "rev-parse", "main").strip()
        gitserver.git(served, "update-ref", "refs/heads/overnight/moved", base)
        (tree / "go").write_text("")

        def paused() -> dict[str, Any] | None:
            shown = cli(wenv, "status", "moved")
            data: dict[str, Any] = json.loads(shown.stdout)
            return data if data["state"] == "paused_for_reconciliation" else None

        status = wait_for(paused, timeout=40, interval=0.2)
    finally:
        worker.terminate()
        worker.wait(20)
        log.close()
    assert "outcome of the agent step of turn 1 is unknown" in status["detail"], status
    assert gitserver.git(served, "rev-parse", "overnight/moved").strip() == base  # not ours
    said = (tmp_path / "worker.log").read_text()
    assert "push of overnight/moved to" in said and "refused: the remote moved it" in said


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_credential_in_the_workers_environment_reaches_git_and_never_the_step(
    http_remote: tuple[Path, str, str], env: dict[str, str], tmp_path: Path
) -> None:
    bare, url, token = http_remote
    plain = url.replace(f"bot:{token}@", "bot@")  # the password comes from GIT_ASKPASS
    askpass = tmp_path / "askpass.sh"
    askpass.write_text(f"#!/bin/sh\necho {token}\n")
    askpass.chmod(0o700)
    wenv = {
        **env,
        "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"],
        "OVERNIGHT_STATE_DIR": str(tmp_path / "state"),
    }
    assert cli(wenv, "envelope", "reset", "50").returncode == 0
    path = write_task(tmp_path, "ask", repo=plain)
    refused = cli(wenv, "submit", str(path))  # without it, git cannot reach the remote
    assert refused.returncode == 64 and refused.stderr.startswith(f"{path}: repo: git ls-remote")
    wenv["GIT_ASKPASS"] = str(askpass)
    submitted = cli(wenv, "submit", str(path))
    assert submitted.returncode == 0, submitted.stderr
    worked = cli(wenv, "worker", "--burst")
    assert worked.returncode == 0, worked.stderr[-3000:]
    status = json.loads(cli(wenv, "status", "ask").stdout)
    assert status["state"] == "finished_verified", status
    assert status["repo"] == plain
    for turn in (1, 2):
        seen = gitserver.git(bare, "show", f"overnight/ask:seen-{turn}.txt")
        assert "env OVERNIGHT_TASK_ID=ask" in seen
        assert token not in seen and "GIT_ASKPASS" not in seen and str(askpass) not in seen


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_repo_task_runs_again_on_its_remote_branch_and_its_worktree_is_pruned(
    served: Path, env: dict[str, str], tmp_path: Path
) -> None:
    wenv = {
        **env,
        "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"],
        "OVERNIGHT_STATE_DIR": str(tmp_path / "state"),
    }
    assert cli(wenv, "envelope", "reset", "50").returncode == 0
    assert cli(wenv, "submit", str(write_task(tmp_path, "again", repo=str(served)))).returncode == 0
    assert cli(wenv, "worker", "--burst").returncode == 0
    first = json.loads(cli(wenv, "status", "again").stdout)
    assert (first["state"], first["turns"]) == ("finished_verified", 2)
    refused = cli(wenv, "rerun", "again", "--from-base")
    assert refused.returncode != 0 and "is from a repo" in refused.stderr
    # Another host's state folder: the rerun's tree is made there from the remote's branch.
    other = {**wenv, "OVERNIGHT_STATE_DIR": str(tmp_path / "other")}
    assert cli(other, "rerun", "again").returncode == 0, "rerun"
    assert cli(other, "worker", "--burst").returncode == 0
    second = json.loads(cli(other, "status", "again").stdout)
    assert (second["state"], second["turns"]) == ("finished_verified", 3), second
    log = gitserver.git(served, "log", "--format=%s", "overnight/again").splitlines()
    assert [s.split("turn ")[1].split(":")[0] for s in log[:3]] == ["3", "2", "1"]
    assert gitserver.git(served, "rev-parse", "overnight/again").strip() == second["head"]
    pruned = cli(other, "worktrees", "prune")
    assert pruned.returncode == 0 and "again: removed" in pruned.stdout, pruned.stdout
