"""Task file validation: every bad input is a TaskFileError with lines naming file and key."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overnight.coordinator.tasks.taskfile import TaskFileError, TaskSpec, load, load_all

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
    "extra",
    "",
]
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.dictionaries(st.sampled_from(KEYS), values, max_size=8))
def test_any_json_either_loads_or_names_its_problems(
    tmp_path: Path, data: dict[str, object]
) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    try:
        spec = load(path)
    except TaskFileError as exc:
        assert exc.problems
        assert all(line.startswith(f"{path}: ") and line.count(": ") >= 2 for line in exc.problems)
    else:
        assert isinstance(spec, TaskSpec) and spec.verifier and spec.max_calls >= 1


def test_minimal_file_gets_defaults(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text('assignment = "a"\n[[verifier]]\nname = "v"\nrun = ["true"]\n')
    spec = load(path)
    assert spec.id is None and spec.agent is None and spec.envelope == "default"
    assert spec.on_unknown == "pause" and spec.max_calls == 20
    assert spec.workdir == str(tmp_path)


def test_bad_syntax_unreadable_and_bad_ids(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("assignment = \n")
    odd = tmp_path / "odd.toml"
    odd.write_text(
        'id = "a:b*"\nassignment = "x"\non_unknown = "maybe"\nenvelope = "no/slash"\n'
        'agent = ["", "x"]\n[[verifier]]\nname = "v"\nrun = ["ok\\u0000"]\n'
    )
    missing = tmp_path / "missing.toml"
    try:
        load_all([broken, odd, missing])
    except TaskFileError as exc:
        text = "\n".join(exc.problems)
    else:
        raise AssertionError("accepted")
    assert f"{broken}: (file): not valid TOML" in text
    assert f"{missing}: (file): cannot read" in text
    for key in ("id", "on_unknown", "envelope", "agent", "verifier[0].run"):
        assert f"{odd}: {key}: " in text, key


def test_duplicate_ids_in_one_batch(tmp_path: Path) -> None:
    body = 'id = "same"\nassignment = "a"\n[[verifier]]\nname = "v"\nrun = ["true"]\n'
    (tmp_path / "a.toml").write_text(body)
    (tmp_path / "b.toml").write_text(body)
    try:
        load_all([tmp_path / "a.toml", tmp_path / "b.toml"])
    except TaskFileError as exc:
        assert len(exc.problems) == 1 and "b.toml: id:" in exc.problems[0]
    else:
        raise AssertionError("accepted")
