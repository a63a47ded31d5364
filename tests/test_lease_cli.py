"""`overnight beat`, `overnight lease show|list`, and the hot commands' settings fast path."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from overnight.config.keys import Keys
from overnight.config.settings import ConfigError, Settings, load_settings
from overnight.worker.cli_lease import SETTINGS_FIELDS, QuickSettings, _fast, quick_settings
from overnight.worker.lease import Leases
from tests.helpers import OVERNIGHT


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([OVERNIGHT, *args], env=env, capture_output=True, text=True,
                          timeout=30)  # fmt: skip


@pytest.fixture
def leases(r: redis.Redis, namespace: str) -> Leases:
    return Leases(r, Keys(namespace))


def test_beat_without_a_lease_exits_64(env: dict[str, str]) -> None:
    proc = run(["beat"], env)
    assert proc.returncode == 64 and len(proc.stderr.strip().splitlines()) == 1


def test_beat_renews_refuses_stale_and_ended(env: dict[str, str], leases: Leases) -> None:
    doc = leases.acquire(budget_sec=60, gap_sec=5)
    mine = {**env, "OVERNIGHT_LEASE_ID": doc.lease_id, "OVERNIGHT_LEASE_TOKEN": str(doc.token)}
    proc = run(["beat", "--note", "hello"], mine)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""
    after = leases.get(doc.lease_id)
    assert after is not None and after.note == "hello"
    stale = run(["beat"], {**mine, "OVERNIGHT_LEASE_TOKEN": str(doc.token - 1)})
    assert stale.returncode == 2 and "stale-token" in stale.stderr
    assert len(stale.stderr.strip().splitlines()) == 1
    leases.end(doc.lease_id, doc.token, "done", "worker-complete")
    ended = run(["beat"], mine)
    assert ended.returncode == 2 and "not-running:done" in ended.stderr


def test_beat_with_redis_down_exits_69(env: dict[str, str]) -> None:
    from overnight.coordinator.embedded_redis import free_port

    down = {**env, "OVERNIGHT_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
            "OVERNIGHT_LEASE_ID": "x", "OVERNIGHT_LEASE_TOKEN": "1"}  # fmt: skip
    proc = run(["beat"], down)
    assert proc.returncode == 69 and len(proc.stderr.strip().splitlines()) == 1


def test_lease_show(env: dict[str, str], leases: Leases) -> None:
    doc = leases.acquire(budget_sec=60, gap_sec=5)
    proc = run(["lease", "show", doc.lease_id], env)
    assert proc.returncode == 0
    assert proc.stdout.startswith('{\n  "lease_id"')
    assert json.loads(proc.stdout) == doc.public()
    for bad in ("missing", "a:b", ""):
        proc = run(["lease", "show", bad], env)
        assert proc.returncode == 64 and len(proc.stderr.strip().splitlines()) == 1


def test_lease_show_of_a_corrupt_record(
    env: dict[str, str], r: redis.Redis, namespace: str
) -> None:
    r.hset(Keys(namespace).lease("broken"), mapping={"lease_id": "broken", "token": "x"})
    proc = run(["lease", "show", "broken"], env)
    assert proc.returncode == 64 and "Traceback" not in proc.stderr


def test_lease_list(env: dict[str, str], leases: Leases) -> None:
    a = leases.acquire(budget_sec=60, gap_sec=5)
    b = leases.acquire(budget_sec=60, gap_sec=5)
    leases.end(b.lease_id, b.token, "killed", "worker-exit-3 with spaces", exit_code=3)
    lines = run(["lease", "list"], env).stdout.splitlines()
    assert len(lines) == 2
    rows = {line.split(" ")[0]: line.split(" ", 5) for line in lines}
    assert rows[a.lease_id][1] == "running" and rows[b.lease_id][1] == "killed"
    assert rows[b.lease_id][5] == "worker-exit-3 with spaces"
    docs = [json.loads(x) for x in run(["lease", "list", "--json"], env).stdout.splitlines()]
    assert {d["lease_id"] for d in docs} == {a.lease_id, b.lease_id}
    only = run(["lease", "list", "--status", "running"], env).stdout.splitlines()
    assert [x.split()[0] for x in only] == [a.lease_id]
    assert run(["lease", "list", "--limit", "0"], env).returncode == 64


# --- the settings fast path -------------------------------------------------------------


def test_settings_fields_are_in_step_with_settings() -> None:
    assert set(Settings.model_fields) == SETTINGS_FIELDS


def test_fast_path_reads_what_pydantic_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"OVERNIGHT_REDIS_URL": "redis://u:pw@host.example:6380/2",
           "OVERNIGHT_NAMESPACE": "ns-1", "OVERNIGHT_HEARTBEAT_GAP": "2.5",
           "OVERNIGHT_DEADLINE": "600", "OVERNIGHT_GRACE": "0", "OVERNIGHT_LEASE_ID": "x",
           "OVERNIGHT_TASK_SOMETHING": "not a setting", "PATH": "/bin"}  # fmt: skip
    fast = _fast(env)
    assert fast == QuickSettings("redis://u:pw@host.example:6380/2", "ns-1", 2.5, 600.0, 0.0)
    _same_as_pydantic(monkeypatch, env, fast)


def _same_as_pydantic(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], fast: QuickSettings
) -> None:
    for key in list(__import__("os").environ):
        if key.upper().startswith("OVERNIGHT_") or key.upper() == "MODEL_URL":
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s = load_settings()
    assert (s.redis_url, s.namespace, s.heartbeat_gap, s.deadline, s.grace) == (
        fast.redis_url, fast.namespace, fast.heartbeat_gap, fast.deadline, fast.grace)  # fmt: skip


@pytest.mark.parametrize(
    "env",
    [
        {"OVERNIGHT_HEARTBEAT_GAP": "-1"},
        {"OVERNIGHT_HEARTBEAT_GAP": "1e3"},
        {"OVERNIGHT_DEADLINE": "0"},
        {"OVERNIGHT_REDIS_URL": "redis://h:99999/0"},
        {"OVERNIGHT_REDIS_URL": "http://h"},
        {"OVERNIGHT_NAMESPACE": "a:b"},
        {"overnight_namespace": "lower"},
        {"OVERNIGHT_MODEL_URL": "http://x"},
        {"MODEL_URL": "http://x"},
        {"OVERNIGHT_BUDGET": "3"},
    ],
)
def test_fast_path_defers_anything_unusual(env: dict[str, str]) -> None:
    assert _fast(env) is None


def test_a_dotenv_file_defers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert _fast({}) is not None
    (tmp_path / ".env").write_text("OVERNIGHT_HEARTBEAT_GAP=abc\n")
    assert _fast({}) is None


def test_quick_settings_reports_bad_values_like_the_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from overnight.config import context

    context.settings.cache_clear()
    monkeypatch.setenv("OVERNIGHT_HEARTBEAT_GAP", "-2")
    try:
        with pytest.raises(ConfigError, match="OVERNIGHT_HEARTBEAT_GAP"):
            quick_settings()
    finally:
        context.settings.cache_clear()


@settings(max_examples=200, deadline=None)
@given(
    gap=st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(str), st.text(max_size=12)),
    ns=st.text(max_size=70),
    url=st.one_of(st.just("redis://127.0.0.1:6379/0"), st.text(max_size=40).map(
        lambda s: "redis://" + s)),
)  # fmt: skip
def test_fast_path_only_accepts_what_pydantic_accepts(gap: str, ns: str, url: str) -> None:
    env = {"OVERNIGHT_HEARTBEAT_GAP": gap, "OVERNIGHT_NAMESPACE": ns, "OVERNIGHT_REDIS_URL": url}
    fast = _fast(env)
    if fast is None or "\0" in gap + ns + url:
        return
    s = Settings(redis_url=url, namespace=ns, heartbeat_gap=gap)  # type: ignore[arg-type]
    assert (s.redis_url, s.namespace, s.heartbeat_gap) == (
        fast.redis_url, fast.namespace, fast.heartbeat_gap)  # fmt: skip
