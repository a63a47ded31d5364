"""A task from a git remote across hosts (tests/hosts.py): two hosts in network namespaces,
each with its own state folder (no worktree folder shared), a git server (git http-backend
behind tests/gitserver.py, basic auth) in a namespace of its own. The task starts on host
A, host A is killed in the middle of its second turn, host B resumes it from A's last
pushed turn and finishes it verified; the remote's branch has every turn."""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest

from overnight.config.keys import Keys
from tests import gitserver
from tests.helpers import lacking, wait_for
from tests.hosts import Cluster, cluster, namespaces_refused

pytestmark = pytest.mark.slow

REFUSED = namespaces_refused()


def task(c: Cluster, task_id: str) -> dict[str, Any]:
    raw: dict[str, str] = c.client.hgetall(Keys(c.namespace).task(task_id))  # type: ignore[assignment]
    return raw


def in_flight(c: Cluster, task_id: str) -> dict[str, Any] | None:
    cp = json.loads(task(c, task_id).get("checkpoint") or "{}")
    flight: dict[str, Any] | None = cp.get("in_flight")
    return flight


def running_leases(c: Cluster, host_id: str) -> list[dict[str, str]]:
    keys = Keys(c.namespace)
    docs = [c.client.hgetall(keys.lease(i)) for i in c.client.zrange(keys.leases, 0, -1)]
    return [d for d in docs if d.get("host") == host_id and d.get("status") == "running"]  # type: ignore[union-attr]


def remote_tip(bare: Path, branch: str) -> str | None:
    done = subprocess.run(
        ["git", "rev-parse", "--verify", "-q", branch],
        cwd=bare,
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or None


@pytest.mark.timeout(240)
def test_a_repo_task_started_on_a_killed_host_is_finished_on_another_from_its_pushed_turns(
    tmp_path: Path,
) -> None:
    if REFUSED:
        lacking(REFUSED)
    coord_state = {"OVERNIGHT_STATE_DIR": str(tmp_path / "state-coord")}
    with cluster(tmp_path, 2, extra_env=coord_state) as c:
        a, b = c.hosts
        for host, name in ((a, "state-A"), (b, "state-B")):
            host.extra_env["OVERNIGHT_STATE_DIR"] = str(tmp_path / name)
        netns, addr = c.service("git")
        root = tmp_path / "srv"
        bare = gitserver.make_project(root)
        token = secrets.token_hex(16)
        server, port = gitserver.start(
            root, "bot", token, prefix=["ip", "netns", "exec", netns], host=addr
        )
        try:
            url = f"http://bot:{token}@{addr}:{port}/{bare.name}"
            path = tmp_path / "far.json"
            path.write_text(
                json.dumps(
                    {
                        "id": "far",
                        "assignment": "fix add in calc.py",
                        "repo": url,
                        # Slow (beating until killed) from turn 2 where the tree is host A's.
                        "agent": ["python3", "agent.py", "state-A"],
                        "on_unknown": "retry",
                        "heartbeat_gap": 2,
                        "max_calls": 20,
                        "verifier": [{"name": "check", "run": ["python3", "check.py"]}],
                    }
                )
            )
            assert c.coordinator("envelope", "reset", "100").returncode == 0
            c.start_worker(a, reaper=True)
            wait_for(lambda: c.reaper_up(a), timeout=30)
            submitted = c.coordinator("submit", str(path))
            assert submitted.returncode == 0, submitted.stderr
            # Host A pushed turn 1 and is in the middle of turn 2's agent step.
            wait_for(lambda: remote_tip(bare, "overnight/far"), timeout=60, interval=0.1)
            first = remote_tip(bare, "overnight/far")

            def a_in_turn_2() -> bool:
                flight = in_flight(c, "far")
                return bool(
                    flight
                    and (flight["turn"], flight["step"]) == (2, 0)
                    and running_leases(c, a.host_id)
                )

            wait_for(a_in_turn_2, timeout=60, interval=0.1)
            c.kill_host(a)
            assert not c.pids(a.netns)
            assert remote_tip(bare, "overnight/far") == first  # A's turn 2 never got out
            c.start_worker(b, reaper=True)
            wait_for(lambda: task(c, "far").get("state") == "finished_verified", timeout=90)
            shown = c.coordinator("status", "far")
            assert shown.returncode == 0, shown.stderr
            status = json.loads(shown.stdout)
            assert status["runner"]["host"] == b.host_id
            # The remote's branch has every turn: A's first, then B's, on top of the base.
            log = subprocess.run(
                ["git", "log", "--format=%H %P %s", "overnight/far"],
                cwd=bare,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.splitlines()
            turns = [line.split("turn ")[1].split(":")[0] for line in log if "overnight:" in line]
            assert turns == [str(t) for t in range(status["turns"], 0, -1)], log
            assert log[0].split()[0] == status["head"]
            assert any(line.split()[0] == first for line in log)
            # Each host worked in its own state folder, from its own cache.
            assert list((tmp_path / "state-A" / "repos").glob("*/HEAD"))
            assert list((tmp_path / "state-B" / "worktrees").glob("*/far-*"))
            # The diff from the coordinator's namespace (a third state folder).
            diffed = c.coordinator("diff", "far")
            assert diffed.returncode == 0, diffed.stderr
            assert "+    return a + b" in diffed.stdout
            assert token not in shown.stdout + diffed.stdout + diffed.stderr
            assert token not in a.log_text() + b.log_text()
            print(
                f"\nremote figure: turns {status['turns']}, calls {status['calls_used']}, "
                f"requests to the git server {len(gitserver.requests(root))}"
            )
        finally:
            server.kill()
            server.wait(10)
