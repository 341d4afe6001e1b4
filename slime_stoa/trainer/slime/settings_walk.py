"""The field walk: a settings dataclass read from slime's `args`, key by key, by its fields' types.

A field is a `setting` (`slime_stoa.protocol.cli_fields`): its help in its metadata, beside how
it is read where its name, type or default is not enough (`READS`: the parser, a default derived
from slime's flags, the default the reference table shows, a value derived from the parent's
fields, the piece that reads it). A field `x` read under a `Section` is the key `<prefix>x`; a
field `y` of a dataclass nested under the name `x` is `<prefix>x_y`, read under the `Section` in
that field's metadata or one derived from the parent's. A key that is not set keeps the field's
default; a YAML null means None, or the default in a `Section(null_is_default)`. Every error is
a `SettingError` naming the key.

`read` parses the keys, `leaves_of` lists them (with the default and meaning the reference
table shows).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_type_hints

from slime_stoa.protocol.cli_fields import help_of

from .settings_parsers import parser_for

T = TypeVar("T")

MISSING: Any = object()
"""An attribute that is not set (and a field read from no key)."""


# -- how a field is read -----------------------------------------------------------------------------
PARSE = "parse"
"""Metadata: the parser (`settings_parsers`), where the field's type does not choose it."""
DEFAULT_FROM = "default_from"
"""Metadata: `(args, the fields read before it) -> default` when the key is not set, from slime's flags."""
SHOWN_DEFAULT = "shown_default"
"""Metadata: the default as the reference table shows it."""
DERIVED = "derived"
"""Metadata: not a key: `(the parent's fields) -> value` (StoaSettings' own)."""
PART = "part"
"""Metadata: which piece reads it (a heading of the reference table): shared, rollout, publisher, loss."""
SECTION = "section"
"""Metadata of a nested config: its `Section`."""
READS = (PARSE, DEFAULT_FROM, SHOWN_DEFAULT, DERIVED, PART)
"""How a field is read, where its key, type or default is not enough (metadata keys)."""


@dataclass(frozen=True, kw_only=True)
class Section:
    """How a nested dataclass field is read: the key prefix of its fields and its own rules."""

    prefix: str | None = None
    """The key prefix of the nested fields (default: the parent's prefix + the field name + _)."""
    null_is_default: bool = False
    """A YAML null keeps a field's default (else null means None, an error where None is not allowed)."""
    fields: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """How the nested class's own fields are read (`READS` keys), where it is not ours to annotate."""
    skip: tuple[str, ...] = ()
    """Fields that are no settings: they keep their defaults."""
    reads: tuple[str, ...] = ()
    """The parent's fields its derived fields read: when one of them failed, the section is not
    read (the error is reported once, there)."""
    part: str = ""
    what: str = ""
    """The section in an error that names no field."""


class SettingError(ValueError):
    """A setting that does not parse; `key` names it when one does, `part` is its piece."""

    def __init__(self, message: str, *, key: str | None = None, part: str = "") -> None:
        super().__init__(message)
        self.key, self.part = key, part


# -- the walk ---------------------------------------------------------------------------------------
def _nested(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of `cls`'s fields."""
    return get_type_hints(cls)


def section_of(f: dataclasses.Field, parent: Section) -> Section:
    """How the nested field `f` of a class read under `parent` is read."""
    own = f.metadata.get(SECTION)
    if isinstance(own, Section):
        return own
    return Section(
        prefix=(parent.prefix or "") + f.name + "_", null_is_default=parent.null_is_default, part=parent.part,
        what=parent.what,
    )


def _rules(f: dataclasses.Field, parent: Section) -> Mapping[str, Any]:
    """How the leaf `f` is read: its own metadata, or what the parent `Section` says of it."""
    return {**parent.fields.get(f.name, {}), **f.metadata}


def _key(f: dataclasses.Field, parent: Section) -> str:
    return (parent.prefix or "") + f.name


def read(cls: type, args: Any, parent: Section, top: Mapping[str, Any] | None = None,
         only: Collection[str] | None = None) -> tuple[dict[str, Any], list[SettingError]]:
    """(the values of `cls`'s fields read from `args`, the errors): a field whose key is not set
    is left out (it keeps its default); nested dataclasses are built. `only` limits the fields."""
    if args is None:
        return {}, [SettingError("stoa's plugin needs slime's args (with stoa_bucket and stoa_run)")]
    values: dict[str, Any] = {}
    errors: list[SettingError] = []
    failed: set[str] = set()
    top_values = values if top is None else top
    types = hints(cls)
    for f in dataclasses.fields(cls):
        if (only is not None and f.name not in only) or f.name in parent.skip:
            continue
        if _nested(types[f.name]):
            sub = section_of(f, parent)
            if failed & set(sub.reads):
                continue  # its inputs did not parse: reported once, there
            inner, inner_errors = read(types[f.name], args, sub, top_values)
            errors += inner_errors
            if not inner_errors:
                try:
                    values[f.name] = build(types[f.name], inner, sub)
                except SettingError as exc:
                    errors.append(exc)
            continue
        try:
            value = _read_leaf(f, types[f.name], _rules(f, parent), parent, args, values, top_values)
        except SettingError as exc:
            errors.append(exc)
            failed.add(f.name)
            continue
        if value is not MISSING:
            values[f.name] = value
    return values, errors


def _read_leaf(
    f: dataclasses.Field, hint: Any, rules: Mapping[str, Any], parent: Section, args: Any,
    read_so_far: Mapping[str, Any], top: Mapping[str, Any],
) -> Any:
    if DERIVED in rules:
        return rules[DERIVED](top)
    key = _key(f, parent)
    part = rules.get(PART) or parent.part
    raw = getattr(args, key, MISSING)
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    if (raw is None and parent.null_is_default) or (required and raw == ""):
        raw = MISSING
    if raw is MISSING:
        if DEFAULT_FROM in rules:
            return rules[DEFAULT_FROM](args, read_so_far)
        if required:
            raise SettingError(
                f"stoa needs the setting {key!r} (e.g. in the --custom-config-path YAML)", key=key, part=part
            )
        return MISSING
    parse = rules.get(PARSE) or parser_for(hint)
    assert parse is not None, f"{f.name}: no setting parser for {hint!r}"
    try:
        return parse(key, raw)
    except ValueError as exc:
        raise SettingError(str(exc), key=key, part=part) from None


def build(cls: type[T], values: Mapping[str, Any], sec: Section) -> T:
    """`cls(**values)`; its ValueError as a SettingError naming the key of the field it names."""
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        key = _key_named(cls, message, sec)
        text = f"{key}: {message}" if key else f"invalid {sec.what or cls.__name__} settings: {message}"
        raise SettingError(text, key=key, part=sec.part) from None


def _key_named(cls: type, message: str, sec: Section) -> str | None:
    """The key of the field of `cls` the message names first (None: none)."""
    best: tuple[int, str] | None = None
    types = hints(cls)
    for f in dataclasses.fields(cls):
        if _nested(types[f.name]) or f.name in sec.skip:
            continue
        if DERIVED in _rules(f, sec):
            continue
        found = re.search(rf"(?<![\w.]){re.escape(f.name)}\b|\.{re.escape(f.name)}\b", message)
        if found and (best is None or found.start() < best[0]):
            best = (found.start(), _key(f, sec))
    return best[1] if best else None


# -- the keys ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Leaf:
    """One key: where it lands (`path` of field names), its default and meaning."""

    key: str
    path: tuple[str, ...]
    part: str
    default: str
    doc: str


def leaves_of(cls: type, parent: Section, path: tuple[str, ...] = ()) -> Iterator[Leaf]:
    """Every key of `cls` read under `parent`, in field order."""
    types = hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in parent.skip:
            continue
        if _nested(types[f.name]):
            yield from leaves_of(types[f.name], section_of(f, parent), (*path, f.name))
            continue
        rules = _rules(f, parent)
        if DERIVED in rules:
            continue
        yield Leaf(_key(f, parent), (*path, f.name), rules.get(PART) or parent.part, _shown(f, rules), docs.get(f.name, ""))


def _shown(f: dataclasses.Field, rules: Mapping[str, Any]) -> str:
    if SHOWN_DEFAULT in rules:
        return rules[SHOWN_DEFAULT]
    if f.default is not dataclasses.MISSING:
        return _yaml(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _yaml(f.default_factory())
    return "required"


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: its help (the `setting`'s metadata `HELP`), on one line}."""
    return {f.name: " ".join(help_of(f).split()) for f in dataclasses.fields(cls)}

