"""How a tool task's model calls its tool and gets the answer back: the tags of a tool episode.

An episode (`macd.episodes`): the model generates until it closes a tool call
(``<search>query</search>``) or an answer (``</answer>``); a call's query goes to the task's tool
and its output comes back as an observation (``<information>...</information>``) the model
continues from, as forced tokens it did not sample. A turn that closes a call with no opening
tag gets `invalid_action_text` as its observation instead; a call closed inside an open answer
ends the episode (a format error: `slime_stoa.tasks.episode.turn_action`). At most `max_turns`
model turns; the whole continuation (model and tool tokens) is bounded by the run's
``max_tokens``.

Tool output is escaped (`escape_tags`: ``<`` and ``>`` become ``&lt;`` and ``&gt;``) before the
format's tags are removed from it, so no text a tool returns can open or close a tag.

Pure Python: imports neither torch, mlx nor slime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Layout = Literal["stoa", "search-r1"]
LAYOUTS: tuple[Layout, ...] = ("stoa", "search-r1")


@dataclass(frozen=True, kw_only=True)
class ToolFormat:
    """The tags and limits of a task's tool episodes."""

    call_open: str = "<search>"
    """Opens a tool call; the query is the text after the last one before `call_close`."""
    call_close: str = "</search>"
    """Closes a tool call: generation pauses here and the tool runs on the query."""
    answer_open: str = "<answer>"
    """Opens the final answer: a call closed after it in the same turn is a format error."""
    answer_close: str = "</answer>"
    """Ends the episode (the final answer; list it in the run's stop strings too)."""
    observation_open: str = "\n<information>"
    """Put before the tool's output (forced tokens)."""
    observation_close: str = "</information>\n"
    """Put after the tool's output (forced tokens)."""
    max_turns: int = 4
    """Most model turns; a tool call in the last one ends the episode (finish "turns")."""
    max_observation_tokens: int = 512
    """Longest tool output, in tokens (cut beyond), not counting the observation tags ("stoa"
    layout); the whole observation, tags included ("search-r1" layout)."""
    max_turn_tokens: int | None = None
    """Most model tokens in one turn (None: only the run's budget for the whole response). A turn
    that reaches it without a call or an answer has taken no action (`no_action`)."""
    no_action: Literal["end", "feedback"] = "end"
    """What a turn that ends without a call or an answer (EOS, or `max_turn_tokens`) does: "end"
    the episode, or get `invalid_action_text` as its observation and go on ("feedback",
    Search-R1's rule; the turn counts)."""
    layout: Layout = "stoa"
    """How observations become tokens. "stoa": `observation_open` + the output (cut to
    `max_observation_tokens`) + `observation_close`, each encoded alone; the invalid-action
    feedback is an observation like any other. "search-r1": Search-R1's text, encoded whole:
    `observation_open` + the output stripped + `observation_close`, the whole cut to
    `max_observation_tokens` (the closing tag kept); the feedback is "\n" + its text + "\n",
    with no tags around it (`invalid_action_observation`)."""

    def __post_init__(self) -> None:
        for name in ("call_open", "call_close", "answer_open", "answer_close", "observation_open", "observation_close"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"ToolFormat.{name} must be a non-empty string")
        if self.call_close == self.answer_close:
            raise ValueError("ToolFormat.call_close and answer_close must differ")
        if self.max_turns < 1 or self.max_observation_tokens < 1:
            raise ValueError("ToolFormat.max_turns and max_observation_tokens must be >= 1")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ValueError("ToolFormat.max_turn_tokens must be None or >= 1")
        if self.no_action not in ("end", "feedback"):
            raise ValueError(f"ToolFormat.no_action must be 'end' or 'feedback', got {self.no_action!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"ToolFormat.layout must be one of {list(LAYOUTS)}, got {self.layout!r}")

    @property
    def tags(self) -> tuple[str, ...]:
        """Every tag of the format: a tool's output may not contain any (`clean_output`)."""
        return (self.call_open, self.call_close, self.answer_open, self.answer_close,
                self.observation_open.strip(), self.observation_close.strip())

    @property
    def invalid_action_text(self) -> str:
        """The observation after a turn with no valid action (Search-R1's words, in this
        format's tags; escaped like any tool output when it becomes an observation)."""
        return (
            "My previous action is invalid. If I want to search, I should put the query between "
            f"{self.call_open} and {self.call_close}. If I want to give the final answer, I should "
            f"put the answer between {self.answer_open} and {self.answer_close}. Let me try again."
        )

    @property
    def invalid_action_observation(self) -> str | None:
        """The feedback observation's exact text in the "search-r1" layout (Search-R1's, tags
        and all: the reward's parser skips it, `AnswerTags.feedback`); None in the "stoa" layout,
        where the feedback is escaped and wrapped like any tool output."""
        return f"\n{self.invalid_action_text}\n" if self.layout == "search-r1" else None

    def clean_output(self, text: str, max_chars: int, extra: tuple[str, ...] = ()) -> str:
        """A tool's output cut to `max_chars`, escaped (`escape_tags`), without the format's tags
        or `extra` stop strings: an observation must neither end the episode, nor open a call or
        an answer, nor look like the model's own tags to the trainer's re-scoring."""
        return strip_all(escape_tags(text[:max_chars]), (*self.tags, *extra))


def escape_tags(text: str) -> str:
    """`text` with ``<`` and ``>`` as ``&lt;`` and ``&gt;``: no tag can start or end in it.
    Idempotent (``&`` is kept as it is)."""
    return text.replace("<", "&lt;").replace(">", "&gt;")


def strip_all(text: str, needles: tuple[str, ...]) -> str:
    """`text` with every occurrence of each needle removed, until none is left (removing one may
    join the halves of another)."""
    needles = tuple(n for n in needles if n)
    while True:
        before = text
        for n in needles:
            text = text.replace(n, "")
        if text == before:
            return text


__all__ = ["LAYOUTS", "Layout", "ToolFormat", "escape_tags", "strip_all"]
