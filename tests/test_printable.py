"""Text from the bucket made safe to print (`protocol.printable`): bounded, one line, printable."""

from __future__ import annotations

import pytest

from slime_stoa.protocol.printable import MAX_NAME_CHARS, names_shown, printable
from slime_stoa.protocol.registry import RegistryError, parse_registry


def test_printable_cuts_and_replaces_what_would_break_a_line() -> None:
    assert printable("plain text") == "plain text"
    assert printable("a\nb\x1b[2Jc\u2028d") == "a\ufffdb\ufffd[2Jc\ufffdd"
    cut = printable("x" * 5000, 100)
    assert len(cut) == 100 and cut.endswith("\u2026")
    assert printable("x" * 100, 100) == "x" * 100  # at the limit: nothing cut


def test_names_shown_quotes_a_few_cut_names_and_counts_the_rest() -> None:
    assert names_shown({"b", "a"}) == "['a', 'b']"
    shown = names_shown([f"\n{i:02d}" + "y" * 500 for i in range(12)])
    assert shown.endswith(", and 7 more]") and shown.isprintable()
    assert len(shown) < 6 * (MAX_NAME_CHARS + 4)


@pytest.mark.parametrize("count", [1, 200])
def test_a_registry_of_hostile_field_names_is_refused_in_a_bounded_message(count: int) -> None:
    doc = {"format": "stoa.registry/1", "run": "r", **{f"\n{i}" + "z" * 10_000: 1 for i in range(count)}}
    with pytest.raises(RegistryError, match="unknown fields") as refused:
        parse_registry(doc, run="r")
    assert len(str(refused.value)) < 400 and str(refused.value).isprintable()
