"""Tables for the multi-host rules: the host id setting, and when a task's step may be
re-run (no lease of it could still be alive on any host)."""

from __future__ import annotations

import pytest

from overnight.config import validate
from overnight.config.settings import ConfigError, load_settings


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"OVERNIGHT_HOST_ID": "host-a"}, "host-a"),
        ({"OVERNIGHT_HOST_ID": "node1.rack2_b"}, "node1.rack2_b"),
        ({"OVERNIGHT_HOST_ID": ""}, None),  # empty is unset: the host name
        ({}, None),
        ({"OVERNIGHT_HOST_ID": "a b"}, None),  # invalid: the host name here, exit 78 elsewhere
        ({"OVERNIGHT_HOST_ID": "x:y"}, None),
    ],
)
def test_this_host(environ: dict[str, str], expected: str | None) -> None:
    import socket

    assert validate.this_host(environ) == (expected or socket.gethostname())


@pytest.mark.parametrize("bad", ["a b", "-lead", "x:y", "h" * 254, "{slot}"])
def test_a_bad_host_id_names_the_variable(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERNIGHT_HOST_ID", bad)
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert caught.value.variable == "OVERNIGHT_HOST_ID"
    assert validate.read_fast({"OVERNIGHT_HOST_ID": bad}, dotenv=False) is None


def test_the_host_id_setting_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERNIGHT_HOST_ID", "host-b")
    assert load_settings().host_id == "host-b"
