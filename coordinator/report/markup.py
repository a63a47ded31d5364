"""What every part of the HTML report is written with: :func:`esc` (every string that came
from a task goes through it), times and durations in words, and the colours of step endings
and task states."""

from __future__ import annotations

import html
import re
import time

# C0/C1 controls (but tab and newline), and the characters that reorder text on display.
_HIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
COLOURS = {
    "clean": "#2e9d4f",
    "failed": "#e0a020",
    "gap": "#c0392b",
    "deadline": "#8e44ad",
    "refused": "#7f8c8d",
    "stop": "#1f3a5f",
    "killed": "#e74c3c",
    "lost": "#6d4c41",
    "running": "#3498db",
}
LEGEND = {
    "clean": "clean exit",
    "failed": "exited non-zero",
    "gap": "heartbeat-gap kill",
    "deadline": "deadline",
    "refused": "call refused",
    "stop": "requested stop",
    "killed": "other kill",
    "lost": "lost (reaped)",
    "running": "running",
}
STATE_COLOURS = {
    "finished_verified": "#2e9d4f",
    "halted_at_call_ceiling": "#e0a020",
    "halted_stuck": "#e0a020",
    "paused_for_reconciliation": "#c2185b",
    "expired": "#c0392b",
    "aborted": "#c0392b",
    "agent_failed": "#c0392b",
    "running": "#3498db",
    "queued": "#7f8c8d",
}


def esc(value: object) -> str:
    """``value`` as HTML text (also safe in a quoted attribute), hidden characters shown
    as ``<U+XXXX>``."""
    text = _HIDDEN.sub(lambda m: f"<U+{ord(m.group()):04X}>", str(value))
    return html.escape(text, quote=True)


def clock(ts: float | None) -> str:
    if ts is None:
        return "-"
    ms = round((ts % 1) * 1000) % 1000
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + f".{ms:03d} UTC"


def short(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ts))


def duration(sec: float) -> str:
    if sec < 60:
        return f"{sec:.1f} s"
    minutes, s = divmod(int(sec), 60)
    if minutes < 60:
        return f"{minutes} min {s:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
