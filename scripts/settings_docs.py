"""The settings tables of the docs, rendered from the config dataclasses they describe.

Each doc holds its table between a start marker naming the dataclass and the common end marker:

- docs/slime.md: the plugin's YAML keys (`StoaSettings`, rendered by
  `slime_stoa.trainer.slime.settings_table`);
- docs/quickstart.md: the options of `stoa quickstart` (`QuickstartConfig`);
- docs/macd.md: the keys of macd's config file (`DaemonConfig`), the options of `macd run`
  (`RunInputs`, and the config fields it overrides) and those of `macd doctor` (`DoctorInputs`).

`python scripts/settings_docs.py` rewrites every table; name docs to rewrite only those;
`--check` rewrites nothing and exits 1 naming the docs whose table is out of date.
tests/test_settings_docs.py fails while any is.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable
from enum import Enum
from pathlib import Path
from typing import Any

from macd.config import DaemonConfig
from macd.doctor import DoctorInputs
from macd.join_settings import JOIN_SETTINGS
from macd.run_cmd import RunInputs
from slime_stoa.protocol.cli_fields import HELP, Flag, help_of, option_fields, option_name
from slime_stoa.quickstart.config import QuickstartConfig
from slime_stoa.trainer.slime import settings_table

REPO = Path(__file__).resolve().parent.parent
TABLE_END = settings_table.TABLE_END  # one end marker for every generated table


@dataclasses.dataclass(frozen=True)
class Table:
    """One generated table: the doc that holds it, its start marker and how it is rendered."""

    doc: str  # relative to the repository root
    start: str
    render: Callable[[], str]  # the markdown between the markers


def start_marker(cls: type, source: str) -> str:
    return f"<!-- settings: generated from {cls.__name__} ({source}) -->"


def cell(value: Any) -> str:
    """A markdown table cell: one line, `|` escaped, and `<`, `>` outside code spans too (a
    renderer takes `<out>` for a tag and hides it)."""
    parts = " ".join(str(value).split()).replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def default_cell(f: dataclasses.Field[Any]) -> str:
    """A field's default as a reader types it: `required` without one, `—` when none is set or
    it is computed (the meaning says how), `off` for a flag."""
    if f.default is dataclasses.MISSING:
        return "—" if f.default_factory is not dataclasses.MISSING else "required"
    if f.default is None or f.default == "":
        return "—"
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return f"`{f.default}`"


def option_strings(flag: Flag, name: str) -> list[str]:
    """What a user types for the field `name`: its option strings, or a positional's metavar."""
    if flag.positional:
        return [flag.metavar or name.upper()]
    return [*flag.aliases, flag.option or option_name(name)]


def options_of(flag: Flag, name: str) -> str:
    return ", ".join(f"`{o}`" for o in option_strings(flag, name))


def markdown(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]


def option_rows(cls: type, key: str, *, with_defaults: bool = True) -> list[tuple[str, str, str]]:
    """(option, default, meaning) of each option of the command `key` that `cls`'s fields make
    (the meaning is the option's help, as `--help` prints it before its default)."""
    return [
        (options_of(flag, f.name), default_cell(f) if with_defaults else "—", flag.help)
        for f, flag in option_fields(cls, key)
    ]


def quickstart_table() -> str:
    return "\n".join(markdown(("option", "default", "meaning"), option_rows(QuickstartConfig, HELP)))


def _label(keep: Enum | None) -> str:
    return "—" if keep is None else str(keep.value)


def macd_config_table() -> str:
    """The keys of macd.toml: default, the options that set them, when a re-join keeps them."""
    kept = {row.field: row.keep for row in JOIN_SETTINGS}
    rows = []
    for f in dataclasses.fields(DaemonConfig):
        set_by = [f"`macd {key} {option_strings(flag, f.name)[-1]}`"
                  for key in ("join", "run") for g, flag in option_fields(DaemonConfig, key) if g.name == f.name]
        rows.append((f"`{f.name}`", default_cell(f), ", ".join(set_by) or "—", _label(kept.get(f.name)), help_of(f)))
    return "\n".join(markdown(("key", "default", "option", "kept on re-join", "meaning"), rows))


def macd_run_table() -> str:
    rows = option_rows(RunInputs, "run") + option_rows(DaemonConfig, "run", with_defaults=False)
    return "\n".join(markdown(("option", "default", "meaning"), rows))


def macd_doctor_table() -> str:
    return "\n".join(markdown(("option", "default", "meaning"), option_rows(DoctorInputs, "doctor")))


TABLES = (
    Table("docs/slime.md", settings_table.TABLE_START, lambda: settings_table.reference_table()
          .removeprefix(settings_table.TABLE_START).removesuffix(TABLE_END).strip("\n")),
    Table("docs/quickstart.md", start_marker(QuickstartConfig, "slime_stoa/quickstart/config.py"), quickstart_table),
    Table("docs/macd.md", start_marker(DaemonConfig, "macd/config.py"), macd_config_table),
    Table("docs/macd.md", start_marker(RunInputs, "macd/run_cmd.py"), macd_run_table),
    Table("docs/macd.md", start_marker(DoctorInputs, "macd/doctor.py"), macd_doctor_table),
)


def with_table(text: str, table: Table) -> str:
    """`text` with the part between `table`'s start marker and the next end marker rendered again;
    ValueError naming the marker when the doc lacks it."""
    start = text.find(table.start)
    if start < 0:
        raise ValueError(f"{table.doc}: no line {table.start!r} to put the table after")
    end = text.find(TABLE_END, start)
    if end < 0:
        raise ValueError(f"{table.doc}: no {TABLE_END!r} after {table.start!r}")
    return text[:start] + f"{table.start}\n\n{table.render()}\n\n" + text[end:]


def rendered(doc: str, text: str) -> str:
    """`text` (the doc `doc`) with every table it holds rendered again."""
    for table in TABLES:
        if table.doc == doc:
            text = with_table(text, table)
    return text


def docs() -> list[str]:
    return list(dict.fromkeys(t.doc for t in TABLES))


def stale(root: Path = REPO) -> list[str]:
    """The docs whose tables differ from the rendered ones."""
    return [doc for doc in docs() if rendered(doc, text := (root / doc).read_text(encoding="utf-8")) != text]


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        out_of_date = stale()
        for doc in out_of_date:
            print(f"{doc}: its settings table is out of date: python scripts/settings_docs.py {doc}", file=sys.stderr)
        return 1 if out_of_date else 0
    unknown = sorted(set(argv) - set(docs()))
    if unknown:
        print(f"error: no generated table in {', '.join(unknown)}; the docs with one: {', '.join(docs())}", file=sys.stderr)
        return 2
    for doc in argv or docs():
        path = REPO / doc
        path.write_text(rendered(doc, path.read_text(encoding="utf-8")), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
