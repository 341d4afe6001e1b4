"""Reading question/answer files and passage corpora (JSON lines, or parquet with pyarrow).

Default columns follow PaperSearchQA and the Search-R1 corpus layout it builds on:

- questions: `question` (text) and `answer` (one string, or a list of acceptable answers);
- corpus: `contents` (the passage as one string), or else `title` and `text`, shown to the model
  as "(Title: <title>) <text>" (just the text when the title is empty).

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
    - `contents`: the whole passage; when a row lacks it, `title` and `text` are used.
    """

    question: str = "question"
    answer: str = "answer"
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


def passage_text(row: dict[str, Any], columns: Columns) -> str | None:
    """The passage of a corpus row (see the module doc), or None if the row has none."""
    contents = row.get(columns.contents)
    if isinstance(contents, str) and contents.strip():
        return contents.strip()
    text, title = row.get(columns.text), row.get(columns.title)
    if not isinstance(text, str) or not text.strip():
        return None
    if isinstance(title, str) and title.strip():
        return f"(Title: {title.strip()}) {text.strip()}"
    return text.strip()


def load_corpus(path: Path, *, columns: Columns = Columns()) -> list[str]:
    """The passages of a corpus file, in file order (a row without a passage is an error)."""
    passages = []
    for where, row in read_rows(path):
        text = passage_text(row, columns)
        if text is None:
            raise ValueError(f"{where}: no passage: expected {columns.contents!r}, or {columns.title!r} and {columns.text!r}")
        passages.append(text)
    if not passages:
        raise ValueError(f"{path}: no passages")
    return passages
