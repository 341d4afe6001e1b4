"""Answer extraction and exact-match rewards for search tasks (pure functions of text).

Normalisation is SQuAD's (the one Search-R1 and PaperSearchQA score with): lowercase, drop
ASCII punctuation, drop the articles "a", "an", "the" as words, collapse whitespace.

- exact match (EM): the normalised prediction equals one normalised gold answer;
- cover exact match (cover-EM): one normalised gold answer appears in the normalised prediction
  as a whole run of words (" gold " in " prediction "). Plain substring matching, which some
  Search-R1 code uses, would also credit "cat" inside "concatenate"; whole words do not.

A gold answer that normalises to nothing ("The", "!") matches nothing.

`extract_answer` takes the text inside the *last* `<answer>` tag: a model may restate its answer,
and the last word is the one it stands by. If that last opening tag has no closing tag after it,
or encloses only whitespace, the completion has a format error (None, reward 0): an earlier
complete answer does not rescue an unfinished final one. Everything here is linear time.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Sequence
from typing import Literal

MatchKind = Literal["em", "cover_em"]
MATCH_KINDS: tuple[MatchKind, ...] = ("em", "cover_em")

_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds: Sequence[str]) -> bool:
    """Whether the normalised prediction equals a (non-empty) normalised gold answer."""
    pred = normalize_answer(prediction)
    return any(pred == g for g in map(normalize_answer, golds) if g)


def cover_exact_match(prediction: str, golds: Sequence[str]) -> bool:
    """Whether a (non-empty) normalised gold answer occurs in the normalised prediction as whole words."""
    pred = f" {normalize_answer(prediction)} "
    return any(f" {g} " in pred for g in map(normalize_answer, golds) if g)


def extract_answer(completion: str, *, open_tag: str = "<answer>", close_tag: str = "</answer>") -> str | None:
    """The stripped text inside the last `open_tag`...`close_tag`, or None (a format error).

    None when there is no `open_tag`, when the last one is not closed, or when it holds only
    whitespace."""
    if not isinstance(completion, str):
        return None
    start = completion.rfind(open_tag)
    if start < 0:
        return None
    start += len(open_tag)
    end = completion.find(close_tag, start)
    if end < 0:
        return None
    answer = completion[start:end].strip()
    return answer or None


def decode_label(label: str) -> tuple[str, ...]:
    """The gold answers of a search task label: a JSON list of strings (or one JSON string).

    ValueError for anything else (`prepare` writes labels with `encode_label`)."""
    try:
        value = json.loads(label)
    except (ValueError, RecursionError):
        raise ValueError(f"search label is not JSON: {label[:80]!r}") from None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError(f"search label must be a non-empty JSON list of strings, got {label[:80]!r}")
    return tuple(value)


def encode_label(answers: str | Sequence[str]) -> str:
    """The label for gold `answers` (one string or several): a JSON list, order kept."""
    values = [answers] if isinstance(answers, str) else list(answers)
    if not values or not all(isinstance(v, str) and v.strip() for v in values):
        raise ValueError(f"answers must be one or more non-empty strings, got {answers!r}")
    return json.dumps(values, ensure_ascii=False)


def answer_reward(completion: str, label: str, *, match: MatchKind = "cover_em", open_tag: str = "<answer>", close_tag: str = "</answer>") -> float:
    """1.0 when the last answer matches a gold answer of `label` under `match`, else 0.0.

    A format error (see `extract_answer`) or a malformed label scores 0.0; never raises."""
    answer = extract_answer(completion, open_tag=open_tag, close_tag=close_tag)
    if answer is None:
        return 0.0
    try:
        golds = decode_label(label)
    except ValueError:
        return 0.0
    ok = exact_match(answer, golds) if match == "em" else cover_exact_match(answer, golds)
    return 1.0 if ok else 0.0
