"""coordinator/text.py: control and bidi characters from task files never reach a terminal."""

from __future__ import annotations

import pytest

from overnight.coordinator.report.text import printable

CASES = [
    ("plain ascii", "plain ascii"),
    ("naïve ünïcode ✓ 日本", "naïve ünïcode ✓ 日本"),
    ("\x1b", "\\x1b"),
    ("\x1b[31mred\x1b[0m", "\\x1b[31mred\\x1b[0m"),
    ("\x1b[2J\x1b[H", "\\x1b[2J\\x1b[H"),
    ("\x1b]0;title\x07", "\\x1b]0;title\\x07"),
    ("\x9b31m", "\\x9b31m"),  # the 8-bit CSI
    ("a\rb", "a\\x0db"),
    ("bell\x07", "bell\\x07"),
    ("tab\there", "tab\\x09here"),
    ("del\x7f", "del\\x7f"),
    ("nul\x00", "nul\\x00"),
    ("abc\u202edcba", "abc\\u202edcba"),
    ("\u2066isolate\u2069", "\\u2066isolate\\u2069"),
    ("\u200fmark\u200e", "\\u200fmark\\u200e"),
    ("\u061c", "\\u061c"),
    ("line\u2028sep", "line\\u2028sep"),
    ("two\nlines", "two\\x0alines"),
]


@pytest.mark.parametrize(("raw", "shown"), CASES)
def test_printable_escapes(raw: str, shown: str) -> None:
    assert printable(raw) == shown


def test_newlines_kept_when_asked() -> None:
    assert printable("one\n\x1b[1mtwo\n", newlines=True) == "one\n\\x1b[1mtwo\n"


def test_result_has_no_control_or_bidi() -> None:
    raw = "".join(chr(c) for c in range(0x00, 0x3000))
    shown = printable(raw)
    assert not any(0x00 <= ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 for ch in shown)
    assert not any(0x2028 <= ord(ch) <= 0x202E or 0x2066 <= ord(ch) <= 0x2069 for ch in shown)
