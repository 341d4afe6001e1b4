"""How a tool task's model calls its tool and gets the answer back: the tags of a tool episode.

An episode (`macd.episodes`): the model generates until it closes a tool call
(``<search>query</search>``) or an answer (``</answer>``); a call's query goes to the task's tool
and its output comes back as an observation (``<information>...</information>``) the model
continues from, as forced tokens it did not sample. At most `max_turns` model turns; the whole
continuation (model and tool tokens) is bounded by the run's ``max_tokens``.

Pure Python: imports neither torch, mlx nor slime.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ToolFormat:
    """The tags and limits of a task's tool episodes."""

    call_open: str = "<search>"
    """Opens a tool call; the query is the text after the last one before `call_close`."""
    call_close: str = "</search>"
    """Closes a tool call: generation pauses here and the tool runs on the query."""
    answer_close: str = "</answer>"
    """Ends the episode (the final answer; list it in the run's stop strings too)."""
    observation_open: str = "\n<information>"
    """Put before the tool's output (forced tokens)."""
    observation_close: str = "</information>\n"
    """Put after the tool's output (forced tokens)."""
    max_turns: int = 4
    """Most model turns; a tool call in the last one ends the episode (finish "turns")."""
    max_observation_tokens: int = 512
    """Longest tool output, in tokens (cut beyond), not counting the observation tags."""

    def __post_init__(self) -> None:
        for name in ("call_open", "call_close", "answer_close", "observation_open", "observation_close"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"ToolFormat.{name} must be a non-empty string")
        if self.call_close == self.answer_close:
            raise ValueError("ToolFormat.call_close and answer_close must differ")
        if self.max_turns < 1 or self.max_observation_tokens < 1:
            raise ValueError("ToolFormat.max_turns and max_observation_tokens must be >= 1")

    @property
    def tags(self) -> tuple[str, ...]:
        """Every tag of the format: a tool's output may not contain any (`clean_output`)."""
        return (self.call_open, self.call_close, self.answer_close,
                self.observation_open.strip(), self.observation_close.strip())

    def clean_output(self, text: str, max_chars: int, extra: tuple[str, ...] = ()) -> str:
        """A tool's output without the format's tags (or `extra` stop strings), cut to
        `max_chars`: an observation must neither end the episode, nor open a call, nor look like
        the model's own tags to the trainer's re-scoring."""
        return strip_all(text[:max_chars], (*self.tags, *extra))


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


__all__ = ["ToolFormat", "strip_all"]
