"""Bad input, property-based: task files, environment values, CLI arguments, corrupt records.

Each gives its documented exit code and one clear line; none gives a traceback, enqueues
part of a batch, or changes another record. In-process properties run many examples;
the few that need a subprocess run a handful.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overnight.config import context
from overnight.config.keys import Keys
from overnight.coordinator.tasks.taskfile import TaskFileError, load, load_all
from overnight.worker.envelope.envelope import CallEnvelope
from overnight.worker.lease.store import Leases
from tests.helpers import OVERNIGHT

PY = sys.executable
FIXTURES = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
# Text that can live in an environment variable or argv (no NUL, no lone surrogates).
SAFE_TEXT = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
NASTY = st.sampled_from(
    [
        "",
        " ",
        "-1",
        "-",
        "--",
        "0",
        "nan",
        "inf",
        "1e309",
        "*",
        ":",
        "a:b",
        "{x}",
        "}{",
        "a*b",
        "; touch pwned",
        "$(touch pwned)",
        "`id`",
        "|",
        "&&",
        "\n",
        "a\nb",
        "é",
        "日本",
        "🦀",
        "x" * 70,
        "y" * 5000,
        "../../etc/passwd",
        "%s%n",
        "\\",
        "'",
        '"',
    ]
)
ARGS = NASTY | st.text(SAFE_TEXT, max_size=40)


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``overnight ARGS`` in this process, with fresh settings and clients each time."""
    from overnight.coordinator.cli.main import main

    context.settings.cache_clear()
    context.redis_client.cache_clear()
    context.rq_connection.cache_clear()
    capsys.readouterr()
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def one_line(text: str) -> bool:
    return len(text.strip().splitlines()) == 1 and "Traceback" not in text


@pytest.fixture(autouse=True)
def _fresh_context() -> Iterator[None]:
    yield
    context.settings.cache_clear()
    context.redis_client.cache_clear()
    context.rq_connection.cache_clear()


# --- task files ----------------------------------------------------------------------------

KEYS = [
    "id",
    "assignment",
    "workdir",
    "agent",
    "max_calls",
    "lease_seconds",
    "heartbeat_gap",
    "deadline",
    "envelope",
    "on_unknown",
    "verifier",
    "colour",
    "ID",
    "é",
]
scalars = (
    st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(SAFE_TEXT, max_size=30)
    | st.sampled_from(["x" * 60_000, ".", "..", "nope"])
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["name", "run", "x"]), inner, max_size=3)
    ),
    max_leaves=6,
)
good_rule = st.fixed_dictionaries(
    {
        "name": st.text(SAFE_TEXT, min_size=1, max_size=10),
        "run": st.lists(st.text(SAFE_TEXT, min_size=1), min_size=1, max_size=3),
    }
)
task_dicts = st.one_of(
    st.dictionaries(st.sampled_from(KEYS), values, max_size=8),
    st.fixed_dictionaries(
        {
            "assignment": st.text(SAFE_TEXT, min_size=1, max_size=50),
            "verifier": st.lists(good_rule, min_size=1, max_size=2),
        },
        optional={k: values for k in KEYS if k not in ("assignment", "verifier")},
    ),
)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return (
            "nan"
            if math.isnan(value)
            else ("inf" if value > 0 else "-inf")
            if math.isinf(value)
            else repr(value)
        )
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def write_task(path: Path, data: dict[str, Any]) -> None:
    if path.suffix == ".json":
        path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    else:
        lines = [f"{json.dumps(k)} = {toml_value(v)}" for k, v in data.items()]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")  # huge strings
@settings(max_examples=120, deadline=None, suppress_health_check=FIXTURES)
@given(
    batch=st.lists(
        st.tuples(task_dicts, st.sampled_from([".toml", ".json"])), min_size=1, max_size=3
    )
)
def test_task_file_batches_load_whole_or_name_every_problem(
    tmp_path: Path, batch: list[tuple[dict[str, Any], str]]
) -> None:
    paths = []
    for i, (data, suffix) in enumerate(batch):
        path = tmp_path / f"task-{i}{suffix}"
        write_task(path, data)
        paths.append(path)
    bad = set()
    for path in paths:
        try:
            load(path)
        except TaskFileError:
            bad.add(path)
    try:
        specs = load_all(paths)
    except TaskFileError as exc:
        assert exc.problems
        for line in exc.problems:
            assert "\n" not in line and any(line.startswith(f"{p}: ") for p in paths), line
        named = {p for p in paths if any(line.startswith(f"{p}: ") for line in exc.problems)}
        assert bad <= named
    else:
        assert not bad and len(specs) == len(paths)
        assert all(spec.verifier and spec.max_calls >= 1 for spec in specs)


GOOD = 'assignment = "a"\n[[verifier]]\nname = "ok"\nrun = ["true"]\n'
BAD_FILES = [
    'assignment = "a"\ncolour = "blue"\n[[verifier]]\nname = "ok"\nrun = ["true"]\n',
    'assignment = "a"\nmax_calls = "ten"\n[[verifier]]\nname = "ok"\nrun = ["true"]\n',
    'assignment = "a"\nworkdir = "missing"\n[[verifier]]\nname = "ok"\nrun = ["true"]\n',
    'assignment = "a"\nagent = "rm -rf /"\n[[verifier]]\nname = "ok"\nrun = ["true"]\n',
    "assignment = \n",
    '{"assignment": "a", "verifier": [{"name": "ok", "run": []}]}',
    'assignment = "\U0001f980"\n[[verifier]]\nname = "ok"\nrun = ["true"]\nid = "a:b*"\n',
]


@pytest.mark.timeout(120)
@settings(max_examples=5, deadline=None, suppress_health_check=FIXTURES)
@given(bad=st.sampled_from(BAD_FILES), goods=st.integers(1, 3), at=st.integers(0, 3))
def test_submit_with_one_bad_file_enqueues_nothing(
    env: dict[str, str], r: redis.Redis, tmp_path: Path, bad: str, goods: int, at: int
) -> None:
    queue = f"q-{env['OVERNIGHT_NAMESPACE']}"
    folder = tmp_path / f"batch-{goods}-{at}-{abs(hash(bad))}"
    folder.mkdir(exist_ok=True)
    paths = []
    for i in range(goods):
        path = folder / f"good-{i}.toml"
        path.write_text(GOOD)
        paths.append(path)
    bad_path = folder / ("bad.json" if bad.startswith("{") else "bad.toml")
    bad_path.write_text(bad)
    paths.insert(min(at, len(paths)), bad_path)
    proc = subprocess.run(
        [OVERNIGHT, "submit", *map(str, paths)],
        env={**env, "OVERNIGHT_QUEUE": queue},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 64, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines and all(line.startswith(f"{bad_path}: ") for line in lines), lines
    assert r.llen(f"rq:queue:{queue}") == 0
    ns = Keys(env["OVERNIGHT_NAMESPACE"])
    assert r.zcard(ns.tasks) == 0 and not r.keys(ns.prefix + ":task:*")


# --- environment values --------------------------------------------------------------------

SETTINGS_VARS = [
    "OVERNIGHT_REDIS_URL",
    "OVERNIGHT_NAMESPACE",
    "OVERNIGHT_QUEUE",
    "OVERNIGHT_HEARTBEAT_GAP",
    "OVERNIGHT_DEADLINE",
    "OVERNIGHT_GRACE",
    "OVERNIGHT_BUDGET",
    "OVERNIGHT_MODEL_URL",
    "MODEL_URL",
    "OVERNIGHT_MODEL_API_KEY",
    "OVERNIGHT_MODEL_NAME",
    "OVERNIGHT_MODEL_TIMEOUT",
    "OVERNIGHT_REQUEST_ID_TTL",
    "OVERNIGHT_REAPER_INTERVAL",
    "OVERNIGHT_REAPER_HOST_TTL",
    "OVERNIGHT_MAX_LOST_LEASES",
    "OVERNIGHT_TASK_CLAIM_TTL",
    "OVERNIGHT_RECOVERY_INTERVAL",
    "OVERNIGHT_STEP_USER",
    "OVERNIGHT_ALLOW_ROOT_STEPS",
    "OVERNIGHT_STEP_UIDS",
    "OVERNIGHT_ANTHROPIC_URL",
    "OVERNIGHT_ANTHROPIC_API_KEY",
    "OVERNIGHT_ANTHROPIC_MODEL",
    "OVERNIGHT_GATEWAY_HOST",
    "OVERNIGHT_GATEWAY_PORT",
    "OVERNIGHT_GATEWAY_URL",
    "OVERNIGHT_STOP_AT",
    "OVERNIGHT_METRICS_PORT",
    "OVERNIGHT_NOTIFY_URL",
    "OVERNIGHT_RETENTION",
    "OVERNIGHT_STATE_DIR",
    "OVERNIGHT_HOST_ID",
    "OVERNIGHT_ALLOW_PASSWORDLESS_REDIS",
    "OVERNIGHT_REDIS_WAIT_REPLICAS",
    "OVERNIGHT_REDIS_WAIT_TIMEOUT",
    "OVERNIGHT_GATEWAY_MAX_OUTPUT",
    "OVERNIGHT_SANDBOX",
    "OVERNIGHT_STEP_PIDS",
    "OVERNIGHT_STEP_MEMORY",
    "OVERNIGHT_STEP_OPEN_FILES",
    "OVERNIGHT_STEP_CPU",
    "OVERNIGHT_STEP_DISK",
]
ENV_VALUES = (
    NASTY
    | st.text(SAFE_TEXT, max_size=30)
    | st.sampled_from(
        [
            "1",
            "30",
            "-0",
            "0.0",
            "1e3",
            "1_000",
            " 5 ",
            "redis://",
            "redis://:pw@h:99999/0",
            "rediss://u:p@h/x",
            "unix://",
            "http://x",
            "https://model.example/v1",
            "true",
            "61184-65519",
            "9-8",
            "off",
        ]
    )
)


def test_every_setting_is_covered() -> None:
    from overnight.config.settings import Settings, env_name

    named = {env_name(f).split(" ")[0] for f in Settings.model_fields}
    assert named == set(SETTINGS_VARS) - {"MODEL_URL"}


@settings(max_examples=300, deadline=None, suppress_health_check=FIXTURES)
@given(var=st.sampled_from(SETTINGS_VARS), value=ENV_VALUES)
def test_any_environment_value_is_exit_0_or_one_line_78(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    var: str,
    value: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    with monkeypatch.context() as m:
        for key in SETTINGS_VARS:
            m.delenv(key, raising=False)
        m.setenv(var, value)
        code, out, err = run_cli(["config"], capsys)
    assert code in (0, 78), (code, err)
    if code == 78:
        assert out == "" and one_line(err) and var.removeprefix("OVERNIGHT_") in err, err
    else:
        assert err == "" and json.loads(out)
    if var == "OVERNIGHT_MODEL_API_KEY" and code == 0:
        masked = json.loads(out)["model_api_key"]
        assert masked == ("********" if value else None), out


@pytest.mark.timeout(60)
@settings(max_examples=8, deadline=None, suppress_health_check=FIXTURES)
@given(
    var=st.sampled_from(
        [
            "OVERNIGHT_REDIS_URL",
            "OVERNIGHT_HEARTBEAT_GAP",
            "OVERNIGHT_GRACE",
            "OVERNIGHT_NAMESPACE",
            "OVERNIGHT_DEADLINE",
        ]
    ),
    value=NASTY.filter(lambda v: v.strip() not in ("", "0") and "\n" not in v),
)
def test_supervise_fast_path_gives_the_same_one_line_78(
    tmp_path: Path, var: str, value: str
) -> None:
    from overnight.config.settings import ConfigError, load_settings

    try:
        load_settings(**{var.removeprefix("OVERNIGHT_").lower(): value})
        valid = True
    except ConfigError:
        valid = False
    clean = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OVERNIGHT_")}
    if valid:
        return  # a valid value would try to reach Redis; covered elsewhere
    proc = subprocess.run(
        [OVERNIGHT, "supervise", "--", "true"],
        env={**clean, var: value},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 78 and one_line(proc.stderr) and var in proc.stderr, proc.stderr


# --- CLI arguments -------------------------------------------------------------------------

COMMANDS = [
    lambda a: ["lease", "show", a],
    lambda a: ["envelope", "status", "--name", a],
    lambda a: ["envelope", "consume", "model", "--name", a],
    lambda a: ["envelope", "consume", "tool", "--request-id", a],
    lambda a: ["envelope", "reset", a],
    lambda a: ["status", a],
    lambda a: ["reconcile", a, "--abort"],
    lambda a: ["reconcile", a, "--resume"],
    lambda a: ["receipts", a],
]


@settings(max_examples=250, deadline=None, suppress_health_check=FIXTURES)
@given(which=st.integers(0, len(COMMANDS) - 1), arg=ARGS)
def test_hostile_arguments_get_a_documented_code_and_one_line(
    env: dict[str, str], r: redis.Redis, capsys: pytest.CaptureFixture[str], which: int, arg: str
) -> None:
    ns = Keys(env["OVERNIGHT_NAMESPACE"])
    before = sorted(r.keys(ns.prefix + ":*"))
    argv = COMMANDS[which](arg)
    code, out, err = run_cli(argv, capsys)
    assert "Traceback" not in out + err and "internal error" not in err, (argv, err)
    if arg in ("-h", "--help"):
        assert code == 0 and "Usage:" in out, (argv, code, err)  # a help flag is help
    elif argv[:2] == ["envelope", "consume"] and code == 0:
        assert json.loads(out)["remaining"] >= 0  # an earlier example reset this namespace
    elif argv[:2] == ["envelope", "consume"] and code == 2:
        assert one_line(out) and json.loads(out)["remaining"] == 0
        # A never-created envelope adds one hint line on stderr; a spent one says nothing.
        assert err == "" or (one_line(err) and "does not exist" in err), err
    elif argv[:2] == ["envelope", "status"]:
        # 2: the envelope the hostile name picks was never created (it says so in one line).
        assert code in (0, 64) or (code == 2 and "does not exist" in err), (argv, code, err)
    elif argv[0] == "receipts" or argv == ["status", "--"]:
        assert code in (0, 64), (argv, code, err)
    elif argv[:2] == ["envelope", "reset"] and code == 0:
        assert int(arg) >= 0
    else:
        assert code == 64, (argv, code, out, err)
    if code != 0:
        assert one_line(err or out), (argv, err)
    after = sorted(r.keys(ns.prefix + ":*"))
    if argv[:2] != ["envelope", "reset"]:
        # Only its own receipts and the remembered answer of its own request id may appear.
        own = (":receipts", ":envelope:default:req:")
        assert [k for k in after if not any(o in k for o in own)] == [
            k for k in before if not any(o in k for o in own)
        ]


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["envelope", "reset", str(2**53)], 0),
        (["envelope", "reset", str(2**53 + 1)], 64),
        (["envelope", "reset", "5", "--tokens", str(2**60)], 64),
    ],
)
def test_an_envelope_count_past_2_53_is_refused_in_one_line(
    env: dict[str, str], capsys: pytest.CaptureFixture[str], args: list[str], code: int
) -> None:
    got, out, err = run_cli(args, capsys)
    assert got == code, (got, out, err)
    if code:
        assert one_line(err) and "between" in err and "internal error" not in err, err
    else:
        assert json.loads(out)["remaining"] == 2**53


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lease_id", ["", "a:b", "{x}", "*", "; touch pwned", "é", "x" * 65, "-1"])
def test_supervise_refuses_a_hostile_lease_id(
    env: dict[str, str], tmp_path: Path, lease_id: str
) -> None:
    proc = subprocess.run(
        [OVERNIGHT, "supervise", "--lease-id", lease_id, "--", "true"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 64 and one_line(proc.stderr), proc.stderr
    assert not list(tmp_path.iterdir())


# --- corrupt records -----------------------------------------------------------------------

LEASE_FIELDS = [
    "lease_id",
    "token",
    "budget_sec",
    "started_unix",
    "deadline_unix",
    "heartbeat_unix",
    "heartbeat_max_gap_sec",
    "status",
    "holder_pid",
    "exit_code",
    "child_start_ticks",
    "note",
]
corruptions = st.dictionaries(
    st.sampled_from(LEASE_FIELDS),
    st.none() | st.sampled_from(["", "abc", "nan", "inf", "-1", "1e400", "{", "é", "zombie"]),
    min_size=1,
    max_size=4,
)


@pytest.fixture
def good_records(env: dict[str, str], r: redis.Redis) -> dict[str, Any]:
    """A live lease, an envelope and a finished task that corrupt neighbours must not touch."""
    ns = Keys(env["OVERNIGHT_NAMESPACE"])
    lease = Leases(r, ns).acquire(budget_sec=600, gap_sec=600, lease_id="good")
    CallEnvelope(r, "good", ns.namespace).reset(7)
    r.hset(
        ns.task("good"),
        mapping={
            "id": "good",
            "state": "finished_verified",
            "run": "r1",
            "spec": json.dumps({"assignment": "a", "verifier": [{"name": "ok", "run": ["true"]}]}),
            "checkpoint": "{}",
            "submitted_unix": "1",
        },
    )
    r.zadd(ns.tasks, {"good": 1})
    return {"lease": lease, "keys": ns}


def snapshot(r: redis.Redis, ns: Keys) -> dict[str, Any]:
    return {
        "lease": r.hgetall(ns.lease("good")),
        "alive": r.get(ns.lease_alive("good")),
        "envelope": r.hgetall(ns.envelope("good")),
        "task": r.hgetall(ns.task("good")),
    }


def _no_trace(code: int, out: str, err: str, allowed: tuple[int, ...]) -> None:
    assert code in allowed, (code, out, err)
    assert "Traceback" not in out + err and "internal error" not in err, err
    if code != 0:
        assert one_line(err or out), err


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURES)
@given(
    broken=corruptions,
    envelope_value=st.sampled_from(
        [
            {"remaining": "abc"},
            {"remaining": "5", "consumed_model": "x"},
            {"remaining": "1.5"},
            {"budget": "{"},
            "string",
            ["l", "i", "s", "t"],
        ]
    ),
    task_field=st.sampled_from(
        ["spec", "checkpoint", "runner", "id", "calls_used", "submitted_unix"]
    ),
)
def test_corrupt_records_are_one_line_or_skipped_and_touch_nothing_else(
    env: dict[str, str],
    r: redis.Redis,
    good_records: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    broken: dict[str, str | None],
    envelope_value: Any,
    task_field: str,
) -> None:
    ns: Keys = good_records["keys"]
    base = Leases(r, ns).acquire(budget_sec=600, gap_sec=600)
    key = ns.lease(base.lease_id)
    for name, value in broken.items():
        if value is None:
            r.hdel(key, name)
        else:
            r.hset(key, name, value)
    env_key = ns.envelope("bad")
    r.delete(env_key)
    if isinstance(envelope_value, dict):
        r.hset(env_key, mapping={"remaining": "3", **envelope_value})
    elif isinstance(envelope_value, list):
        r.rpush(env_key, *envelope_value)
    else:
        r.set(env_key, envelope_value)
    task_key = ns.task("bad")
    r.delete(task_key)
    r.hset(task_key, mapping={"id": "bad", "state": "running", "spec": "{}", "run": "r"})
    if task_field == "id":
        r.hdel(task_key, "id")
    else:
        r.hset(task_key, task_field, "{not json")
    r.zadd(ns.tasks, {"bad": 2})
    before = snapshot(r, ns)
    raw_env_before = r.dump(env_key)

    _no_trace(*run_cli(["lease", "show", base.lease_id], capsys), allowed=(0, 64))
    code, out, _ = run_cli(["lease", "list", "--json"], capsys)
    assert code == 0 and "good" in [json.loads(line)["lease_id"] for line in out.splitlines()]
    _no_trace(*run_cli(["envelope", "status", "--name", "bad"], capsys), allowed=(2,))
    code, out, err = run_cli(["envelope", "consume", "model", "--name", "bad"], capsys)
    assert code == 2 and one_line(out) and "corrupt" in json.loads(out)["error"], out + err
    assert r.dump(env_key) == raw_env_before  # refused before anything was written
    _no_trace(*run_cli(["status", "bad"], capsys), allowed=(0, 64))
    code, out, err = run_cli(["status"], capsys)
    assert code == 0 and "good" in [t["id"] for t in json.loads(out)], err
    code, out, err = run_cli(["report"], capsys)
    assert code == 0 and "good" in out and "Traceback" not in err
    assert snapshot(r, ns) == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field", ["token", "deadline_unix", "holder_pid", "status"])
def test_reaper_once_skips_a_corrupt_lapsed_lease(
    env: dict[str, str], r: redis.Redis, good_records: dict[str, Any], field: str
) -> None:
    ns: Keys = good_records["keys"]
    lapsed = Leases(r, ns).acquire(budget_sec=600, gap_sec=0.05)
    r.delete(ns.lease_alive(lapsed.lease_id))
    r.hset(ns.lease(lapsed.lease_id), field, "garbage")
    before = snapshot(r, ns)
    proc = subprocess.run(
        [OVERNIGHT, "reaper", "--once"], env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert r.hget(ns.lease(lapsed.lease_id), field) == "garbage"
    assert snapshot(r, ns) == before


# --- commands are argv lists: no shell ever reads a task's strings -----------------------


@pytest.mark.timeout(90)
def test_no_shell_interprets_a_tasks_strings(env: dict[str, str], tmp_path: Path) -> None:
    tenv = {**env, "OVERNIGHT_QUEUE": env["OVERNIGHT_NAMESPACE"], "OVERNIGHT_GRACE": "0.5"}
    work = tmp_path / "work"
    work.mkdir()
    pwned = [tmp_path / f"pwned{i}" for i in range(6)]
    task = {
        "id": "shelly",
        "assignment": f"$(touch {pwned[0]}) `touch {pwned[1]}`; touch {pwned[2]} | cat",
        "workdir": "work",
        "agent": ["echo", "{prompt}", f"; touch {pwned[3]}", f"&& touch {pwned[4]}"],
        "max_calls": 2,
        "verifier": [{"name": "no-shell", "run": ["test", "-e", f"x; touch {pwned[5]}"]}],
    }
    path = tmp_path / "shelly.json"
    path.write_text(json.dumps(task))

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [OVERNIGHT, *args], env=tenv, capture_output=True, text=True, timeout=60
        )

    assert run("envelope", "reset", "10").returncode == 0
    assert run("submit", str(path)).returncode == 0
    proc = run("worker", "--burst")
    assert proc.returncode == 0, proc.stderr[-2000:]
    status = json.loads(run("status", "shelly").stdout)
    assert status["state"] == "halted_at_call_ceiling" and status["calls_used"] == 2
    assert not [p for p in pwned if p.exists()]
    assert not list(work.iterdir())
