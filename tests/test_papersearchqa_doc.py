"""docs/papersearchqa.md: every `stoa` command of its recipe parses with stoa's own parser (every
flag exists), and the prepare command sets the `papersearchqa` preset."""

from __future__ import annotations

import shlex
from pathlib import Path

from slime_stoa.cli import build_parser
from slime_stoa.cli.task_cmd import bm25_settings, search_settings
from slime_stoa.tasks.search.presets import TASK_PRESETS
from slime_stoa.tasks.search.tokenizer import PRESETS

DOC = Path(__file__).resolve().parent.parent / "docs" / "papersearchqa.md"


def recipe_commands() -> list[list[str]]:
    """The `stoa ...` lines of the page's bash blocks, split as a shell would."""
    out, in_block = [], False
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_block = line.strip() == "```bash"
            continue
        if in_block and line.startswith("stoa "):
            out.append(shlex.split(line)[1:])
    return out


def test_every_recipe_command_parses_with_stoas_parser() -> None:
    commands = recipe_commands()
    assert [c[:2] for c in commands] == [["run", "create"], ["task", "prepare"], ["weights", "publish-anchor"], ["eval", "--store"]]
    parser = build_parser()
    parsed = [parser.parse_args(c) for c in commands]  # an unknown flag exits (SystemExit) here
    create, prepare, _, evaluate = parsed
    assert (create.group_size, create.temperature, create.max_tokens, create.task) == (5, 1.0, 2500, "search")
    assert prepare.preset == "papersearchqa" and [p.name for p in prepare.files] == ["train.parquet", "test.parquet", "pubmed.jsonl"]
    meta, bm25 = search_settings(prepare)
    assert {k: meta[k] for k in TASK_PRESETS["papersearchqa"].meta} == dict(TASK_PRESETS["papersearchqa"].meta)
    assert bm25 == "search-r1" and bm25_settings(prepare) == PRESETS["search-r1"]
    assert evaluate.split == "test" and evaluate.max_tokens == create.max_tokens


def test_the_doc_names_every_preset_setting_and_which_metric_pass_at_1_is() -> None:
    text = DOC.read_text(encoding="utf-8")
    for key in TASK_PRESETS["papersearchqa"].meta:
        assert f"`{key}: " in text, key
    for column in ("`pass@1`", "`pass@1_em`", "`pass@1_cover_em`"):
        assert column in text
