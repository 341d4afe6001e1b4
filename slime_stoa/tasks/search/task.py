"""The `search` task: questions answered by searching a BM25 index of passages.

Item labels are JSON lists of gold answers (`rewards.encode_label`). The reward reads the final
answer the model wrote within one turn (`rewards.parse_completion`) and scores it against every
gold answer with the task's match mode: cover-EM when the meta names none, EM or Search-R1's
substring EM. Task meta (`SearchConfig.from_meta`, all keys optional):

    {"match": "cover_em" | "em" | "subem", "format_reward": null | true | {"structure": 0.2,
     "final": 0.1, "retrieval": 0.0}, "tags": {"search": ..., "information": ..., "answer": ...},
     "top_k": 3, "max_observation_chars": 1500, "max_searches": 4,
     "prompt": "stoa" | "search-r1", "observation": "stoa" | "search-r1",
     "max_observation_tokens": 512, "max_turn_tokens": null, "no_action": "end" | "feedback",
     "index": {"name": ..., "manifest_sha256": ..., "passages": ...}}

The "stoa" prompt is a system prompt describing the tool format in the task's own tags (unless
`system_prompt` is set); the "search-r1" prompt is Search-R1's template around the question, as
one user message. The worker reads `config` for how to run an episode (`tool_format`); the
reward needs only the label. `presets.TASK_PRESETS` names settings that reproduce a published
run (PaperSearchQA's: `papersearchqa`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from slime_stoa.tasks.base import Task, TaskItem
from slime_stoa.tasks.search.formats import SearchTags
from slime_stoa.tasks.search.rewards import (
    DEFAULT_MATCH,
    MATCH_KINDS,
    AnswerTags,
    FormatReward,
    MatchKind,
    answer_matches,
    answer_reward,
)
from slime_stoa.tasks.tool_format import LAYOUTS, Layout, ToolFormat

PromptKind = Literal["stoa", "search-r1"]
PROMPT_KINDS: tuple[PromptKind, ...] = ("stoa", "search-r1")
NoAction = Literal["end", "feedback"]
NO_ACTIONS: tuple[NoAction, ...] = ("end", "feedback")


def _positive(meta: Mapping[str, Any], key: str, default: int) -> int:
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"search task meta[{key!r}] must be an int >= 1, got {value!r}")
    return value


def _choice(meta: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> Any:
    value = meta.get(key, choices[0])
    if value not in choices:
        raise ValueError(f"search task meta[{key!r}] must be one of {list(choices)}, got {value!r}")
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
    - `max_searches`: searches allowed per episode (model turns: one more, to answer); a call in
      the last turn ends the episode.
    - `prompt`: "stoa" (a system prompt, then the question) or "search-r1" (Search-R1's template
      around the question as one user message, `SearchTags.search_r1_prompt`).
    - `observation`: the observation layout (`ToolFormat.layout`): "stoa" (passages cut to share
      `max_observation_chars`, "Doc i: ..."; escaped feedback in the observation tags) or
      "search-r1" (the top passages whole, "Doc i(Title: ...) ...", `format_search_r1`, and
      Search-R1's feedback text).
    - `max_observation_tokens`: observation length cap in tokens (`ToolFormat.max_observation_tokens`).
    - `max_turn_tokens`: model tokens per turn (None: only the run's budget for the episode).
    - `no_action`: a turn ending without a call or answer "end"s the episode or gets the
      invalid-action "feedback" and goes on (`ToolFormat.no_action`).
    - `index`: what `stoa task prepare search` recorded about the run's index (name, manifest
      sha256, passage count); empty when the task was built without one.
    """

    match: MatchKind = DEFAULT_MATCH
    format_reward: FormatReward | None = None
    tags: SearchTags = field(default_factory=SearchTags)
    top_k: int = 3
    max_observation_chars: int = 1500
    max_searches: int = 4
    prompt: PromptKind = "stoa"
    observation: Layout = "stoa"
    max_observation_tokens: int = 512
    max_turn_tokens: int | None = None
    no_action: NoAction = "end"
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
            prompt=_choice(meta, "prompt", PROMPT_KINDS),
            observation=_choice(meta, "observation", LAYOUTS),
            max_observation_tokens=_positive(meta, "max_observation_tokens", 512),
            max_turn_tokens=None if meta.get("max_turn_tokens") is None else _positive(meta, "max_turn_tokens", 1),
            no_action=_choice(meta, "no_action", NO_ACTIONS),
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
        if self.config.prompt == "search-r1":
            self.system_prompt = None  # Search-R1's instructions are in the user message (`messages`)
        elif "system_prompt" not in self.meta:
            self.system_prompt = self.config.tags.system_prompt()
        tags, cfg = self.config.tags, self.config
        # the episode runner's view: one turn per allowed search plus one to answer
        self.tool_format = ToolFormat(
            call_open=tags.open("search"),
            call_close=tags.close("search"),
            answer_open=tags.open("answer"),
            answer_close=tags.close("answer"),
            # Search-R1's observation is "\n\n<information>...</information>\n\n"
            observation_open=("\n\n" if cfg.observation == "search-r1" else "\n") + tags.open("information"),
            observation_close=tags.close("information") + ("\n\n" if cfg.observation == "search-r1" else "\n"),
            max_turns=cfg.max_searches + 1,
            max_observation_tokens=cfg.max_observation_tokens,
            max_turn_tokens=cfg.max_turn_tokens,
            no_action=cfg.no_action,
            layout=cfg.observation,
        )

    def messages(self, item: TaskItem) -> list[dict[str, str]]:
        if self.config.prompt == "search-r1":
            return [{"role": "user", "content": self.config.tags.search_r1_prompt(item.prompt)}]
        return super().messages(item)

    def reward(self, completion: str, label: str) -> float:
        return answer_reward(completion, label, match=self.config.match, tags=self.answer_tags,
                             format_reward=self.config.format_reward)

    def answer_matches(self, completion: str, label: str) -> dict[str, float]:
        """The final answer's EM and cover-EM (`rewards.answer_matches`), whatever `match` is:
        what `stoa eval` reports beside the reward."""
        return answer_matches(completion, label, tags=self.answer_tags)

    @property
    def answer_tags(self) -> AnswerTags:
        tags, fmt = self.config.tags, self.tool_format
        feedback = fmt.invalid_action_observation if fmt is not None else None
        return AnswerTags(
            answer_open=tags.open("answer"), answer_close=tags.close("answer"), call_open=tags.open("search"),
            call_close=tags.close("search"), observation_open=tags.open("information"),
            observation_close=tags.close("information"), feedback=feedback or "",
        )
