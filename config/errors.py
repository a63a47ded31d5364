"""The root of every refusal the project raises on purpose."""

from __future__ import annotations


class OvernightError(Exception):
    """Something overnight refused or could not do, as opposed to a bug.

    Every named refusal derives from it, so a caller can catch the project's refusals in one
    clause; a class that was already a ``ValueError``, ``OSError`` and so on keeps that base
    too.
    """
