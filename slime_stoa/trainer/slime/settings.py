"""Parsing plugin settings that arrive as loosely typed values (YAML keys set on slime's args)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

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


def required_setting(args: Any, key: str, *, needed_by: str) -> str:
    """The non-empty string setting `args.<key>`; ValueError saying `needed_by` needs it."""
    value = getattr(args, key, None)
    if value is None or value == "":
        raise ValueError(f"{needed_by} needs the setting {key!r} (e.g. in the --custom-config-path YAML)")
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a non-empty string, got {value!r}")
    return value


def check_bucket_and_run(url: str, run: str, *, prefix: str = "stoa_") -> tuple[str, str]:
    """(url, run) once both parse as a store URL and a run name; ValueError naming the setting."""
    from slime_stoa.protocol.layout import check_name
    from slime_stoa.protocol.store.url import parse_store_url

    try:
        parse_store_url(url)
    except ValueError as exc:
        raise ValueError(f"{prefix}bucket: {exc}") from None
    try:
        check_name("run", run)
    except ValueError as exc:
        raise ValueError(f"{prefix}run: {exc}") from None
    return url, run


def as_str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty string, got {value!r}")
    return value


def as_path(key: str, value: Any) -> Path:
    return Path(as_str(key, value)).expanduser()


def _optional(parse: Parser) -> Parser:
    """`parse`, except that None (YAML null) or an empty string means None."""
    return lambda key, value: None if value is None or value == "" else parse(key, value)


def _parser_for(hint: Any) -> Parser | None:
    if hint in _PARSERS:
        return _PARSERS[hint]
    if get_origin(hint) is Literal:
        return as_str  # the config's own __post_init__ names the allowed choices
    args = get_args(hint)
    if get_origin(hint) in (Union, UnionType) and len(args) == 2 and type(None) in args:
        inner = _parser_for(next(a for a in args if a is not type(None)))
        return _optional(inner) if inner else None
    return None


def field_parsers(cls: type, *, exclude: Collection[str] = ()) -> dict[str, Parser]:
    """One setting parser per field of the config dataclass `cls` (minus `exclude`), chosen by the
    field's type, so a new config field is a new plugin setting with nothing else to edit."""
    hints = get_type_hints(cls)
    parsers: dict[str, Parser] = {}
    for field in dataclasses.fields(cls):
        if field.name in exclude:
            continue
        parse = _parser_for(hints[field.name])
        assert parse is not None, f"{cls.__name__}.{field.name}: no setting parser for {hints[field.name]!r}"
        parsers[field.name] = parse
    return parsers


_PARSERS: dict[Any, Parser] = {int: as_int, float: as_float, bool: as_bool, str: as_str, Path: as_path}


def run_key_setting(args: Any, key: str = "stoa_run_key") -> SigningKey | None:
    """The run key whose file `args.<key>` names (None when unset or empty): it signs every
    weight version the trainer publishes. KeyFileError (a ValueError) when the file is missing,
    readable by others (it must be 0600) or not an Ed25519 key file."""
    value = getattr(args, key, None)
    if value is None or value == "":
        return None
    return read_key_file(as_path(key, value))
