"""One tool episode as a pure state machine: which tokens the model sampled (mask 1, their
logprob), which the tool's observations forced (mask 0, logprob 0.0), and what happens next.

An episode is one sample of a tool task (`slime_stoa.tasks.tool_format.ToolFormat`). A driver
reports each sampled token with what the tokenizer saw in it (`Episode.sampled`, with what a
closed call means: `turn_action`), runs the tool on the query of a valid call and hands its
output back as observation tokens (`observation_tokens`, then `Episode.observe`); an invalid
action gets `ToolFormat.invalid_action_text` the same way. Two drivers share it: the worker's
batched MLX decode (`macd.episodes`) and the trainer box's transformers eval
(`slime_stoa.evaluation.hf_generate`), so a call, an invalid action, an answer and a budget mean
the same in both.

Pure Python: imports neither torch, mlx nor slime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .tool_format import ToolFormat

Action = Literal["continue", "call", "invalid", "done"]
CallKind = Literal["call", "invalid", "in_answer"]


@dataclass
class Episode:
    """One episode's tokens so far: model tokens (mask 1, sampled logprob) and forced tool
    tokens (mask 0, logprob 0.0). Pure: the driver reports each sampled token with what the
    tokenizer saw in it; the episode decides what happens next.

    A turn that closed a call (`turn_action`) either asks the tool ("call": `ask`, then
    `observe` its output), gets the invalid-action feedback as its observation ("invalid":
    `observe` it at once; the turn counts), or, when the call was closed inside an open answer,
    ends the episode "stop" (`format_error`: the reward scores it 0). `tool_calls` counts the
    observations (a record's tool spans), `invalid_actions` those that were feedback.

    A turn that ends without a call or an answer (EOS, or `turn_budget` model tokens) ends the
    episode, unless `no_action_feedback` (Search-R1's rule: `ToolFormat.no_action`): then it gets
    the invalid-action feedback like an invalid call and the episode goes on (an EOS it sampled
    stays in its tokens: the record holds what the model sampled)."""

    budget: int  # most response tokens, model and tool together
    max_turns: int
    turn_budget: int | None = None  # most model tokens in one turn (None: no limit but `budget`)
    no_action_feedback: bool = False
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_start: int = 0  # index of this turn's first token
    turns: int = 1
    tool_calls: int = 0
    invalid_actions: int = 0
    finish: str | None = None
    eos: bool = False  # ended on an EOS token
    format_error: bool = False  # ended on a call inside an open answer
    pending: CallKind | None = None  # "call" or "invalid": waiting for an observation
    query: str | None = None  # the query of a pending call, once asked

    @property
    def left(self) -> int:
        """Tokens the budget still allows."""
        return self.budget - len(self.tokens)

    @property
    def turn_tokens(self) -> list[int]:
        return self.tokens[self.turn_start :]

    @property
    def waiting(self) -> bool:
        """Whether the episode waits for an observation."""
        return self.pending is not None

    def sampled(self, token: int, logprob: float, *, eos: bool, stopped: bool, call: CallKind | None = None) -> Action:
        """The model sampled `token`: `eos` if it is an EOS token, `stopped` if this turn's text
        now holds a stop string (the answer tag), `call` what closing a call in this turn's text
        means (`turn_action`), None if it closed none.

        Precedence: a stop string, or EOS without `no_action_feedback` ("stop"), the budget
        ("length"), a call inside an open answer ("stop", `format_error`), the turn limit
        ("turns": the tool is not run), the call ("call") or the invalid action ("invalid"), then
        a turn ended without an action (EOS, or `turn_budget` reached): "invalid" with
        `no_action_feedback` while turns are left, else the episode ends ("stop" at EOS,
        "length" at the turn budget)."""
        if self.finish is not None or self.pending is not None:
            raise RuntimeError("a finished or waiting episode sampled a token")
        self.tokens.append(int(token))
        self.logprobs.append(float(logprob))
        self.mask.append(1)
        turn_spent = self.turn_budget is not None and len(self.tokens) - self.turn_start >= self.turn_budget
        if stopped or (eos and not self.no_action_feedback):
            self.finish, self.eos = "stop", eos
        elif self.left <= 0:
            self.finish = "length"
        elif call == "in_answer":
            self.finish, self.format_error = "stop", True
        elif call is not None and self.turns >= self.max_turns:
            self.finish = "turns"
        elif call is not None:
            self.pending = call
            return call
        elif eos or turn_spent:  # the turn ended without a call or an answer
            if self.no_action_feedback and self.turns < self.max_turns:
                self.pending = "invalid"
                return "invalid"
            self.finish, self.eos = ("stop" if eos else "length"), eos
        else:
            return "continue"
        return "done"

    @property
    def turn_left(self) -> int:
        """Model tokens this turn may still sample (the budget's and the turn budget's least)."""
        if self.turn_budget is None:
            return self.left
        return min(self.left, self.turn_budget - (len(self.tokens) - self.turn_start))

    def ask(self, query: str) -> None:
        """The query of a pending call (the driver sends it to the tool)."""
        if self.pending != "call":
            raise RuntimeError("a query for an episode with no pending call")
        self.query = query

    def observe(self, tokens: Sequence[int]) -> tuple[Action, list[int]]:
        """Append an observation (cut to the budget): ("done", appended) when the budget is then
        spent, else ("continue", appended) and a new model turn starts."""
        if self.pending is None:
            raise RuntimeError("an observation for an episode that is not waiting for one")
        appended = [int(t) for t in tokens[: self.left]]
        self.tokens += appended
        self.logprobs += [0.0] * len(appended)
        self.mask += [0] * len(appended)
        self.tool_calls += 1
        self.invalid_actions += self.pending == "invalid"
        self.pending = self.query = None
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


def turn_action(turn_text: str, fmt: ToolFormat) -> tuple[CallKind, str]:
    """What the call closed in `turn_text` (the first `call_close`) means, and its query:

    - ("in_answer", ""): an answer is open before it (its last `answer_open` is not closed
      after it): a format error, the episode ends;
    - ("invalid", ""): no `call_open` before it: the invalid-action feedback;
    - ("call", query): the text after the last `call_open` before it, stripped."""
    end = turn_text.find(fmt.call_close)
    head = turn_text if end < 0 else turn_text[:end]
    opened = head.rfind(fmt.answer_open)
    if opened >= 0 and opened > head.rfind(fmt.answer_close):
        return "in_answer", ""
    start = head.rfind(fmt.call_open)
    if start < 0:
        return "invalid", ""
    return "call", head[start + len(fmt.call_open) :].strip()


def extract_query(turn_text: str, fmt: ToolFormat) -> str | None:
    """The query of a valid call closed in `turn_text` (`turn_action`), None if it is none."""
    kind, query = turn_action(turn_text, fmt)
    return query if kind == "call" else None


def observation_tokens(fmt: ToolFormat, encode: Callable[[str], list[int]], output: str,
                       stop: tuple[str, ...] = ()) -> list[int]:
    """The forced tokens of a tool's output: the observation tags around the output escaped and
    cleaned of the format's tags and the run's `stop` strings (`ToolFormat.clean_output`).

    "stoa" layout: the output cut to `fmt.max_observation_tokens`, each part encoded alone.
    "search-r1" layout: Search-R1's observation text (`open + output.strip() + close`) encoded
    whole, as Search-R1 does; one longer than `max_observation_tokens` keeps its tags and the
    output's first tokens, so that it is exactly that long (Search-R1 cuts the closing tag too,
    which its regex reward does not mind and stoa's parser would)."""
    cap = fmt.max_observation_tokens
    content = fmt.clean_output(str(output), max_chars=16 * cap, extra=tuple(stop))
    if fmt.layout == "stoa":
        return encode(fmt.observation_open) + encode(content)[:cap] + encode(fmt.observation_close)
    content = content.strip()
    whole = encode(fmt.observation_open + content + fmt.observation_close)
    if len(whole) <= cap:
        return whole
    head, tail = encode(fmt.observation_open), encode(fmt.observation_close)
    return head + encode(content)[: max(0, cap - len(head) - len(tail))] + tail


def invalid_action_tokens(fmt: ToolFormat, encode: Callable[[str], list[int]], stop: tuple[str, ...] = ()) -> list[int]:
    """The forced tokens of the invalid-action feedback: an observation of
    `fmt.invalid_action_text` ("stoa" layout), or Search-R1's exact feedback text, encoded whole,
    with no tags around it ("search-r1": `ToolFormat.invalid_action_observation`)."""
    exact = fmt.invalid_action_observation
    if exact is None:
        return observation_tokens(fmt, encode, fmt.invalid_action_text, stop)
    return encode(exact)


__all__ = ["Action", "CallKind", "Episode", "StopMatcher", "extract_query", "invalid_action_tokens", "observation_tokens",
           "turn_action"]
