"""The coordinator's functions: seeding the envelope once, submitting task folders."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import redis

from overnight.config.keys import Keys
from overnight.config.settings import load_settings
from overnight.coordinator.night.control import ensure_envelope, submit_folders, task_files
from overnight.worker.envelope.envelope import CallEnvelope
from tests.helpers import ROOT


@pytest.fixture(params=["fake", "real"])
def client(request: pytest.FixtureRequest) -> redis.Redis:
    name = request.param
    return request.getfixturevalue("fake" if name == "fake" else "r")  # type: ignore[no-any-return]


def test_envelope_is_created_once_and_never_refilled(client: redis.Redis, namespace: str) -> None:
    keys = Keys(namespace)
    assert ensure_envelope(client, keys, 5) is True
    envelope = CallEnvelope(client, "default", namespace)
    envelope.try_consume("model")
    envelope.try_consume("tool")
    # A restarted coordinator, or a second one, with a bigger budget: nothing changes.
    assert ensure_envelope(client, keys, 50) is False
    state = envelope.snapshot()
    assert (state.remaining, state.consumed_model, state.consumed_tool) == (3, 1, 1)


def test_an_envelope_reset_by_hand_is_not_replaced(client: redis.Redis, namespace: str) -> None:
    CallEnvelope(client, "default", namespace).reset(0)
    assert ensure_envelope(client, Keys(namespace), 10) is False
    assert CallEnvelope(client, "default", namespace).snapshot().remaining == 0


def test_task_files_skip_hidden_folders(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "a" / "t.toml").write_text("")
    (tmp_path / "b.json").write_text("")
    (tmp_path / ".git" / "x.toml").write_text("")
    (tmp_path / "notes.md").write_text("")
    assert task_files(tmp_path) == [tmp_path / "a" / "t.toml", tmp_path / "b.json"]


def test_submit_folders_enqueues_new_ids_only(
    env: dict[str, str], r: redis.Redis, tmp_path: Path, namespace: str
) -> None:
    shutil.copytree(ROOT / "coordinator" / "examples", tmp_path / "tasks")
    settings = load_settings(queue=namespace)
    rq = redis.Redis.from_url(settings.redis_url)
    first = submit_folders(r, rq, settings, [tmp_path / "tasks"])
    assert first.problems == [] and first.known == []
    ids = sorted(rec.id for rec in first.records)
    assert ids == ["fix-add", "greeting", "hangs-once", "never-done"]
    assert rq.llen(f"rq:queue:{namespace}") == 4
    again = submit_folders(r, rq, settings, [tmp_path / "tasks"])
    assert again.records == [] and sorted(again.known) == ids
    assert rq.llen(f"rq:queue:{namespace}") == 4


def test_one_bad_file_and_nothing_is_submitted(
    env: dict[str, str], r: redis.Redis, tmp_path: Path, namespace: str
) -> None:
    shutil.copytree(ROOT / "coordinator" / "examples", tmp_path / "tasks")
    (tmp_path / "tasks" / "zz-bad.toml").write_text('assignment = "x"\nmax_calls = 0\n')
    settings = load_settings(queue=namespace)
    rq = redis.Redis.from_url(settings.redis_url)
    out = submit_folders(r, rq, settings, [tmp_path / "tasks"])
    assert out.records == [] and out.problems
    assert all("zz-bad.toml" in line for line in out.problems)
    assert rq.llen(f"rq:queue:{namespace}") == 0
    assert r.keys(Keys(namespace).prefix + ":task:*") == []
