"""Configuration as dataclasses: documented fields, and the command-line options derived from
them (stdlib only). Every process's config is a dataclass whose fields say what they are in
one form, `setting(help, default=...)`: the help text in the field's metadata under `HELP`,
beside what other readers of the field need (a command's `Flag`, a settings reader's keys).

A field is an option of a command when its metadata holds, under the command's key, the
option's help text, True (the field's own help) or a `Flag` (the help plus what the field alone
does not say; a `Flag` without help takes the field's own); under the key `HELP` (the default)
every documented field is an option, with its help. From the field come:

- the option: `--max-versions` for `max_versions` (`Flag.option` overrides the name,
  `Flag.aliases` adds short forms such as `-n`), or a positional argument (`Flag.positional`);
  the parsed value is `args.<field name>` either way;
- the type: the annotation, `X | None` read as `X` (`Flag.type` overrides it); `bool` is an
  on/off flag (`store_true`), a `Literal` gives the choices;
- the default: the field's, shown in the help as "(default: ...)" unless it is None or empty
  text (`with_defaults=True`), or
  None (off for a `bool`) for every option (`with_defaults=False`), for a command whose options
  change only what they name, so that "not given" stays apart from every value.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, get_args, get_origin, get_type_hints

HELP = "help"
"""The metadata key of a field's help text (what it is, in one line or a few sentences)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Flag:
    """How a field shows on one command's line, beyond its name, type and default."""

    help: str = ""  # the option's help; empty: the field's own (`setting`'s help)
    option: str | None = None  # the option string when it is not `--<field-name>`
    aliases: tuple[str, ...] = ()  # further option strings, e.g. ("-n",)
    metavar: str | None = None
    positional: bool = False  # a positional argument (always required) instead of an option
    required: bool = False
    type: Callable[[str], Any] | None = None  # the parser of the value when not the annotation's


def setting(help: str, default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            **metadata: Any) -> Any:
    """A documented dataclass field: `help` (metadata `HELP`) says what it is; `metadata` adds
    what other readers of the field need, e.g. `join=Flag(...)` for the command `join`."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={HELP: help, **metadata})


def help_of(f: dataclasses.Field[Any]) -> str:
    """The help text of field `f` ("" when it has none)."""
    return f.metadata.get(HELP, "")


def option_name(name: str) -> str:
    """`--max-versions` for the field `max_versions`."""
    return "--" + name.replace("_", "-")


def flag_of(f: dataclasses.Field[Any], key: str) -> Flag | None:
    """The `Flag` of field `f` for the command `key` (plain help text becomes one, True or a
    `Flag` without help one with the field's own help), or None."""
    spec = f.metadata.get(key)
    if spec is None or (isinstance(spec, Flag) and spec.help):
        return spec
    if spec is True and help_of(f):
        return Flag(help=help_of(f))
    if isinstance(spec, Flag) and help_of(f):
        return dataclasses.replace(spec, help=help_of(f))
    if isinstance(spec, str):
        return Flag(help=spec)
    raise TypeError(
        f"field {f.name}: metadata[{key!r}] must be help text or a Flag (or True, or a Flag without help: "
        f"the field's own help, which it lacks), got {spec!r}"
    )


def option_fields(cls: type, key: str) -> list[tuple[dataclasses.Field[Any], Flag]]:
    """The fields of dataclass `cls` that are options of the command `key`, in field order."""
    found = [(f, flag_of(f, key)) for f in dataclasses.fields(cls)]
    return [(f, flag) for f, flag in found if flag is not None]


def _value_type(hint: Any) -> Any:
    """`X` for `X | None` (and for `Optional[X]`); any other annotation as it is."""
    if get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def add_field_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    key: str = HELP,
    *,
    with_defaults: bool = True,
) -> list[str]:
    """Add one argument per field of `cls` that is an option of the command `key`; their names."""
    hints = get_type_hints(cls)
    added = []
    for f, flag in option_fields(cls, key):
        kind = _value_type(hints[f.name])
        default = f.default if with_defaults and f.default is not dataclasses.MISSING else None
        kwargs: dict[str, Any] = {"help": flag.help}
        if flag.metavar is not None:
            kwargs["metavar"] = flag.metavar
        if kind is bool and flag.type is None:  # `--no-check`: off unless given
            kwargs.update(action="store_true", default=bool(default))
        else:
            if get_origin(kind) is Literal and flag.type is None:
                kwargs["choices"] = get_args(kind)
            elif (flag.type or kind) is not str:
                kwargs["type"] = flag.type or kind
            if not flag.positional:
                kwargs["default"] = default
            if default is not None and default != "":  # an empty text says nothing: the help says what it means
                kwargs["help"] += f" (default: {default})"
        if flag.positional:
            parser.add_argument(f.name, **kwargs)
        else:
            if flag.required:
                kwargs["required"] = True
            parser.add_argument(*flag.aliases, flag.option or option_name(f.name), dest=f.name, **kwargs)
        added.append(f.name)
    return added


def field_values(args: argparse.Namespace, cls: type, key: str = HELP) -> dict[str, Any]:
    """The parsed values of the options `add_field_options(parser, cls, key)` added, by field."""
    return {f.name: getattr(args, f.name) for f, _ in option_fields(cls, key)}
