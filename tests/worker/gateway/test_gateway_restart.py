"""A plain `overnight worker` watches the gateway it started: when it dies the worker starts it
again (after a bounded backoff, one log line naming host and exit code) and the next step's
requests go through it, metered as before."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator.dispatch.gateway_watch import GatewayWatch, restart_delay
from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.redisio.receipts import read
from tests.helpers import OVERNIGHT, cli, pid_alive, task_file, wait_for, worker_env

# One chat request through the gateway the step's environment names; ok.txt only if answered.
AGENT = textwrap.dedent("""
    import json, os, urllib.request
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "m", "messages": []}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                 "Content-Type": "application/json"})
    body = json.loads(urllib.request.urlopen(req, timeout=30).read())
    print("answered", body["usage"], flush=True)
    open("ok.txt", "w").write("ok")
""")


@pytest.mark.parametrize(
    ("quick_exits", "delay"),
    [(0, 0.5), (1, 0.5), (2, 1.0), (3, 2.0), (6, 16.0), (7, 30.0), (8, 30.0), (10**6, 30.0)],
)
def test_restart_delay_doubles_up_to_its_cap(quick_exits: int, delay: float) -> None:
    assert restart_delay(quick_exits) == delay


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "600"])


def test_watch_restarts_its_gateway_and_stop_ends_it(caplog: pytest.LogCaptureFixture) -> None:
    watch = GatewayWatch("h1 (127.0.0.1:1)", lambda wait: False, spawn=_sleeper, poll=0.02)
    watch.start()
    first = watch.proc
    assert first is not None
    try:
        first.kill()
        wait_for(lambda: watch.restarts == 1, timeout=30)
        second = watch.proc
        assert second is not None and second.pid != first.pid and second.poll() is None
        (line,) = [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()]
        assert line.startswith("gateway on h1 (127.0.0.1:1) exited (code -9); restarted as pid")
    finally:
        watch.stop()
    assert second.returncode is not None  # stopped, and not started again
    assert watch.restarts == 1


def test_watch_leaves_the_port_to_a_gateway_that_answers_meanwhile(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answering = iter([False, True])  # the first start's wait, then the restart's check
    watch = GatewayWatch("h1 (x)", lambda wait: next(answering), spawn=_sleeper, poll=0.02)
    watch.start()
    assert watch.proc is not None
    watch.proc.kill()
    wait_for(lambda: watch.proc is None, timeout=30)
    assert watch.restarts == 0
    assert any("another gateway answers" in r.getMessage() for r in caplog.records)
    watch.stop()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _gateway_children(parent: int) -> list[int]:
    """Live children of ``parent`` running ``overnight gateway``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"gateway" in argv and pid_alive(int(entry)):
            found.append(int(entry))
    return found


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_worker_restarts_a_killed_gateway_and_the_next_step_is_metered(
    env: dict[str, str], upstream: str, tmp_path: Path, r: redis.Redis, namespace: str
) -> None:
    wenv = worker_env(env, OVERNIGHT_MODEL_URL=upstream)
    port = int(wenv["OVERNIGHT_GATEWAY_PORT"])
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [OVERNIGHT, "worker"],
            env=wenv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        (first,) = wait_for(lambda: _gateway_children(worker.pid), timeout=60, interval=0.1)
        wait_for(lambda: _answers(port), timeout=60, interval=0.1)
        os.kill(first, signal.SIGKILL)
        (second,) = wait_for(
            lambda: [p for p in _gateway_children(worker.pid) if p != first],
            timeout=60,
            interval=0.1,
        )
        wait_for(lambda: _answers(port), timeout=60, interval=0.1)
        said = log_path.read_text()
        assert f"exited (code -{signal.SIGKILL}); restarted as pid {second}" in said, said

        CallEnvelope(r, "default", namespace).reset(10)
        tree = tmp_path / "after"  # the task's tree: all a sandboxed step sees of the host
        tree.mkdir()
        (tree / "agent.py").write_text(AGENT)
        agent = [sys.executable, str(tree / "agent.py")]
        path = task_file(tmp_path, "after", agent, [["test", "-f", "ok.txt"]], workspace="in-place")
        submitted = cli(wenv, "submit", "--wait", str(path))
        assert submitted.returncode == 0, submitted.stderr + log_path.read_text()[-3000:]
        status = json.loads(cli(wenv, "status", "after", timeout=60).stdout)
        assert status["state"] == "finished_verified", status
        assert status["calls_used"] == 1 + 1  # the agent's one model request, one rule run
        calls = [rc for rc in read(r, Keys(namespace)) if rc.kind == "model_call"]
        assert [(rc.task_id, rc.data["tokens"]) for rc in calls] == [("after", 11 + 7)]
        state = CallEnvelope(r, "default", namespace).snapshot()
        assert (state.consumed_model, state.consumed_tokens) == (1, 11 + 7)
    finally:
        worker.terminate()
        worker.wait(60)
    assert wait_for(lambda: not pid_alive(second))  # the worker ended the gateway it restarted


def _two_at_once(wenv: dict[str, str], logs: list[Path]) -> None:
    """Start two gateways of one namespace together; exactly one stays and serves both its
    port and its socket; stop it."""
    from overnight.config.runtime import gateway_socket
    from overnight.worker.gateway.grant import reach_problem

    port = int(wenv["OVERNIGHT_GATEWAY_PORT"])
    socket_path = gateway_socket(wenv["OVERNIGHT_NAMESPACE"])
    procs = []
    for log_path in logs:
        with open(log_path, "wb") as log:
            procs.append(subprocess.Popen([OVERNIGHT, "gateway"], env=wenv, stderr=log, stdout=log))
    try:
        (loser,) = wait_for(lambda: [p for p in procs if p.poll() is not None], timeout=60)
        said = logs[procs.index(loser)].read_text()
        assert loser.returncode != 0 and "another gateway of this namespace runs here" in said
        kept = logs[1 - procs.index(loser)]
        wait_for(lambda: "listening on" in kept.read_text(), timeout=60)
        # The one left serves both: a step of either kind is sent a token.
        assert reach_problem(f"http://127.0.0.1:{port}") is None
        assert reach_problem(f"http://127.0.0.1:{port}", str(socket_path)) is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(30)
    # Stopped, it removes its socket and lets go of its lock: the next start is afresh.
    assert not socket_path.exists()


@pytest.mark.slow
def test_of_two_gateways_started_at_once_one_serves_both_port_and_socket(
    env: dict[str, str], upstream: str, tmp_path: Path
) -> None:
    wenv = worker_env(env, OVERNIGHT_MODEL_URL=upstream)
    for round_ in range(3):  # the race had several outcomes: try it more than once
        _two_at_once(wenv, [tmp_path / f"gw-{round_}-{i}.log" for i in (0, 1)])
