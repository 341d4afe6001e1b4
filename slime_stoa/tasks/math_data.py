"""MATH-format data from local files: Hendrycks' folder of JSON files or a JSON-lines file.

A folder (e.g. ``MATH/train``) holds one JSON object per problem, in subject subfolders
(``algebra/1.json``); its files are read in sorted path order. A JSON-lines file (``.jsonl``, e.g.
MATH-500's ``test.jsonl``) holds one object per line. Each object has a ``problem`` and either an
``answer`` or a ``solution`` whose last ``\\boxed{}`` is the answer. The item's prompt is the
problem, its label the answer text as written (graded with MATH's normalisation).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slime_stoa.tasks.base import TaskItem
from slime_stoa.tasks.math_answer import MAX_BOXED_SCAN_CHARS, last_boxed

MAX_PROBLEM_FILE_BYTES = 1 << 20  # one problem's JSON file in a MATH folder


def math_item(row: Any, index: int) -> TaskItem:
    """The item of one MATH object; ValueError naming what is missing."""
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    problem = row.get("problem")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError('"problem" must be a non-empty string')
    answer = row.get("answer")
    if answer is None:
        solution = row.get("solution")
        if not isinstance(solution, str):
            raise ValueError('give an "answer" or a "solution" with a \\boxed{} answer')
        answer = last_boxed(solution)
        if answer is None:
            raise ValueError('the "solution" has no closed \\boxed{} answer')
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError('"answer" must be a non-empty string')
    if len(answer) > MAX_BOXED_SCAN_CHARS:
        raise ValueError(f'"answer" is {len(answer)} characters (limit {MAX_BOXED_SCAN_CHARS})')
    return TaskItem(index=index, prompt=problem.strip(), label=answer.strip())


def _folder_rows(folder: Path) -> Iterator[tuple[str, Any]]:
    files = sorted(p for p in folder.rglob("*.json") if p.is_file())
    if not files:
        raise ValueError(f"{folder}: no .json problem files in this folder")
    for path in files:
        if path.stat().st_size > MAX_PROBLEM_FILE_BYTES:
            raise ValueError(f"{path}: over {MAX_PROBLEM_FILE_BYTES} bytes; not a MATH problem file")
        yield str(path), _loads(path.read_text(encoding="utf-8"), str(path))


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield f"{path}:{lineno}", _loads(line, f"{path}:{lineno}")


def _loads(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{where}: not valid JSON: {str(e)[:200]}") from None


def load_math(path: str | Path, *, limit: int | None = None) -> tuple[TaskItem, ...]:
    """Items from a MATH folder or JSON-lines file (see the module docstring); `limit` keeps the
    first `limit`. Raises ValueError naming the file (and line) of anything malformed."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
    path = Path(path)
    rows = _folder_rows(path) if path.is_dir() else _jsonl_rows(path)
    items: list[TaskItem] = []
    for where, row in rows:
        if limit is not None and len(items) >= limit:
            break
        try:
            items.append(math_item(row, len(items)))
        except ValueError as e:
            raise ValueError(f"{where}: bad MATH problem: {e}") from None
    if not items and limit != 0:
        raise ValueError(f"{path}: no MATH problems")
    return tuple(items)


def split_name(path: str | Path) -> str:
    """The split a MATH source names: a folder's name (``MATH/test`` -> test), a file's name up to
    its first dot (``test.jsonl`` -> test)."""
    path = Path(path)
    return path.name if path.is_dir() else path.name.split(".")[0]


__all__ = ["load_math", "math_item", "split_name"]
