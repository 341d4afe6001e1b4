"""Reading question/answer files and passage corpora (JSON lines, or parquet with pyarrow).

Default columns follow PaperSearchQA (huggingface.co/datasets/jmhb/PaperSearchQA) and the
Search-R1 corpus layout it builds on:

- questions (PaperSearchQA's `data/train-*.parquet` and `data/test-*.parquet`: `question`,
  `answer`, `golden_answers`, `pmid`, `cat`, ...): `question` (text) and the acceptable answers:
  `golden_answers` (a list: the answer with its synonyms and abbreviations) when the row has it,
  else `answer` (one string, or a list). `--answer-field` names another column instead.
- corpus (PaperSearchQA's `jmhb/pubmed_bioasq_2022`, `data/corpus/pubmed.jsonl`, one PubMed
  abstract per line in Search-R1's layout: `{"id": ..., "contents": "\"<title>\"\n<abstract>"}`):
  `contents`; a contents whose first line is a quoted title is shown as Search-R1 shows it,
  "(Title: <title>) <text>". Without `contents`, `title` and `text` (e.g. `--text-field
  abstractText` for BioASQ's own files) give the same "(Title: <title>) <text>" (just the text
  when the title is empty).

With `raw` (a task whose observation layout is Search-R1's, `SearchConfig.observation`), a
passage is stored as Search-R1's corpus holds it, its title line shown by the observation
(`formats.format_search_r1`): `contents` unchanged, else "\"<title>\"\n<text>".

The corpus is read as a stream (`iter_corpus`), one row at a time.

Every column name can be changed (`Columns`). Parquet needs pyarrow, which stoa does not
install; without it a parquet file is refused with a message saying so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_stoa.tasks.base import TaskItem
from slime_stoa.tasks.search.rewards import encode_label


@dataclass(frozen=True, kw_only=True, slots=True)
class Columns:
    """Column names of the question file and the corpus.

    - `question`, `answer`: the question text and its answer(s) (a string or a list of strings).
    - `golden_answers`: the list of acceptable answers, used instead of `answer` when a row has
      it (None: always `answer`).
    - `contents`: the whole passage; when a row lacks it, `title` and `text` are used.
    """

    question: str = "question"
    answer: str = "answer"
    golden_answers: str | None = "golden_answers"
    contents: str = "contents"
    title: str = "title"
    text: str = "text"


def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) for each row of a JSON-lines or parquet file; blank lines skipped."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert it to jsonl") from None
        table = pq.ParquetFile(path)
        row = 0
        for batch in table.iter_batches(batch_size=8192):
            for record in batch.to_pylist():
                row += 1
                yield f"{path}: row {row}", record
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where}: not JSON: {e}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object")
            yield where, obj


def load_qa(path: Path, *, columns: Columns = Columns(), limit: int | None = None) -> tuple[TaskItem, ...]:
    """Task items from a question file: prompt = the question, label = its answers as JSON."""
    items: list[TaskItem] = []
    for where, row in read_rows(path):
        if limit is not None and len(items) >= limit:
            break
        question, answer = row.get(columns.question), row.get(columns.answer)
        golden = row.get(columns.golden_answers) if columns.golden_answers else None
        if isinstance(golden, list) and golden:
            answer = golden
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{where}: {columns.question!r} must be a non-empty string")
        try:
            if not isinstance(answer, (str, list)):
                raise ValueError
            label = encode_label(answer)
        except ValueError:
            raise ValueError(f"{where}: {columns.answer!r} must be a non-empty string or a list of them") from None
        items.append(TaskItem(index=len(items), prompt=question.strip(), label=label))
    if not items:
        raise ValueError(f"{path}: no questions")
    return tuple(items)


def _titled(title: str, text: str) -> str:
    return f"(Title: {title}) {text}" if title else text


def passage_text(row: dict[str, Any], columns: Columns, *, raw: bool = False) -> str | None:
    """The passage of a corpus row (see the module doc), or None if the row has none."""
    contents = row.get(columns.contents)
    if isinstance(contents, str) and contents.strip():
        if raw:
            return contents
        head, sep, rest = contents.strip().partition("\n")
        if sep and len(head) >= 2 and head[0] == head[-1] == '"':  # Search-R1's "<title>"\n<text>
            return _titled(head[1:-1].strip(), " ".join(rest.split()))
        return contents.strip()
    text, title = row.get(columns.text), row.get(columns.title)
    if not isinstance(text, str) or not text.strip():
        return None
    if raw:
        return f'"{title.strip() if isinstance(title, str) else ""}"\n{text.strip()}'
    return _titled(title.strip() if isinstance(title, str) else "", text.strip())


def iter_corpus(path: Path, *, columns: Columns = Columns(), raw: bool = False) -> Iterator[str]:
    """The passages of a corpus file, in file order, one at a time (a row without a passage is an
    error, naming the row); `raw`: as Search-R1 stores them (module doc)."""
    for where, row in read_rows(path):
        text = passage_text(row, columns, raw=raw)
        if text is None:
            raise ValueError(f"{where}: no passage: expected {columns.contents!r}, or {columns.title!r} and {columns.text!r}")
        yield text


def load_corpus(path: Path, *, columns: Columns = Columns(), raw: bool = False) -> list[str]:
    """`iter_corpus` as a list (small corpora; the index build streams instead)."""
    passages = list(iter_corpus(path, columns=columns, raw=raw))
    if not passages:
        raise ValueError(f"{path}: no passages")
    return passages
