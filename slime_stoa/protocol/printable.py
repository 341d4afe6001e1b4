"""Text read from the bucket, made safe to print: cut to a bound, one line, printable.

Anything a bucket writer controls (a forged manifest's field names, a heartbeat's error text)
reaches log lines and tables. Printed as it came, it could fill a terminal with megabytes or
forge log lines with newlines and escape sequences, so it goes through `printable` first.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_LINE_CHARS = 2000  # a log line's text taken from the bucket (an error naming an object, say)
MAX_NAME_CHARS = 40  # one field name, key or id quoted in a message
MAX_NAMES_SHOWN = 5  # names quoted in one message; the rest are counted


def printable(text: str, limit: int = MAX_LINE_CHARS) -> str:
    """`text` cut to `limit` characters (an ellipsis marks the cut), each non-printable one (a
    newline, an escape) replaced by U+FFFD."""
    if len(text) > limit:
        text = text[: max(limit - 1, 0)] + "\u2026"
    return text if text.isprintable() else "".join(c if c.isprintable() else "\ufffd" for c in text)


def names_shown(names: Iterable[object]) -> str:
    """The first `MAX_NAMES_SHOWN` of `names` in sorted order, each cut and quoted, and how many
    more there are: for a message about a document's unexpected fields."""
    texts = sorted(str(n) for n in names)
    shown = ", ".join(repr(printable(t, MAX_NAME_CHARS)) for t in texts[:MAX_NAMES_SHOWN])
    more = len(texts) - MAX_NAMES_SHOWN
    return f"[{shown}{f', and {more} more' if more > 0 else ''}]"
