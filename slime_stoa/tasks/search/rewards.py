"""Answer extraction and exact-match rewards for search tasks (pure functions of text and label).

Normalisation is SQuAD's (the one Search-R1 and PaperSearchQA score with): lowercase, drop
ASCII punctuation, drop the articles "a", "an", "the" as words, collapse whitespace.

Match modes (`MATCH_KINDS`, the task meta's "match"; default `DEFAULT_MATCH`, "cover_em"):

- "em": the normalised prediction equals one normalised gold answer;
- "cover_em": one normalised gold answer appears in the normalised prediction as a whole run of
  words (" gold " in " prediction "), so "cat" is not found in "concatenate";
- "subem": Search-R1's substring match (its `subem_check`): a normalised gold answer is a
  substring of the normalised prediction, so "1990" is found in "1990s" and "synuclein" in
  "α-synuclein" (normalised "αsynuclein").

One deliberate difference from Search-R1: a gold answer that normalises to nothing ("The", "!")
matches nothing here, in every mode (Search-R1 credits any prediction with it).

The answer (`parse_completion`): a completion is model turns separated by observations, each
observation an `<information>`...`</information>` block (tool output is escaped, so no tag can
occur inside one). The answer is the text between the *last* `</answer>` and the `<answer>`
opened before it in the same turn. There is none (None, a format error, reward 0) when the last
`</answer>` has no `<answer>` in its turn, when an `<answer>` after it is never closed, when it
encloses only whitespace, or when the model closed a tool call (`</search>`) while an answer was
open, anywhere in the completion: an answer is never written around a call or an observation.
A `</search>` with no `<search>` in its turn is an invalid action (the episode runner answers
it with feedback). Everything here is linear time.

An optional format reward (`FormatReward`, off by default) scores as Search-R1's
`qa_em_format.compute_score_em`: a right answer in a malformed episode earns 1 - `structure`, a
wrong answer in a well-formed one `structure` (+ `retrieval` when an observation holds a gold
answer), a wrong answer in a malformed one `final`.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

MatchKind = Literal["em", "cover_em", "subem"]
MATCH_KINDS: tuple[MatchKind, ...] = ("em", "cover_em", "subem")
DEFAULT_MATCH: MatchKind = "cover_em"

_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _golds(golds: Sequence[str]) -> list[str]:
    return [g for g in map(normalize_answer, golds) if g]


def exact_match(prediction: str, golds: Sequence[str]) -> bool:
    """Whether the normalised prediction equals a (non-empty) normalised gold answer."""
    pred = normalize_answer(prediction)
    return any(pred == g for g in _golds(golds))


def cover_exact_match(prediction: str, golds: Sequence[str]) -> bool:
    """Whether a (non-empty) normalised gold answer occurs in the normalised prediction as whole words."""
    pred = f" {normalize_answer(prediction)} "
    return any(f" {g} " in pred for g in _golds(golds))


def substring_exact_match(prediction: str, golds: Sequence[str]) -> bool:
    """Whether a (non-empty) normalised gold answer is a substring of the normalised prediction."""
    pred = normalize_answer(prediction)
    return any(g in pred for g in _golds(golds))


MATCHERS: dict[str, Callable[[str, Sequence[str]], bool]] = {
    "em": exact_match,
    "cover_em": cover_exact_match,
    "subem": substring_exact_match,
}


def matches(prediction: str, golds: Sequence[str], match: MatchKind = DEFAULT_MATCH) -> bool:
    """Whether `prediction` matches a gold answer under `match` (ValueError for an unknown mode)."""
    try:
        return MATCHERS[match](prediction, golds)
    except KeyError:
        raise ValueError(f"match must be one of {list(MATCH_KINDS)}, got {match!r}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class AnswerTags:
    """The six tags `parse_completion` reads (the search task's `SearchTags`, as strings)."""

    answer_open: str = "<answer>"
    answer_close: str = "</answer>"
    call_open: str = "<search>"
    call_close: str = "</search>"
    observation_open: str = "<information>"
    observation_close: str = "</information>"
    feedback: str = ""
    """Text that is not the model's: Search-R1's invalid-action feedback, whose tags are plain
    text (`ToolFormat.invalid_action_observation`); every occurrence is skipped ("": none)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParsedCompletion:
    """What `parse_completion` read from a completion.

    - `answer`: the final answer (stripped), None for a format error or no answer.
    - `call_in_answer`: the model closed a tool call inside an open answer (a format error).
    - `calls`: closed calls with their opening tag in their turn; `invalid`: closes without one.
    - `observations`: the texts inside the observation blocks, in order.
    - `well_formed`: every turn ends with a call or the final answer, nothing but whitespace
      follows the answer, no stray or unclosed tag, no invalid action, no format error.
    """

    answer: str | None
    call_in_answer: bool
    calls: int
    invalid: int
    observations: tuple[str, ...]
    well_formed: bool


def parse_completion(completion: str, tags: AnswerTags = AnswerTags()) -> ParsedCompletion:
    """Read a completion's turns, calls, observations and final answer (see the module doc)."""
    if tags.feedback:
        completion = completion.replace(tags.feedback, "")
    names = (tags.answer_open, tags.answer_close, tags.call_open, tags.call_close,
             tags.observation_open, tags.observation_close)
    # longest first: a tag that is a prefix of another must not hide it
    pattern = re.compile("|".join(re.escape(t) for t in sorted(set(names), key=len, reverse=True)))
    answer: str | None = None
    answer_start: int | None = None  # after this turn's open answer tag
    search_open = False
    in_observation = False
    observation_start = 0
    observations: list[str] = []
    calls = invalid = stray = 0
    call_in_answer = False
    last_end = 0  # where the text after the final answer starts
    called = answered = False  # the last tag closed a call; an answer was closed
    for m in pattern.finditer(completion):
        tag = m.group()
        if in_observation:
            if tag == tags.observation_close:
                observations.append(completion[observation_start : m.start()])
                in_observation = False
            continue  # inside an observation every other tag is text
        if answered:
            stray += 1  # nothing follows the final answer in a well-formed episode
        if tag == tags.observation_open:
            if not called:
                stray += 1  # an observation answers a call only
            in_observation, observation_start = True, m.end()
            answer_start, search_open = None, False
        elif tag == tags.observation_close:
            stray += 1
        elif tag == tags.answer_open:
            if answer_start is not None or search_open:
                stray += 1
            answer_start = m.end()
        elif tag == tags.answer_close:
            if answer_start is None:
                answer, stray = None, stray + 1
            else:
                answer = completion[answer_start : m.start()].strip() or None
            answer_start, search_open, last_end, answered = None, False, m.end(), True
        elif tag == tags.call_open:
            if search_open:
                stray += 1
            search_open = True
        elif tag == tags.call_close:
            if answer_start is not None:
                call_in_answer = True
            elif search_open:
                calls += 1
            else:
                invalid += 1
            called = answer_start is None and search_open
            answer_start, search_open = None, False
            continue
        called = False
    if answer_start is not None:
        answer = None  # an unfinished final answer: an earlier complete one does not count
    if call_in_answer:
        answer = None
    unclosed = answer_start is not None or search_open or in_observation
    well_formed = (
        answer is not None and not call_in_answer and not invalid and not stray and not unclosed
        and not completion[last_end:].strip()
    )
    return ParsedCompletion(answer=answer, call_in_answer=call_in_answer, calls=calls, invalid=invalid,
                            observations=tuple(observations), well_formed=well_formed)


def extract_answer(completion: str, *, open_tag: str = "<answer>", close_tag: str = "</answer>",
                   tags: AnswerTags | None = None) -> str | None:
    """The final answer of `completion` (see the module doc), or None (a format error).

    `tags` gives all six tags; `open_tag`/`close_tag` alone rename the answer's (the others
    keep their defaults)."""
    if not isinstance(completion, str):
        return None
    if tags is None:
        tags = AnswerTags(answer_open=open_tag, answer_close=close_tag)
    return parse_completion(completion, tags).answer


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


FORMAT_REWARD_KEYS = ("structure", "final", "retrieval")


@dataclass(frozen=True, kw_only=True, slots=True)
class FormatReward:
    """Search-R1's format reward (`qa_em_format.compute_score_em`); the defaults are its format
    scripts' values. Each in [0, 1], `structure` + `retrieval` at most 1."""

    structure: float = 0.2
    final: float = 0.1
    retrieval: float = 0.0

    def __post_init__(self) -> None:
        for key in FORMAT_REWARD_KEYS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"format_reward.{key} must be a number in [0, 1], got {value!r}")
        if self.structure + self.retrieval > 1.0:
            raise ValueError("format_reward.structure + retrieval must be at most 1")

    @classmethod
    def from_meta(cls, value: Any) -> FormatReward | None:
        """None (off) for a missing, null or false value; the defaults for true; else a mapping
        with keys among `FORMAT_REWARD_KEYS`."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if not isinstance(value, Mapping) or set(value) - set(FORMAT_REWARD_KEYS):
            raise ValueError(f"format_reward must be true, false or a mapping with keys among {list(FORMAT_REWARD_KEYS)}")
        return cls(**dict(value))

    def as_meta(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in FORMAT_REWARD_KEYS}


def answer_reward(completion: str, label: str, *, match: MatchKind = DEFAULT_MATCH, open_tag: str = "<answer>",
                  close_tag: str = "</answer>", tags: AnswerTags | None = None,
                  format_reward: FormatReward | None = None) -> float:
    """The reward of `completion` for `label`: 1.0 when its final answer matches a gold answer
    under `match`, else 0.0; with `format_reward`, Search-R1's graded scores (module doc).

    A format error (see `parse_completion`) scores 0.0 without a format reward; a malformed
    label scores 0.0; never raises."""
    if not isinstance(completion, str):
        return 0.0
    if tags is None:
        tags = AnswerTags(answer_open=open_tag, answer_close=close_tag)
    try:
        golds = decode_label(label)
    except ValueError:
        return 0.0
    parsed = parse_completion(completion, tags)
    right = parsed.answer is not None and matches(parsed.answer, golds, match)
    if format_reward is None:
        return 1.0 if right else 0.0
    if right:
        return 1.0 if parsed.well_formed else 1.0 - format_reward.structure
    if parsed.well_formed:
        retrieved = any(substring_exact_match(o, golds) for o in parsed.observations)
        return format_reward.structure + (format_reward.retrieval if retrieved else 0.0)
    return format_reward.final if parsed.answer is not None else 0.0


REPORTED_MATCHES: tuple[MatchKind, ...] = ("em", "cover_em")
"""The match modes `stoa eval` reports for a search task, beside its reward."""


def answer_matches(completion: str, label: str, *, tags: AnswerTags = AnswerTags(),
                   kinds: Sequence[MatchKind] = REPORTED_MATCHES) -> dict[str, float]:
    """1.0 or 0.0 per match mode in `kinds`: whether the final answer of `completion` matches a
    gold answer of `label` under it (a format error or a malformed label: 0.0 each). Unlike
    `answer_reward` no format reward applies: these are the plain metrics."""
    try:
        golds = decode_label(label)
    except ValueError:
        return dict.fromkeys(kinds, 0.0)
    answer = parse_completion(completion, tags).answer if isinstance(completion, str) else None
    return {k: 1.0 if answer is not None and matches(answer, golds, k) else 0.0 for k in kinds}
