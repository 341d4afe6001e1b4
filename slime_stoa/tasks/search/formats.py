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

from slime_stoa.tasks.tool_format import escape_tags

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


    def search_r1_prompt(self, question: str) -> str:
        """Search-R1's prompt (its `make_prefix`, template "base", also PaperSearchRL's), in these
        tags, for one user message: the question stripped and ended with "?" as both do."""
        q = question.strip()
        if not q.endswith("?"):
            q += "?"
        s, i, a = (self.open(k) for k in TAG_KEYS)
        s_, i_, a_ = (self.close(k) for k in TAG_KEYS)
        return (
            "Answer the given question. You must conduct reasoning inside <think> and </think> first every time "
            "you get new information. After reasoning, if you find you lack some knowledge, you can call a search "
            f"engine by {s} query {s_} and it will return the top searched results between {i} and {i_}. You can "
            "search as many times as your want. If you find no further external knowledge needed, you can directly "
            f"provide the answer inside {a} and {a_}, without detailed illustrations. For example, {a} Beijing {a_}. "
            f"Question: {q}\n"
        )


def format_search_r1(passages: Sequence[str]) -> str:
    """Passages as Search-R1 shows them (its `_passages2string`): whole, in rank order, each
    "Doc i(Title: <first line>) <the other lines>" and a newline. The passages are stored as
    Search-R1's corpus holds them (`data.passage_text` with `raw`: a quoted title line, then the
    text), so the title keeps its quotes. No passage: "" (an empty observation, as Search-R1's)."""
    out = []
    for rank, text in enumerate(passages, 1):
        title, _, rest = text.partition("\n")
        out.append(f"Doc {rank}(Title: {title}) {rest}\n")
    return "".join(out)


MIN_DOC_CHARS = 40
"""A passage is shown only when it can keep at least this many characters (or all of it)."""


def _overhead(count: int) -> int:
    """Characters of the "Doc i: " headers and the newlines between `count` entries."""
    return sum(len(f"Doc {rank}: ") for rank in range(1, count + 1)) + max(count - 1, 0)


def _shares(lengths: Sequence[int], room: int) -> list[int]:
    """Characters each text keeps when `room` is shared fairly: a text shorter than its share
    keeps all of itself and leaves the rest to the others (water-filling)."""
    out = [0] * len(lengths)
    left, todo = room, sorted(range(len(lengths)), key=lambda i: lengths[i])
    for n, i in enumerate(todo):
        share = left // (len(todo) - n)
        out[i] = min(lengths[i], share)
        left -= out[i]
    return out


def format_passages(passages: Sequence[str], *, max_chars: int) -> str:
    """Passages as one observation body, "Doc 1: ...\nDoc 2: ...", at most `max_chars` long.

    Whitespace runs become one space and angle brackets are escaped (`escape_tags`), so no
    passage can open or close a tag. Every passage is shown, in rank order, each cut to its fair
    share of the budget (a short one leaves its unused share to the others), unless the budget
    cannot give each at least `MIN_DOC_CHARS` characters: then the lowest-ranked ones are left
    out. The top passage is always shown, if need be in part. No passage: "No results.". The
    budget counts the body only; `observation` adds the tags around it."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be at least 1, got {max_chars}")
    if not passages:
        return "No results."[:max_chars]
    texts = [" ".join(escape_tags(t).split()) for t in passages]
    count = len(texts)
    while count > 1 and _overhead(count) + sum(min(len(t), MIN_DOC_CHARS) for t in texts[:count]) > max_chars:
        count -= 1
    room = max_chars - _overhead(count)
    if room < 0:  # not even the top passage's header fits
        return f"Doc 1: {texts[0]}"[:max_chars]
    shares = _shares([len(t) for t in texts[:count]], room)
    return "\n".join(f"Doc {rank}: {t[:share]}" for rank, (t, share) in enumerate(zip(texts[:count], shares, strict=True), 1))


def observation(body: str, fmt: SearchTags) -> str:
    """The text appended after a search: `body` inside the information tags, on its own lines."""
    return f"\n{fmt.open('information')}\n{body}\n{fmt.close('information')}\n"
