"""Client-controlled text in log lines: escaped, so a value cannot forge a line (a newline in a
request id) or hide one (a carriage return, terminal escapes)."""

from __future__ import annotations


def printable(value: object) -> str:
    """``value`` as text with every non-printable character backslash-escaped (``\\n``, ``\\x1b``,
    ``\\ud800``); printable text, spaces included, is unchanged."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)
