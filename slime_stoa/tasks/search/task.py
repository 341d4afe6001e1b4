"""The `search` task: questions answered by searching a BM25 index of passages.

Item labels are JSON lists of gold answers (`rewards.encode_label`). The reward reads the final
answer the model wrote within one turn (`rewards.parse_completion`) and scores it against every
gold answer with the task's match mode: cover-EM when the meta names none, EM or Search-R1's
substring EM. Task meta (`SearchConfig.from_meta`, all keys optional):

    {"match": "cover_em" | "em" | "subem", "format_reward": null | true | {"structure": 0.2,
     "final": 0.1, "retrieval": 0.0}, "tags": {"search": ..., "information": ..., "answer": ...},
     "top_k": 3, "max_observation_chars": 1500, "max_searches": 4,
     "index": {"name": ..., "manifest_sha256": ..., "passages": ...}}

The system prompt describes the tool format in the task's own tags unless `system_prompt` is
set. The worker reads `config` for how to run an episode; the reward needs only the label.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from slime_stoa.tasks.base import Task, TaskItem
from slime_stoa.tasks.search.formats import SearchTags
from slime_stoa.tasks.search.rewards import (
    DEFAULT_MATCH,
    MATCH_KINDS,
    AnswerTags,
    FormatReward,
    MatchKind,
    answer_reward,
)
from slime_stoa.tasks.tool_format import ToolFormat


def _positive(meta: Mapping[str, Any], key: str, default: int) -> int:
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"search task meta[{key!r}] must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchConfig:
    """How episodes of a search task run and are scored.

    - `match`: "cover_em" (default: a gold answer appears in the answer as whole words), "em",
      or "subem" (Search-R1's: a gold answer is a substring of the answer, once normalised).
    - `format_reward`: Search-R1's graded format reward (`rewards.FormatReward`); None (default):
      the reward is 1 or 0.
    - `tags`: the tool format's tag names.
    - `top_k`: passages returned per search.
    - `max_observation_chars`: budget of one observation's passage text (`format_passages`).
    - `max_searches`: searches allowed per episode; the episode runner decides what happens after.
    - `index`: what `stoa task prepare search` recorded about the run's index (name, manifest
      sha256, passage count); empty when the task was built without one.
    """

    match: MatchKind = DEFAULT_MATCH
    format_reward: FormatReward | None = None
    tags: SearchTags = field(default_factory=SearchTags)
    top_k: int = 3
    max_observation_chars: int = 1500
    max_searches: int = 4
    index: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> SearchConfig:
        match = meta.get("match", DEFAULT_MATCH)
        if match not in MATCH_KINDS:
            raise ValueError(f"search task meta['match'] must be one of {list(MATCH_KINDS)}, got {match!r}")
        index = meta.get("index", {})
        if not isinstance(index, Mapping):
            raise ValueError(f"search task meta['index'] must be an object, got {type(index).__name__}")
        return cls(
            match=match,
            format_reward=FormatReward.from_meta(meta.get("format_reward")),
            tags=SearchTags.from_meta(meta),
            top_k=_positive(meta, "top_k", 3),
            max_observation_chars=_positive(meta, "max_observation_chars", 1500),
            max_searches=_positive(meta, "max_searches", 4),
            index=dict(index),
        )


class Search(Task):
    """Questions whose answers are in a passage corpus; reward the final answer's match (cover-EM by default)."""

    name: ClassVar[str] = "search"
    default_system_prompt: ClassVar[str | None] = SearchTags().system_prompt()
    run_stop: ClassVar[tuple[str, ...]] = (SearchTags().close("answer"),)  # the default tags' answer end

    def __init__(self, items: Iterable[TaskItem], *, meta: Mapping[str, Any] | None = None):
        super().__init__(items, meta=meta)
        self.config = SearchConfig.from_meta(self.meta)
        if "system_prompt" not in self.meta:
            self.system_prompt = self.config.tags.system_prompt()
        tags = self.config.tags
        # the episode runner's view: one turn per allowed search plus one to answer
        self.tool_format = ToolFormat(
            call_open=tags.open("search"),
            call_close=tags.close("search"),
            answer_open=tags.open("answer"),
            answer_close=tags.close("answer"),
            observation_open="\n" + tags.open("information"),
            observation_close=tags.close("information") + "\n",
            max_turns=self.config.max_searches + 1,
        )

    def reward(self, completion: str, label: str) -> float:
        return answer_reward(completion, label, match=self.config.match, tags=self.answer_tags,
                             format_reward=self.config.format_reward)

    @property
    def answer_tags(self) -> AnswerTags:
        tags = self.config.tags
        return AnswerTags(
            answer_open=tags.open("answer"), answer_close=tags.close("answer"), call_open=tags.open("search"),
            call_close=tags.close("search"), observation_open=tags.open("information"),
            observation_close=tags.close("information"),
        )
