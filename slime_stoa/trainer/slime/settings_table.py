"""The reference table of the plugin's YAML keys, rendered from `StoaSettings`.

docs/slime.md holds it between `TABLE_START` and `TABLE_END`;
`python -m slime_stoa.trainer.slime.settings_table docs/slime.md` rewrites it there.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .settings import leaves

PARTS = {"shared": "Shared", "rollout": "Rollout function", "publisher": "Weight publisher", "loss": "DPPO loss"}
"""The pieces that read the keys (a field's `part`), in table order, with their headings."""

TABLE_START = "<!-- settings: generated from StoaSettings (slime_stoa/trainer/slime/settings.py) -->"
TABLE_END = "<!-- end of the generated settings -->"


def reference_table() -> str:
    """The YAML keys as markdown, one table per piece (docs/slime.md holds it between the markers)."""
    lines = [TABLE_START]
    rows = list(leaves())
    for part, title in PARTS.items():
        lines += ["", f"**{title}**", "", "| key | default | meaning |", "|---|---|---|"]
        for leaf in (r for r in rows if r.part == part):
            lines.append(f"| `{leaf.key}` | {_cell(leaf.default)} | {_cell(leaf.doc)} |")
    lines += ["", TABLE_END]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def doc_with_table(text: str) -> str:
    """`text` (docs/slime.md) with the part between the markers replaced by `reference_table()`."""
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    return text[:start] + reference_table() + text[end:]


def main(argv: list[str]) -> None:
    """Rewrite the table in the file `argv[0]` names (docs/slime.md)."""
    target = Path(argv[0])
    target.write_text(doc_with_table(target.read_text(encoding="utf-8")), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
