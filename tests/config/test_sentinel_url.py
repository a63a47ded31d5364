"""``redis+sentinel://`` URLs: taken apart, refused with the reason, masked, put back."""

from __future__ import annotations

import pytest

from overnight.config.connection import (
    SentinelUrl,
    is_sentinel,
    mask_sentinel_url,
    parse_sentinel_url,
    sentinel_url,
    wait_replicas,
)
from overnight.config.settings import ConfigError, load_settings
from overnight.config.validate import mask_url, redis_url

S = "redis+sentinel://"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            f"{S}h1:26380,h2:26381/night",
            SentinelUrl(sentinels=(("h1", 26380), ("h2", 26381)), service="night"),
        ),
        (f"{S}h1/night", SentinelUrl(sentinels=(("h1", 26379),), service="night")),
        (
            f"{S}:pw@h1:1,[::1]:2/night?db=3",
            SentinelUrl(sentinels=(("h1", 1), ("::1", 2)), service="night", db=3, password="pw"),
        ),
        (
            f"{S}user:p%40ss@h1:1/night?sentinel_password=s%26p&sentinel_username=watch",
            SentinelUrl(
                sentinels=(("h1", 1),),
                service="night",
                username="user",
                password="p@ss",
                sentinel_username="watch",
                sentinel_password="s&p",
            ),
        ),
        (
            f"{S}user@h1:1/night",
            SentinelUrl(sentinels=(("h1", 1),), service="night", username="user"),
        ),
        ("REDIS+SENTINEL://h1:1/night?db=", SentinelUrl(sentinels=(("h1", 1),), service="night")),
    ],
)
def test_a_sentinel_url_taken_apart(url: str, expected: SentinelUrl) -> None:
    assert is_sentinel(url)
    assert parse_sentinel_url(url) == expected
    assert parse_sentinel_url(sentinel_url(expected)) == expected
    assert redis_url(url) == url


@pytest.mark.parametrize(
    ("url", "words"),
    [
        (f"{S}h1:1", "service name"),
        (f"{S}h1:1/", "service name"),
        (f"{S}h1:1/a/b", "service name"),
        (f"{S}/night", "one or more sentinels"),
        (f"{S}h1:1,,h2:2/night", "one or more sentinels"),
        (f"{S}h1:x/night", "invalid port"),
        (f"{S}h1:70000/night", "invalid port"),
        (f"{S}:5/night", "no host"),
        (f"{S}[::1/night", "IPv6"),
        (f"{S}h1:1/night?db=x", "whole number"),
        (f"{S}h1:1/night?password=x", "unknown query parameter"),
    ],
)
def test_a_bad_sentinel_url_says_what_is_wrong(url: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_sentinel_url(url)


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        (f"{S}:pw@h1:1,h2:2/night", f"{S}:****@h1:1,h2:2/night"),
        (
            f"{S}u:pw@h1:1/night?db=1&sentinel_password=sp",
            f"{S}u:****@h1:1/night?db=1&sentinel_password=****",
        ),
        (f"{S}h1:1/night", f"{S}h1:1/night"),
    ],
)
def test_both_passwords_are_masked(url: str, masked: str) -> None:
    assert mask_sentinel_url(url) == masked == mask_url(url)


def test_a_bad_sentinel_url_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERNIGHT_REDIS_URL", f"{S}h1:1")
    with pytest.raises(ConfigError, match=r"OVERNIGHT_REDIS_URL: .*service name"):
        load_settings()


@pytest.mark.parametrize(
    ("url", "setting", "replicas"),
    [
        (f"{S}h1:1/night", None, 1),
        (f"{S}h1:1/night", "0", 0),
        (f"{S}h1:1/night", "2", 2),
        ("redis://h:1/0", None, 0),
        ("redis://h:1/0", "1", 1),
    ],
)
def test_spends_wait_for_a_replica_by_default_under_sentinel(
    monkeypatch: pytest.MonkeyPatch, url: str, setting: str | None, replicas: int
) -> None:
    monkeypatch.setenv("OVERNIGHT_REDIS_URL", url)
    if setting is None:
        monkeypatch.delenv("OVERNIGHT_REDIS_WAIT_REPLICAS", raising=False)
    else:
        monkeypatch.setenv("OVERNIGHT_REDIS_WAIT_REPLICAS", setting)
    assert wait_replicas(load_settings()) == replicas
