"""The setting parsers: (key, raw value) -> value, or a ValueError naming the key.

slime hands every `--custom-config-path` YAML key over as it was written (a string from the
command line, a number, a bool, None for a YAML null). `parser_for` picks the parser of a
dataclass field by its type; the others (`as_store_url`, `as_run_name`, `as_key_file`,
`at_least`) are named by a field's `parse` metadata (settings_walk.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from slime_stoa.protocol.signing import SigningKey, read_key_file

Parser = Callable[[str, Any], Any]


def as_int(key: str, value: Any) -> int:
    """An integer (an integral float or a numeric string is fine); ValueError naming `key`."""
    if isinstance(value, bool):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    try:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be an integer, got {value!r}") from None


def as_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{key} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be a number, got {value!r}") from None


def as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{key} must be true or false, got {value!r}")


def as_str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty string, got {value!r}")
    return value


def as_path(key: str, value: Any) -> Path:
    return Path(as_str(key, value)).expanduser()


def as_store_url(key: str, value: Any) -> str:
    """A store URL (file://, s3://, r2://) that parses."""
    from slime_stoa.protocol.store.url import parse_store_url

    url = as_str(key, value)
    try:
        parse_store_url(url)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
    return url


def as_run_name(key: str, value: Any) -> str:
    from slime_stoa.protocol.layout import check_name

    try:
        return check_name("run", value)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def as_key_file(key: str, value: Any) -> SigningKey:
    """The run key in the file `value` names: it must be mode 0600 and an Ed25519 key file."""
    try:
        return read_key_file(as_path(key, value))
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def at_least(parse: Parser, low: float) -> Parser:
    """`parse`, then the value must be finite and >= `low`."""

    def checked(key: str, value: Any) -> Any:
        out = parse(key, value)
        if not (math.isfinite(out) and out >= low):
            raise ValueError(f"{key} must be a finite number >= {low:g}, got {value!r}")
        return out

    return checked


def as_tuple(parse: Parser) -> Parser:
    """A tuple of `parse`d items from a YAML list, or from a comma-separated string; None (YAML
    null) or an empty string is the empty tuple."""

    def items(key: str, value: Any) -> tuple[Any, ...]:
        if value is None or value == "":
            return ()
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",")]
        if not isinstance(value, list | tuple):
            raise ValueError(f"{key} must be a list, got {value!r}")
        return tuple(parse(key, item) for item in value)

    return items


def optional(parse: Parser) -> Parser:
    """`parse`, except that None (YAML null) or an empty string means None."""
    return lambda key, value: None if value is None or value == "" else parse(key, value)


_PARSERS: dict[Any, Parser] = {int: as_int, float: as_float, bool: as_bool, str: as_str, Path: as_path}


def parser_for(hint: Any) -> Parser | None:
    """The parser of a field of type `hint` (None: no parser for that type)."""
    if hint in _PARSERS:
        return _PARSERS[hint]
    if get_origin(hint) is Literal:
        return as_str  # the config's own __post_init__ names the allowed choices
    args = get_args(hint)
    if get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        inner = parser_for(args[0])
        return as_tuple(inner) if inner else None
    if get_origin(hint) in (Union, UnionType) and len(args) == 2 and type(None) in args:
        inner = parser_for(next(a for a in args if a is not type(None)))
        return optional(inner) if inner else None
    return None
