"""When the night ends: ``up --until`` and ``OVERNIGHT_STOP_AT`` (pure, no clock of its own).

An ISO date-time (``2026-12-04T07:00``, ``2026-12-04 07:00:00+01:00``) names one moment; a
clock time (``07:00``, ``7:30:15``) names its next occurrence: today if it is still ahead,
else tomorrow. Times without an offset are local time.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta

from overnight.config.errors import OvernightError

_CLOCK = re.compile(r"(\d{1,2}):(\d{2})(?::(\d{2}))?")


class StopAtError(OvernightError, ValueError):
    """Not a time; or (``in_past``) a date-time that has already passed."""

    def __init__(self, message: str, *, in_past: bool = False) -> None:
        super().__init__(message)
        self.in_past = in_past


def parse_stop_at(text: str, now: datetime) -> datetime:
    """The moment ``text`` names, seen at ``now`` (timezone-aware); raises
    :class:`StopAtError` if it names none or names a moment before ``now``."""
    value = text.strip()
    clock = _CLOCK.fullmatch(value)
    if clock:
        hour, minute, second = int(clock[1]), int(clock[2]), int(clock[3] or 0)
        if hour > 23 or minute > 59 or second > 59:
            raise StopAtError(f"{text!r} is not a clock time (HH:MM or HH:MM:SS)")
        at = now.replace(hour=hour, minute=minute, second=second, microsecond=0)
        return at if at > now else at + timedelta(days=1)
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise StopAtError(
            f"{text!r} is neither a clock time (07:00) nor an ISO date-time (2026-12-04T07:00)"
        ) from None
    if at.tzinfo is None:
        at = at.astimezone()  # local time, as a clock time is
    if at <= now:
        raise StopAtError(f"{text!r} has already passed", in_past=True)
    return at


def check_format(text: str) -> str:
    """``text`` if it names a time at all (whether it has passed is decided at use)."""
    value = text.strip()
    if _CLOCK.fullmatch(value):
        parse_stop_at(value, datetime.now().astimezone())
        return text
    try:
        datetime.fromisoformat(value)
    except ValueError:
        raise StopAtError(
            f"{text!r} is neither a clock time (07:00) nor an ISO date-time (2026-12-04T07:00)"
        ) from None
    return text


def stop_unix(text: str | None, since: datetime) -> float | None:
    """The unix time of the night's end as a long-running process reads the setting, or None
    if unset. ``since`` is when that process started: a clock time names its next occurrence
    after it (``07:00`` read by a worker started at 18:00 is tomorrow's, and stays so after
    midnight); a passed ISO time is returned as is (the night is over)."""
    if not text:
        return None
    try:
        return parse_stop_at(text, since).timestamp()
    except StopAtError as exc:
        if not exc.in_past:
            raise
        at = datetime.fromisoformat(text.strip())
        return (at if at.tzinfo else at.astimezone()).timestamp()
