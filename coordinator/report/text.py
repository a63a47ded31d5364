"""Text from task files, agents and rules, made safe to print on a terminal or a page.

A task's id, detail or an agent's output may carry ESC (and with it CSI sequences that
move the cursor, recolour or retitle a terminal), other control characters, or bidi
controls that make a line read differently from what it holds (U+202E). Every report
line passes through :func:`printable` first; the HTML report reuses it.
"""

from __future__ import annotations

import unicodedata

# Bidi embeddings, overrides, isolates and marks, and the line/paragraph separators.
BIDI: frozenset[str] = frozenset(
    "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u2028\u2029"
)


def _escaped(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, newlines: bool = False) -> str:
    """``text`` with every control character (C0, DEL, C1) and bidi control written as a
    visible escape (``\\x1b``, ``\\u202e``); printable text is unchanged. With
    ``newlines``, line breaks and tabs are kept (for multi-line output such as a log)."""
    out = []
    for ch in text:
        if newlines and ch in "\n\t":
            out.append(ch)
        elif ch in BIDI or unicodedata.category(ch) == "Cc":
            out.append(_escaped(ch))
        else:
            out.append(ch)
    return "".join(out)
