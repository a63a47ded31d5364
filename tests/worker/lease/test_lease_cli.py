"""`overnight beat`, `overnight lease show|list`, and the hot commands' settings fast path."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from overnight.config.keys import Keys
from overnight.config.settings import ConfigError, Settings, load_settings
from overnight.config.validate import RULES, QuickSettings, read_fast
from overnight.coordinator.cli.lease import quick_settings
from overnight.worker.lease.store import Leases
from tests.helpers import OVERNIGHT


def run(args: list[str], env: dict[str, str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OVERNIGHT, *args], env=env, capture_output=True, text=True, timeout=30, **kw
    )


@pytest.fixture
def leases(r: redis.Redis, namespace: str) -> Leases:
    return Leases(r, Keys(namespace))


def test_beat_without_a_lease_exits_64(env: dict[str, str]) -> None:
    proc = run(["beat"], env)
    assert proc.returncode == 64 and len(proc.stderr.strip().splitlines()) == 1


def test_beat_renews_and_a_beat_after_the_end_is_refused(
    env: dict[str, str], tmp_path: Path
) -> None:
    saved = tmp_path / "env.json"
    script = (
        f"import json, os, subprocess; json.dump(dict(os.environ), open({str(saved)!r},"
        f" 'w')); raise SystemExit(subprocess.run([{OVERNIGHT!r}, 'beat', '--note', 'hello'],"
        " capture_output=True).returncode)"
    )
    # From tmp_path: the tree a sandboxed step sees (and writes env.json into).
    proc = run(
        ["supervise", "--no-output-beats", "--", sys.executable, "-c", script], env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    child_env = json.loads(saved.read_text())
    # The same channel, once its lease is over: refused for good.
    ended = run(["beat"], {**env, **child_env})
    assert ended.returncode == 2 and "not-running" in ended.stderr
    assert len(ended.stderr.strip().splitlines()) == 1


def test_beat_to_a_supervisor_that_does_not_answer_exits_69(
    env: dict[str, str], tmp_path: Path
) -> None:
    path = str(tmp_path / "s")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as mute:
        mute.bind(path)
        mute.listen(1)  # connects, never answers
        proc = run(["beat"], {**env, "OVERNIGHT_LEASE_ID": "x", "OVERNIGHT_BEAT_SOCKET": path})
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


def test_every_setting_has_a_rule_and_the_fast_defaults_are_the_settings_defaults() -> None:
    assert set(Settings.model_fields) == set(RULES)
    for field in fields(QuickSettings):
        assert Settings.model_fields[field.name].default == field.default


def test_fast_path_reads_what_pydantic_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "OVERNIGHT_REDIS_URL": "redis://u:pw@host.example:6380/2",
        "OVERNIGHT_NAMESPACE": "ns-1",
        "OVERNIGHT_HEARTBEAT_GAP": "2.5",
        "OVERNIGHT_DEADLINE": " 6e2 ",
        "OVERNIGHT_GRACE": "0",
        "OVERNIGHT_LEASE_ID": "x",
        "OVERNIGHT_BUDGET": "3",
        "OVERNIGHT_MODEL_URL": "http://x",
        "OVERNIGHT_QUEUE": "",
        "OVERNIGHT_TASK_SOMETHING": "not a setting",
        "PATH": "/bin",
    }
    fast = read_fast(env, dotenv=False)
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
        fast.redis_url,
        fast.namespace,
        fast.heartbeat_gap,
        fast.deadline,
        fast.grace,
    )


@pytest.mark.parametrize(
    "env",
    [
        {"OVERNIGHT_HEARTBEAT_GAP": "-1"},
        {"OVERNIGHT_HEARTBEAT_GAP": "inf"},
        {"OVERNIGHT_DEADLINE": "0"},
        {"OVERNIGHT_REDIS_URL": "redis://h:99999/0"},
        {"OVERNIGHT_REDIS_URL": "http://h"},
        {"OVERNIGHT_NAMESPACE": "a:b"},
        {"OVERNIGHT_BUDGET": "lots"},
        {"OVERNIGHT_MODEL_URL": "ftp://x"},
        {"overnight_namespace": "lower"},
        {"MODEL_URL": "http://x"},
    ],
)
def test_fast_path_defers_anything_unusual(env: dict[str, str]) -> None:
    assert read_fast(env, dotenv=False) is None


def test_a_dotenv_file_defers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert read_fast({}) is not None
    (tmp_path / ".env").write_text("OVERNIGHT_HEARTBEAT_GAP=abc\n")
    assert read_fast({}) is None


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
    url=st.one_of(
        st.just("redis://127.0.0.1:6379/0"), st.text(max_size=40).map(lambda s: "redis://" + s)
    ),
)
def test_fast_path_and_settings_agree(gap: str, ns: str, url: str) -> None:
    """Same rules both ways: what one accepts the other reads alike, what one refuses the
    other refuses."""
    if "\0" in gap + ns + url:
        return
    env = {"OVERNIGHT_HEARTBEAT_GAP": gap, "OVERNIGHT_NAMESPACE": ns, "OVERNIGHT_REDIS_URL": url}
    fast = read_fast(env, dotenv=False)
    given_ = {
        k: v for k, v in (("redis_url", url), ("namespace", ns), ("heartbeat_gap", gap)) if v != ""
    }
    try:
        s = Settings(**given_)  # type: ignore[arg-type]
    except ValidationError:
        assert fast is None
        return
    assert fast is not None
    assert (s.redis_url, s.namespace, s.heartbeat_gap) == (
        fast.redis_url,
        fast.namespace,
        fast.heartbeat_gap,
    )


def test_the_hot_paths_import_neither_pydantic_nor_redis() -> None:
    """supervise's settings and beat's client: the rules are plain functions (config.validate)."""
    script = (
        "import sys\n"
        "from overnight.coordinator.cli.lease import quick_settings\n"
        "from overnight.worker.beat.channel import NoChannel, send_beat\n"
        "s = quick_settings({'OVERNIGHT_HEARTBEAT_GAP': '2', 'OVERNIGHT_NAMESPACE': 'ns'})\n"
        "assert (s.heartbeat_gap, s.namespace) == (2.0, 'ns'), s\n"
        "try:\n    send_beat(environ={})\nexcept NoChannel:\n    pass\n"
        "print(sorted(m for m in ('pydantic', 'redis') if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=30, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
