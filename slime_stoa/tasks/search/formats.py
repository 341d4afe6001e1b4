"""The tool format of a search episode and how retrieved passages become an observation.

A model searches with `<search>query</search>`; the worker answers with
`<information>...</information>` holding the top passages; the model ends with
`<answer>...</answer>`. The tag names live in the task meta (`SearchTags.from_meta`), with
these defaults, so a run can rename them without code changes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_TAG = re.compile(r"[a-z][a-z0-9_]{0,31}")
TAG_KEYS = ("search", "information", "answer")


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchTags:
    """Tag names (without angle brackets) of a search episode.

    - `search`: wraps the model's query (`<search>query</search>`).
    - `information`: wraps the retrieved passages the worker appends.
    - `answer`: wraps the model's final answer, which the reward reads.
    """

    search: str = "search"
    information: str = "information"
    answer: str = "answer"

    def __post_init__(self) -> None:
        names = [getattr(self, k) for k in TAG_KEYS]
        for key, name in zip(TAG_KEYS, names, strict=True):
            if not isinstance(name, str) or not _TAG.fullmatch(name):
                raise ValueError(f"tool tag {key}={name!r}: use 1-32 of [a-z0-9_], starting with a letter")
        if len(set(names)) != len(names):
            raise ValueError(f"tool tags must differ, got {names}")

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> SearchTags:
        """The format in `meta["tags"]` ({"search": ..., "information": ..., "answer": ...}, each
        optional), else the defaults."""
        tags = meta.get("tags", {})
        if not isinstance(tags, Mapping) or set(tags) - set(TAG_KEYS):
            raise ValueError(f"meta['tags'] must be a mapping with keys among {list(TAG_KEYS)}, got {tags!r}")
        return cls(**dict(tags))

    def open(self, key: str) -> str:
        return f"<{getattr(self, key)}>"

    def close(self, key: str) -> str:
        return f"</{getattr(self, key)}>"

    def system_prompt(self) -> str:
        s, i, a = (self.open(k) for k in TAG_KEYS)
        s_, i_, a_ = (self.close(k) for k in TAG_KEYS)
        return (
            "Answer the question. You have a search engine: to look something up, write a query "
            f"as {s}query{s_} and the top results come back as {i}...{i_}. Search as many times "
            f"as you need. When you know the answer, give it without explanation as {a}answer{a_}."
        )


def format_passages(passages: Sequence[str], *, max_chars: int) -> str:
    """Passages as one observation body, "Doc 1: ...\\nDoc 2: ...", at most `max_chars` long.

    Passages are kept in rank order until the next one would go over the budget; that one and
    the rest are dropped, except that a top passage longer than the budget is cut to fit (the
    model always sees something). Whitespace runs become one space. No passage: "No results.".
    The budget counts the body only; `observation` adds the tags around it."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be at least 1, got {max_chars}")
    if not passages:
        return "No results."[:max_chars]
    out: list[str] = []
    used = 0
    for rank, text in enumerate(passages, 1):
        entry = ("\n" if out else "") + f"Doc {rank}: " + " ".join(text.split())
        if used + len(entry) > max_chars:
            if not out:
                out.append(entry[: max_chars - used])
            break
        out.append(entry)
        used += len(entry)
    return "".join(out)


def observation(body: str, fmt: SearchTags) -> str:
    """The text appended after a search: `body` inside the information tags, on its own lines."""
    return f"\n{fmt.open('information')}\n{body}\n{fmt.close('information')}\n"
