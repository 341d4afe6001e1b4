"""One tool episode as a pure state machine: which tokens the model sampled (mask 1, their
logprob), which the tool's observations forced (mask 0, logprob 0.0), and what happens next.

An episode is one sample of a tool task (`slime_stoa.tasks.tool_format.ToolFormat`). A driver
reports each sampled token with what the tokenizer saw in it (`Episode.sampled`), runs the tool
on the query of a closed call (`extract_query`) and hands its output back as observation tokens
(`observation_tokens`, then `Episode.observe`). Two drivers share it: the worker's batched MLX
decode (`macd.episodes`) and the trainer box's transformers eval
(`slime_stoa.evaluation.hf_generate`), so a call, an answer and a budget mean the same in both.

Pure Python: imports neither torch, mlx nor slime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .tool_format import ToolFormat

Action = Literal["continue", "call", "done"]


@dataclass
class Episode:
    """One episode's tokens so far: model tokens (mask 1, sampled logprob) and forced tool
    tokens (mask 0, logprob 0.0). Pure: the driver reports each sampled token with what the
    tokenizer saw in it; the episode decides what happens next."""

    budget: int  # most response tokens, model and tool together
    max_turns: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_start: int = 0  # index of this turn's first token
    turns: int = 1
    tool_calls: int = 0
    finish: str | None = None
    eos: bool = False  # ended on an EOS token
    query: str | None = None  # waiting for the tool's answer to this query

    @property
    def left(self) -> int:
        """Tokens the budget still allows."""
        return self.budget - len(self.tokens)

    @property
    def turn_tokens(self) -> list[int]:
        return self.tokens[self.turn_start :]

    def sampled(self, token: int, logprob: float, *, eos: bool, stopped: bool, called: bool) -> Action:
        """The model sampled `token`: `eos` if it is an EOS token, `stopped` if this turn's text
        now holds a stop string (the answer tag), `called` if it closed a tool call."""
        if self.finish is not None or self.query is not None:
            raise RuntimeError("a finished or waiting episode sampled a token")
        self.tokens.append(int(token))
        self.logprobs.append(float(logprob))
        self.mask.append(1)
        if eos or stopped:
            self.finish, self.eos = "stop", eos
        elif self.left <= 0:
            self.finish = "length"
        elif called and self.turns >= self.max_turns:
            self.finish = "turns"
        elif called:
            return "call"
        else:
            return "continue"
        return "done"

    def ask(self, query: str) -> None:
        self.query = query

    def observe(self, tokens: Sequence[int]) -> tuple[Action, list[int]]:
        """Append an observation (cut to the budget): ("done", appended) when the budget is then
        spent, else ("continue", appended) and a new model turn starts."""
        if self.query is None:
            raise RuntimeError("an observation for an episode that asked nothing")
        appended = [int(t) for t in tokens[: self.left]]
        self.tokens += appended
        self.logprobs += [0.0] * len(appended)
        self.mask += [0] * len(appended)
        self.query = None
        self.tool_calls += 1
        if self.left <= 0:
            self.finish = "length"
            return "done", appended
        self.turns += 1
        self.turn_start = len(self.tokens)
        return "continue", appended


class StopMatcher:
    """Finds the first stop string in a growing token list by decoding only its tail."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        # Every token decodes to >= 1 byte, so a stop string of n bytes spans <= n tokens; the
        # margin covers a partial UTF-8 character at the start of the window.
        self.window = max((len(s.encode()) for s in self.stop), default=0) + 3

    def hit(self, tokens: list[int]) -> bool:
        """Whether the text of `tokens` contains a stop string (checked after every token)."""
        if not self.stop:
            return False
        tail = self.tokenizer.decode(tokens[-self.window :])
        return any(s in tail for s in self.stop)


def extract_query(turn_text: str, fmt: ToolFormat) -> str:
    """The query of a call closed in `turn_text`: after the last `call_open` before the first
    `call_close` (the whole text before it when there is no `call_open`), stripped."""
    end = turn_text.find(fmt.call_close)
    head = turn_text if end < 0 else turn_text[:end]
    start = head.rfind(fmt.call_open)
    return (head if start < 0 else head[start + len(fmt.call_open) :]).strip()


def observation_tokens(fmt: ToolFormat, encode: Callable[[str], list[int]], output: str,
                       stop: tuple[str, ...] = ()) -> list[int]:
    """The forced tokens of a tool's output: the observation tags around the output cleaned of
    the format's tags and the run's `stop` strings, cut to `fmt.max_observation_tokens`."""
    cap = fmt.max_observation_tokens
    content = fmt.clean_output(str(output), max_chars=16 * cap, extra=tuple(stop))
    return encode(fmt.observation_open) + encode(content)[:cap] + encode(fmt.observation_close)


__all__ = ["Action", "Episode", "StopMatcher", "extract_query", "observation_tokens"]
