"""One strict JSON reader for every document read from the bucket (run manifest, pointer,
version and anchor manifests, registry, key rotations, eval requests, consumer state, heartbeats).

Python's `json.loads` takes the last of two equal keys, accepts `NaN` and `Infinity`, and raises
`RecursionError` (not `ValueError`) on deeply nested input. `load_json` refuses all three, and
bounds the document's size before parsing, so a hostile object fails with one `ValueError`. The
bytes themselves are bounded earlier, as they are read (`store.capped.read_capped`).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

#: Largest JSON document accepted (a version manifest of a very large model is a few MiB).
MAX_JSON_BYTES = 64 << 20
#: Deepest nesting accepted (stoa's documents nest at most 5 levels).
MAX_JSON_DEPTH = 32
#: Latest time (Unix seconds, in the year 5138) a document may state: any accepted time is a
#: date Python can build and a number of at most 11 digits in a log line.
MAX_TIMESTAMP = 1e11


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


class _Duplicate(ValueError):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(f"duplicate key {key[:80]!r}")
        out[key] = value
    return out


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _depth(text: str) -> int:
    """How deep brackets nest outside strings (strings removed by one regex pass, then counted
    with numpy: linear and fast even for a document at the size limit)."""
    rest = _STRING.sub("", text).encode("utf-8", "replace")
    codes = np.frombuffer(rest, dtype=np.uint8)
    steps = (codes == ord("[")).astype(np.int64) + (codes == ord("{"))
    steps -= (codes == ord("]")).astype(np.int64) + (codes == ord("}"))
    return int(np.cumsum(steps).max(initial=0))


def load_json(data: bytes | bytearray | memoryview | str, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse one JSON document strictly; ValueError (naming the problem) for anything else.

    Refused: input over `max_bytes`, input that is not UTF-8, nesting deeper than
    `MAX_JSON_DEPTH`, duplicate keys in an object, `NaN`/`Infinity`, trailing data."""
    if isinstance(data, str):
        text = data
    elif isinstance(data, (bytes, bytearray, memoryview)):
        if len(data) > max_bytes:
            raise ValueError(f"document is {len(data)} bytes, limit {max_bytes}")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8 ({exc})") from None
    else:
        raise ValueError(f"expected bytes, got {type(data).__name__}")
    if len(text) > max_bytes:
        raise ValueError(f"document is {len(text)} characters, limit {max_bytes}")
    if _depth(text) > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant)
    except _Duplicate as exc:
        raise ValueError(str(exc)) from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"not valid JSON ({exc})") from None


def check_timestamp(value: Any, what: str) -> float:
    """`value` as Unix seconds in [0, `MAX_TIMESTAMP`]; ValueError naming `what` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number of seconds, got {str(value)[:40]!r}")
    if not 0 <= value <= MAX_TIMESTAMP:
        raise ValueError(f"{what} {value:.3g} is not a time between 1970 and the year 5138")
    return float(value)
