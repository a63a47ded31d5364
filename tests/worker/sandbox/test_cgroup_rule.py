"""When a step gets a cgroup: always without the sandbox (where the host allows one), and
a sandboxed step only where its group would hold its limits (its pid namespace already
ends its tree as a whole)."""

from __future__ import annotations

from pathlib import Path

import pytest

from overnight.worker.sandbox import cgroup


@pytest.mark.parametrize(
    ("subtree_control", "holds"),
    [
        (None, False),  # no folder for the namespace yet
        ("", False),
        ("cpu io", False),
        ("pids", True),
        ("cpu memory", True),
        ("memory pids", True),
    ],
)
def test_holds_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, subtree_control: str | None, holds: bool
) -> None:
    monkeypatch.setattr(cgroup, "cgroup2_mount", lambda: tmp_path)
    if subtree_control is not None:
        folder = tmp_path / "overnight" / "ns"
        folder.mkdir(parents=True)
        (folder / "cgroup.subtree_control").write_text(subtree_control + "\n")
    assert cgroup.holds_limits("ns") is holds


def test_no_cgroup_v2_holds_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroup, "cgroup2_mount", lambda: None)
    assert cgroup.holds_limits("ns") is False
