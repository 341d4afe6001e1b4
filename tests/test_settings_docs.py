"""The docs' settings tables (slime's YAML keys, the quickstart's options, macd's config keys and
`macd run`'s options) are the ones rendered from the config dataclasses, by one generator."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from macd.config import DaemonConfig
from macd.run_cmd import RunInputs
from slime_stoa.protocol.cli_fields import HELP, option_fields, option_name
from slime_stoa.quickstart.config import QuickstartConfig
from slime_stoa.trainer.slime import settings_table
from tests.scripts_loader import load_script

settings_docs = load_script("settings_docs")
REPO = Path(__file__).resolve().parent.parent


def test_every_docs_table_is_the_rendered_one() -> None:
    assert settings_docs.docs() == ["docs/slime.md", "docs/quickstart.md", "docs/macd.md"]
    stale = settings_docs.stale()
    assert stale == [], f"out of date: {stale}; rewrite them with: python scripts/settings_docs.py"


def test_slimes_table_is_the_one_its_own_module_renders() -> None:
    text = (REPO / "docs" / "slime.md").read_text(encoding="utf-8")
    assert settings_docs.rendered("docs/slime.md", text) == settings_table.doc_with_table(text)


def tables_of(doc: str) -> str:
    """The generated part of `doc` as rendered now (every table it holds)."""
    return "\n".join(t.render() for t in settings_docs.TABLES if t.doc == doc)


def test_every_field_has_its_row() -> None:
    quickstart = tables_of("docs/quickstart.md")
    for f, _ in option_fields(QuickstartConfig, HELP):
        assert f"| `{option_name(f.name)}` |" in quickstart
    macd = tables_of("docs/macd.md")
    for f in dataclasses.fields(DaemonConfig):
        assert f"| `{f.name}` |" in macd
    for f in dataclasses.fields(RunInputs):
        assert f"| `{option_name(f.name)}` |" in macd
    assert "| `--wandb-project` | — |" in macd  # the config key `macd run` overrides
    assert "| `--lock-wait` | `0.0` |" in macd and "| `spool_max_mb` | `2048` | — | any run |" in macd
    assert "| `worker_id` | required | `macd join --worker-id` | same run |" in macd
    assert "| `store` | required | `macd join BUCKET_URL` | — |" in macd


def test_cells_stay_one_cell_and_visible() -> None:
    assert settings_docs.cell("runs/<run>/rollouts|evals\n  next") == "runs/&lt;run&gt;/rollouts\\|evals next"
    assert settings_docs.cell("`runs/<run>/` and <out>") == "`runs/<run>/` and &lt;out&gt;"  # code spans as they are


def copy_docs(tmp_path: Path) -> Path:
    for doc in settings_docs.docs():
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / doc, tmp_path / doc)
    return tmp_path


@pytest.mark.parametrize("doc, row", [
    ("docs/macd.md", "| `--seed` |"),
    ("docs/macd.md", "| `log_level` |"),
    ("docs/quickstart.md", "| `--max-versions` |"),
    ("docs/slime.md", "| `stoa_run` |"),
])
def test_a_doc_whose_table_lost_a_row_is_stale_and_rewritten(tmp_path: Path, doc: str, row: str) -> None:
    root = copy_docs(tmp_path)
    path = root / doc
    text = path.read_text(encoding="utf-8")
    line = next(line for line in text.splitlines(keepends=True) if line.startswith(row))
    path.write_text(text.replace(line, ""), encoding="utf-8")
    assert settings_docs.stale(root) == [doc]
    path.write_text(settings_docs.rendered(doc, path.read_text(encoding="utf-8")), encoding="utf-8")
    assert settings_docs.stale(root) == [] and path.read_text(encoding="utf-8") == text


def test_a_doc_without_its_markers_is_one_line_naming_them() -> None:
    table = next(t for t in settings_docs.TABLES if t.doc == "docs/quickstart.md")
    with pytest.raises(ValueError, match=r"docs/quickstart\.md: no line .*QuickstartConfig"):
        settings_docs.with_table("# a doc\n", table)
    with pytest.raises(ValueError, match="no '<!-- end of the generated settings -->' after"):
        settings_docs.with_table(f"# a doc\n{table.start}\n", table)


def test_the_command_refuses_a_doc_without_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert settings_docs.main(["README.md"]) == 2
    assert "no generated table in README.md" in capsys.readouterr().err
    assert settings_docs.main(["--check"]) == 0
