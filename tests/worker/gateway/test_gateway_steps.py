"""A step and the gateway: a model at work is progress for its lease, a refused call ends
the step, and its token dies with its lease. Real processes: the gateway, the scripted
upstream and the supervised step."""

from __future__ import annotations

import sys
import textwrap
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.gateway.grant import Grant
from overnight.worker.lease.store import Leases
from overnight.worker.redisio.receipts import read
from overnight.worker.supervise.supervisor import StepSpec, SupervisedResult, run_supervised
from tests.helpers import free_port, run_gateway, wait_for

# A silent agent: asks the model (through whatever its environment points at) and prints
# nothing; with ``loop`` it retries like a client library would, then waits.
AGENT = textwrap.dedent("""
    import json, os, sys, time, urllib.request, urllib.error
    model, times = sys.argv[1], int(sys.argv[2])
    for _ in range(times):
        req = urllib.request.Request(
            os.environ["OPENAI_BASE_URL"] + "/chat/completions",
            data=json.dumps({"model": model, "messages": []}).encode(),
            headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                     "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30).read()
        except urllib.error.HTTPError as exc:
            open(sys.argv[3], "a").write(f"{exc.code}\\n")
    time.sleep(float(sys.argv[4]))
""")


@pytest.fixture
def gateway(env: dict[str, str], upstream: str, tmp_path: Path) -> Iterator[str]:
    with run_gateway(
        {**env, "OVERNIGHT_MODEL_URL": upstream, "OVERNIGHT_MODEL_TIMEOUT": "10"}, tmp_path
    ) as url:
        yield url


def _run(r: redis.Redis, namespace: str, spec: StepSpec) -> SupervisedResult:
    return run_supervised(r, Keys(namespace), spec, on_output=lambda _line: None)


def test_a_model_at_work_keeps_a_silent_step_alive(
    r: redis.Redis, namespace: str, gateway: str, tmp_path: Path
) -> None:
    CallEnvelope(r, "default", namespace).reset(10)
    errors = tmp_path / "errors"
    argv = [sys.executable, "-c", AGENT, "m-slow2.5", "1", str(errors), "0"]
    # The upstream takes 2.5 s; the step prints nothing; its gap is 1 s.
    done = _run(r, namespace, StepSpec(argv, gap=1.0, deadline=30, grant=Grant(gateway)))
    assert (done.doc.status, done.exit_code) == ("done", 0), done.reason
    assert not errors.exists()
    # The control: the same silence without a model at work is a gap.
    silent = [sys.executable, "-c", "import time; time.sleep(2.5)"]
    killed = _run(r, namespace, StepSpec(silent, gap=1.0, deadline=30, grant=Grant(gateway)))
    assert killed.reason.startswith("heartbeat-gap")


def test_a_refused_call_ends_the_step_and_retries_burn_nothing(
    r: redis.Redis, namespace: str, gateway: str, tmp_path: Path
) -> None:
    env = CallEnvelope(r, "default", namespace)
    env.reset(2)
    errors = tmp_path / "errors"
    argv = [sys.executable, "-c", AGENT, "m", "20", str(errors), "60"]
    ended = _run(r, namespace, StepSpec(argv, gap=30, deadline=60, grant=Grant(gateway)))
    assert ended.exit_code == 2 and ended.reason.startswith("call-refused: envelope default")
    assert ended.seconds < 30  # ended by the refusal, not by its gap or deadline
    assert errors.read_text().split() == ["429"] * 18
    state = env.snapshot()
    assert (state.consumed_model, state.remaining) == (2, 0)
    kinds = [rc.kind for rc in read(r, Keys(namespace))]
    assert kinds.count("call_refused") == 1 and kinds.count("model_call") == 2


def test_the_token_dies_with_its_lease(
    r: redis.Redis, namespace: str, gateway: str, tmp_path: Path
) -> None:
    CallEnvelope(r, "default", namespace).reset(10)
    saved = tmp_path / "token"
    code = f"import os; open({str(saved)!r}, 'w').write(os.environ['OPENAI_API_KEY'])"
    argv = [sys.executable, "-c", code]
    assert (
        _run(r, namespace, StepSpec(argv, gap=5, deadline=30, grant=Grant(gateway))).exit_code == 0
    )
    token = saved.read_text()
    assert token.startswith("ovn-")
    # Anything still holding the ended step's token gets the format's 401.
    req = urllib.request.Request(
        f"{gateway}/v1/chat/completions", data=b"{}", headers={"Authorization": f"Bearer {token}"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code == 401
    refused.value.close()
    assert CallEnvelope(r, "default", namespace).snapshot().consumed_model == 0


def test_a_step_waits_for_a_gateway_still_starting_and_says_why_when_none_comes(
    r: redis.Redis, namespace: str, env: dict[str, str], upstream: str, tmp_path: Path
) -> None:
    CallEnvelope(r, "default", namespace).reset(10)
    port = free_port()
    errors = tmp_path / "errors"
    argv = [sys.executable, "-c", AGENT, "m", "1", str(errors), "0"]
    grant = Grant(f"http://127.0.0.1:{port}")
    # Nothing ever listens there: the step is not started, and its own output says why.
    said: list[bytes] = []
    refused = run_supervised(
        r, Keys(namespace), StepSpec(argv, gap=2, deadline=30, grant=grant), said.append
    )
    assert refused.exit_code == 126, refused.reason
    assert any(b"the gateway cannot be trusted: nothing listens" in line for line in said), said
    # The twin: the gateway starts while the step waits for it (its lease already held): the
    # step runs, and its call is metered.
    results: list[SupervisedResult] = []
    spec = StepSpec(argv, gap=30, deadline=60, grant=grant)
    step = threading.Thread(target=lambda: results.append(_run(r, namespace, spec)))
    step.start()
    try:
        leases = Leases(r, Keys(namespace))
        wait_for(lambda: len(leases.recent()) == 2, timeout=30, interval=0.02)
        assert not results  # still waiting when the gateway starts
        gateway_env = {**env, "OVERNIGHT_MODEL_URL": upstream, "OVERNIGHT_MODEL_TIMEOUT": "10"}
        with run_gateway(gateway_env, tmp_path, port=port):
            step.join(60)
    finally:
        step.join(60)
    assert [(d.exit_code, d.doc.status) for d in results] == [(0, "done")], results
    assert not errors.exists()
    assert CallEnvelope(r, "default", namespace).snapshot().consumed_model == 1
