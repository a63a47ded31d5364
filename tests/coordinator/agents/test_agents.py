"""Agent presets, the framework: task files naming a preset, the step a preset launches (its
argv, variables and scratch-HOME files), the reader's account kept with the turn, and a
preset whose CLI is missing ending the task before any call is charged."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from overnight.config.keys import Keys
from overnight.coordinator import agents
from overnight.coordinator.tasks.loop import LoopConfig, TaskLoop
from overnight.coordinator.tasks.steps import plain_runner
from overnight.coordinator.tasks.store import Runner, TaskStore
from overnight.coordinator.tasks.taskfile import TaskFileError, TaskSpec, load
from overnight.worker.redisio import receipts
from overnight.worker.sandbox import stepenv
from tests.helpers import Budget

# The fake CLI: writes what it was given where the verifier looks, and prints a JSON line
# (its "structured output") saying whether it thinks it succeeded.
FAKE_CLI = """
import json, os, sys
cfg = open(os.path.join(os.environ["HOME"], ".fake", "config.toml")).read()
mode = oct(os.stat(os.path.join(os.environ["HOME"], ".fake", "config.toml")).st_mode & 0o777)
with open("seen.json", "w") as fh:
    json.dump({"argv": sys.argv[1:], "cfg": cfg, "mode": mode,
               "flavour": os.environ.get("FAKE_FLAVOUR")}, fh)
print(json.dumps({"type": "result", "ok": sys.argv[-1] != "fail", "text": "did it\\nall"}))
"""


class FakeReader(agents.JsonLinesReader):
    def __init__(self) -> None:
        self.result: dict[str, Any] | None = None

    def take(self, obj: dict[str, Any]) -> None:
        if obj.get("type") == "result":
            self.result = obj

    def said(self) -> agents.Said | None:
        if self.result is None:
            return None
        return agents.Said(bool(self.result["ok"]), agents.one_line(self.result["text"]))


def fake_launch(ctx: agents.Context) -> agents.Launch:
    return agents.Launch(
        argv=["fake-cli", "--model", ctx.model, ctx.prompt_file, ctx.prompt.split()[-1]],
        env={"FAKE_FLAVOUR": "mild"},
        home_files={".fake/config.toml": f'model = "{ctx.model}"\n'},
    )


@pytest.fixture
def fake_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cli = bin_dir / "fake-cli"
    cli.write_text(f"#!{sys.executable}\n{FAKE_CLI}")
    cli.chmod(0o755)
    preset = agents.Preset(
        name="fake",
        program="fake-cli",
        wire="anthropic",
        install="pip install fake-cli",
        launch=fake_launch,
        reader=FakeReader,
    )
    monkeypatch.setitem(agents.MODULES, "fake", "fake")
    monkeypatch.setitem(agents.PRESETS, "fake", preset)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    yield bin_dir


def task(tmp_path: Path, **kw: Any) -> TaskSpec:
    data: dict[str, Any] = {
        "assignment": "use the fake agent, then succeed",
        "workdir": str(tmp_path),
        "agent": "fake",
        "max_calls": 10,
        "verifier": [{"name": "saw", "run": ["test", "-f", "seen.json"]}],
        **kw,
    }
    return TaskSpec.model_validate(data)


def run(
    r: redis.Redis,
    namespace: str,
    tmp_path: Path,
    spec: TaskSpec,
    gateway: str | None = "http://127.0.0.1:9",
) -> TaskStore:
    store = TaskStore(r, Keys(namespace))
    [rec] = store.create([spec], queue="q")
    # The plain runner gives steps no gateway token; a preset still needs one configured.
    config = LoopConfig(
        claim_ttl=5,
        prompt_dir=tmp_path / "prompts",
        gateway_url=gateway,
        preset_models={"openai": "gpt-x", "anthropic": "claude-x"},
    )
    TaskLoop(store, plain_runner, Budget(100), config).run(rec.id, rec.attempt, Runner(worker="t"))
    return store


def test_task_file_takes_a_preset_name_or_a_command(tmp_path: Path) -> None:
    assert task(tmp_path, agent="codex").agent == "codex"
    assert task(tmp_path, agent="codex").command() == "codex"
    assert task(tmp_path, agent=["my-agent", "{prompt}"]).command() == "my-agent"
    assert task(tmp_path, agent=None).command() == "the built-in model step"
    assert task(tmp_path, agent="claude", model="claude-haiku-4-5").model == "claude-haiku-4-5"


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("agent", '"cursor"', "'cursor' is not a preset (one of 'aider', 'claude', 'codex'"),
        ("agent", '""', "agent"),
        ("model", '""', "model"),
        ("model", '"a\\nb"', "model: must be non-blank text on one line"),
    ],
)
def test_a_bad_preset_or_model_is_one_line(
    tmp_path: Path, key: str, value: str, problem: str
) -> None:
    path = tmp_path / "t.toml"
    path.write_text(
        f'assignment = "x"\n{key} = {value}\n[[verifier]]\nname = "t"\nrun = ["true"]\n'
    )
    with pytest.raises(TaskFileError) as info:
        load(path, state=tmp_path / "state")
    assert len(info.value.problems) == 1
    assert problem in info.value.problems[0]


def test_every_preset_is_registered_by_its_module() -> None:
    assert agents.names() == ["aider", "claude", "codex", "mini-swe-agent"]
    for name in agents.names():
        preset = agents.get(name)
        assert preset is not None and preset.name == name
        ctx = agents.Context("fix it", "/tmp/p.txt", "m1", "/w", 1, "http://127.0.0.1:4680")
        launch = preset.launch(ctx)
        assert launch.argv[0] == preset.program
        # A preset never hands the step a real credential: only the gateway's token.
        assert not {"OPENAI_API_KEY", "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"} & set(launch.env)
        assert all(not p.startswith("/") and ".." not in p.split("/") for p in launch.home_files)
    assert agents.get("nope") is None


def test_home_files_are_private_and_stay_inside(tmp_path: Path) -> None:
    home = stepenv.make_home("lease-x", None, {".codex/config.toml": "a = 1\n", "b.txt": "b"})
    try:
        cfg = Path(home, ".codex", "config.toml")
        assert cfg.read_text() == "a = 1\n"
        assert stat.S_IMODE(cfg.stat().st_mode) == 0o600
        assert stat.S_IMODE(cfg.parent.stat().st_mode) == 0o700
        assert Path(home, "b.txt").read_text() == "b"
    finally:
        stepenv.remove_home(home)
    for bad in ("../x", "/etc/passwd", "a/../../x", "a//b", "./a"):
        with pytest.raises(ValueError, match="plain relative path"):
            stepenv.make_home("lease-y", None, {bad: "x"})


def test_a_preset_step_gets_its_argv_env_and_files_and_its_account_is_kept(
    r: redis.Redis, namespace: str, tmp_path: Path, fake_preset: Path
) -> None:
    store = run(r, namespace, tmp_path, task(tmp_path))
    [rec] = store.all()
    assert rec.state == "finished_verified"
    seen = json.loads((tmp_path / "seen.json").read_text())
    # The wire's default model, the prompt file, and the prompt's last word.
    assert seen["argv"][:2] == ["--model", "claude-x"]
    assert Path(seen["argv"][2]).read_text().startswith("Assignment:\nuse the fake agent")
    assert seen["argv"][3] == "succeed"
    assert (seen["cfg"], seen["mode"], seen["flavour"]) == ('model = "claude-x"\n', "0o600", "mild")
    finished = [
        rc
        for rc in receipts.read(r, Keys(namespace), task_id=rec.id)
        if rc.kind == "step_finished" and rc.data["step"] == "agent"
    ]
    assert [(rc.data["agent_said"], rc.data["agent_ok"]) for rc in finished] == [
        ("did it all", True)
    ]


def test_a_task_model_overrides_and_a_reported_failure_is_said(
    r: redis.Redis, namespace: str, tmp_path: Path, fake_preset: Path
) -> None:
    spec = task(tmp_path, assignment="this one should fail", model="other-model")
    store = run(r, namespace, tmp_path, spec)
    [rec] = store.all()
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["argv"][:2] == ["--model", "other-model"]
    # The CLI exited 0 but said it failed: the turn says so; the verifier still decides.
    assert rec.state == "finished_verified"
    [step] = [s for s in rec.checkpoint.steps if s.name == "agent"]
    assert step.exit_code == 0
    assert step.ending == "turn 1 agent reported a failure: did it all"


def test_a_preset_whose_cli_is_missing_fails_before_any_call(
    r: redis.Redis, namespace: str, tmp_path: Path, fake_preset: Path
) -> None:
    (fake_preset / "fake-cli").unlink()
    store = run(r, namespace, tmp_path, task(tmp_path))
    [rec] = store.all()
    assert rec.state == "agent_failed"
    assert rec.calls_used == 0
    assert "the fake preset needs 'fake-cli' on PATH" in rec.detail
    assert "install: pip install fake-cli" in rec.detail


def test_a_preset_without_a_gateway_fails_before_any_call(
    r: redis.Redis, namespace: str, tmp_path: Path, fake_preset: Path
) -> None:
    store = run(r, namespace, tmp_path, task(tmp_path), gateway=None)
    [rec] = store.all()
    assert (rec.state, rec.calls_used) == ("agent_failed", 0)
    assert "only through the gateway, and none is configured" in rec.detail


def test_overnight_agents_lists_every_preset_and_what_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from overnight.coordinator.cli.agents import agents_command

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_codex = bin_dir / "codex"
    fake_codex.write_text('#!/bin/sh\necho "codex-cli 9.9.9 (HOME=$HOME)"\n')
    fake_codex.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    listed = CliRunner().invoke(agents_command, ["--json"])
    assert listed.exit_code == 0, listed.output
    rows = {row["name"]: row for row in json.loads(listed.output)}
    assert sorted(rows) == ["aider", "claude", "codex", "mini-swe-agent"]
    assert rows["codex"]["installed"] is True and rows["codex"]["path"] == str(fake_codex)
    assert rows["codex"]["version"].startswith("codex-cli 9.9.9 (HOME=/tmp")  # not the user's
    for name in ("aider", "claude", "mini-swe-agent"):
        assert (rows[name]["installed"], rows[name]["path"]) == (False, None)
        assert rows[name]["install"]
    plain = CliRunner().invoke(agents_command, [])
    assert plain.exit_code == 0
    lines = plain.output.splitlines()
    assert any(line.startswith("codex ") and "codex-cli 9.9.9" in line for line in lines)
    assert any(line.startswith("claude ") and "not installed" in line for line in lines)
    assert sum("install: " in line for line in lines) == 3
