"""How each host contains steps, as recorded for status and the report: the words (a
table) and the record on a real Redis."""

from __future__ import annotations

import pytest
import redis

from overnight.config.keys import Keys
from overnight.worker.sandbox import modes


@pytest.mark.parametrize(
    ("hosts", "line", "warned"),
    [
        ({}, "sandbox: unknown (no worker has recorded one)", []),
        ({"a": "bwrap"}, "sandbox: bwrap (host a)", []),
        ({"b": "bwrap", "a": "bwrap"}, "sandbox: bwrap (hosts a, b)", []),
        ({"a": "off"}, "sandbox: off (host a)", ["a"]),
        (
            {"a": "bwrap", "b": "off", "c": "off"},
            "sandbox: off on b; off on c; bwrap on a",
            ["b, c"],
        ),
    ],
)
def test_the_words(hosts: dict[str, str], line: str, warned: list[str]) -> None:
    assert modes.line(hosts) == line
    said = modes.notices(hosts)
    assert len(said) == len(warned)
    for text, where in zip(said, warned, strict=True):
        assert text.startswith(f"a sandbox on {where} (OVERNIGHT_SANDBOX=off)")


def test_the_record_is_per_host_and_kept_for_the_retention(r: redis.Redis, namespace: str) -> None:
    keys = Keys(namespace)
    assert modes.read(r, keys) == {}
    modes.record(r, keys, "b", "off", 3600)
    modes.record(r, keys, "a", "bwrap", 3600)
    modes.record(r, keys, "b", "bwrap", 7200)  # that host's latest worker start wins
    assert modes.read(r, keys) == {"a": "bwrap", "b": "bwrap"}
    assert 3600 < r.ttl(keys.sandbox_modes) <= 7200
