"""Parsing plugin settings that arrive as loosely typed values (YAML keys set on slime's args)."""

from __future__ import annotations

from typing import Any


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
