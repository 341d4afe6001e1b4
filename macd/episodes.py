"""Multi-turn tool episodes: G episodes per prompt, decoded together, tools run beside them.

An episode is one sample of a tool task (`slime_stoa.tasks.tool_format.ToolFormat`). The model
generates until it closes a tool call (``</search>``), ends (the answer tag, a stop string, EOS)
or spends the token budget. At a call the sequence leaves the batch with its KV cache, its query
(the text after the last ``<search>`` of this turn) goes to the tool on the asyncio side (never
on the MLX thread), and the tool's output comes back as an observation: the observation tags
around the output (escaped, tags removed from it, cut to `max_observation_tokens`), tokenized
and appended as forced tokens (mask 0, logprob 0.0). A closed call with no ``<search>`` in its
turn is an invalid action: the tool is not run and `ToolFormat.invalid_action_text` is the
observation (the turn counts); a call closed inside an open answer ends the episode "stop"
(`slime_stoa.tasks.episode.turn_action`). The sequence then re-enters the batch with the
cache it left with, so only the observation tokens are prefilled (mlx-lm's `BatchGenerator`
cannot append tokens to a live sequence, but `remove(..., return_prompt_caches=True)` hands its
cache back and `insert(..., caches=...)` takes one: no re-prefill of prompt and history).

Budget and turns: the response (every model and tool token after the prompt) is at most
`SamplingConfig.max_tokens` tokens (the record's `sampling.max_tokens`); an observation is cut
to what is left, and an episode whose budget is spent ends "length". At most
`ToolFormat.max_turns` model turns: a call (or invalid action) in the last one ends the episode
"turns" (the tool is not run). Precedence at a token: EOS or a stop/answer string ("stop"), then
the budget ("length"), then a call inside an open answer ("stop"), then the turn limit, then a
call.

`slime_stoa.tasks.episode.Episode` is the pure state machine of one episode; `EpisodeGenerator` drives a cohort of them
through one `BatchGenerator` with the interface of `macd.generate.ContinuousGenerator` (insert,
step, advance, discard, ...) plus a thread-safe hand-off of tool calls (`take_calls`) and
observations (`deliver`). Call its methods from the thread that owns MLX, except `take_calls`
and `deliver`, which the asyncio side calls. `run_episodes` is the asyncio driver for a batch of
prompts (tests, benchmarks); the worker has its own loop.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from slime_stoa.tasks.episode import Episode, StopMatcher, invalid_action_tokens, observation_tokens, turn_action
from slime_stoa.tasks.tool_format import ToolFormat
from slime_stoa.tasks.tools import Tool, call_tool

from .generate import (
    FinishedGroup,
    Generator,
    SamplingConfig,
    _as_wrapper,
    _batch_generator,
    _batch_size,
    _GroupBatch,
    _insert_group,
    _picked_logprobs,
    _text_tokens,
)


@dataclass(frozen=True)
class ToolCall:
    """An episode waiting for its tool: `episode` is the id `deliver` wants back."""

    episode: int
    query: str


@dataclass(frozen=True)
class EpisodeCompletion:
    """One finished episode (a `macd.generate.Completion` plus the mask).

    `tokens` (int32) are the whole response, model and tool tokens; `logprobs` (float32, same
    length) the sampled tokens' tempered logprobs, 0.0 at tool tokens; `mask` (uint8) 1 at model
    tokens, 0 at tool tokens; `text` the decoded tokens without a final EOS (what is scored)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    mask: np.ndarray
    finish_reason: str
    text: str
    turns: int
    tool_calls: int  # observations, invalid-action feedback included (the mask's tool spans)
    invalid_actions: int = 0


@dataclass
class _Group:
    tag: Any
    episodes: list[int]
    left: int


class ToolGenerator(Generator, Protocol):
    """A `macd.generate.Generator` of tool episodes: the `EpisodeGenerator` interface the worker's
    tool hand-off uses (`take_calls` and `deliver` from the asyncio side)."""

    @property
    def waiting(self) -> int: ...  # episodes waiting for a tool

    @property
    def decoding(self) -> int: ...  # sequences in (or queued for) the batch

    def take_calls(self) -> list[ToolCall]: ...

    def deliver(self, episode: int, output: str) -> None: ...


class EpisodeGenerator(_GroupBatch[_Group]):
    """Groups of G episodes decoded by one long-lived mlx-lm `BatchGenerator` (see the module doc).

    Like `ContinuousGenerator`: `insert` queues a prompt's group (prefilled once, its cache
    shared), `step` decodes one token of every sequence in the batch, `advance` runs up to a
    number of steps, `discard` drops every unfinished group (before a weight swap). A sequence
    that closes a tool call leaves the batch; `take_calls` hands its query to the asyncio side
    and `deliver` its tool's output back, taken in at the next `step`."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: SamplingConfig,
        tool_format: ToolFormat,
        *,
        max_batch: int,
        share_prefill: bool = True,
    ) -> None:
        self.model, self.config, self.format, self.share_prefill = model, config, tool_format, share_prefill
        self.tokenizer = _as_wrapper(tokenizer)
        self._eos = set(self.tokenizer.eos_token_ids)
        # with Search-R1's no-action rule an EOS may end a turn, not the episode: the sequence must
        # stay in the batch (its cache kept) for the feedback, so the episode, not mlx-lm, sees EOS
        self._feedback = tool_format.no_action == "feedback"
        self._gen = _batch_generator(model, config, set() if self._feedback else self._eos, max_batch=max_batch)
        self._stop = StopMatcher(self.tokenizer, (*config.stop, tool_format.answer_close))
        self._call = StopMatcher(self.tokenizer, (tool_format.call_close,))
        self._groups: dict[int, _Group] = {}
        self._owner: dict[int, int] = {}  # episode id -> group id
        self._episodes: dict[int, Episode] = {}
        self._live: dict[int, int] = {}  # BatchGenerator uid -> episode id (sequences in the batch)
        self._caches: dict[int, Any] = {}  # episode id -> KV cache, while waiting for its tool
        self._calls: collections.deque[ToolCall] = collections.deque()  # to the asyncio side
        self._inbox: collections.deque[tuple[int, str]] = collections.deque()  # from it
        self._next_group = self._next_episode = 0
        self.steps = self.tokens = self.tokens_dropped = 0
        self.tool_tokens = 0  # observation tokens appended

    # -- the ContinuousGenerator interface (`sequences`: episodes decoding, queued or waiting) ----
    @property
    def waiting(self) -> int:
        """Episodes waiting for a tool."""
        return len(self._caches)

    @property
    def decoding(self) -> int:
        """Sequences in (or queued for) the batch."""
        return len(self._live)

    @property
    def cache_bytes(self) -> int:
        return int(self._gen.prompt_cache_nbytes) + sum(c.nbytes for cache in self._caches.values() for c in cache)

    def insert(self, prompt: Sequence[int], tag: Any = None) -> None:
        """Queue a group of `config.group_size` episodes of `prompt` (token ids)."""
        g = self.config.group_size
        uids = _insert_group(self._gen, self.model, prompt, g, share_prefill=self.share_prefill)
        gid, self._next_group = self._next_group, self._next_group + 1
        eids = list(range(self._next_episode, self._next_episode + g))
        self._next_episode += g
        self._groups[gid] = _Group(tag, eids, g)
        for uid, eid in zip(uids, eids, strict=True):
            self._owner[eid] = gid
            self._episodes[eid] = Episode(budget=self.config.max_tokens, max_turns=self.format.max_turns,
                                          turn_budget=self.format.max_turn_tokens, no_action_feedback=self._feedback)
            self._live[uid] = eid

    def step(self) -> list[FinishedGroupLike]:
        """Take in delivered observations, then one decode step; the groups that finished."""
        done = self._take_in()
        if not self._live:
            return [self._pop(gid) for gid in done]
        responses = self._gen.next_generated()
        if not responses:
            raise RuntimeError("generation ended with sequences in the batch")
        self.steps += 1
        self.tokens += len(responses)
        ended, paused = [], []
        for r, lp in zip(responses, _picked_logprobs(responses), strict=True):
            eid = self._live[r.uid]
            ep = self._episodes[eid]
            # mlx-lm's only stop sequences are the EOS tokens (none with the no-action feedback)
            eos = r.token in self._eos if self._feedback else r.finish_reason == "stop"
            turn = [*ep.turn_tokens, r.token]
            stopped = not eos and self._stop.hit(turn)
            call, query = None, ""
            if not (eos or stopped) and self._call.hit(turn):
                call, query = turn_action(self.tokenizer.decode(turn), self.format)
            action = ep.sampled(r.token, lp, eos=eos, stopped=stopped, call=call)
            if action == "call":
                paused.append(r.uid)
                ep.ask(query)
                self._calls.append(ToolCall(eid, query))
            elif action == "invalid":
                paused.append(r.uid)
                self._inbox.append((eid, ""))  # the feedback, taken in at the next step (`_take_in`)
            elif action == "done":
                del self._live[r.uid]
                if r.finish_reason is None:
                    ended.append(r.uid)
                if self._finished(eid):
                    done.append(self._owner[eid])
        if ended:
            self._gen.remove(ended)
        if paused:
            caches = self._gen.remove(paused, return_prompt_caches=True)
            for uid in paused:
                self._caches[self._live.pop(uid)] = caches[uid][0]
        return [self._pop(gid) for gid in done]

    def _can_step(self) -> bool:
        """`advance` stops at a step that asked for a tool, and when every episode waits for its tool."""
        return not self._calls and bool(self._live or self._inbox)

    def discard(self) -> list[Any]:
        """Drop every unfinished group (tool answers still on their way are ignored); their tags."""
        if self._live:
            self._gen.remove(list(self._live))
        self.tokens_dropped += sum(len(self._episodes[e].tokens) for g in self._groups.values() for e in g.episodes)
        tags = [g.tag for g in self._groups.values()]
        for store in (self._groups, self._owner, self._episodes, self._live, self._caches):
            store.clear()
        self._calls.clear()
        self._inbox.clear()
        return tags

    # -- the tool hand-off (asyncio side) -----------------------------------------------------------
    def take_calls(self) -> list[ToolCall]:
        """The tool calls asked since the last take (thread-safe)."""
        out = []
        while self._calls:
            out.append(self._calls.popleft())
        return out

    def deliver(self, episode: int, output: str) -> None:
        """A tool's output for `episode` (thread-safe); taken in at the next step. Ignored when
        the episode was dropped meanwhile."""
        self._inbox.append((episode, output))

    # -- internals -----------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def observation_tokens(self, output: str) -> list[int]:
        """The forced tokens of a tool's output: the observation tags around the cleaned, cut output."""
        return observation_tokens(self.format, self._encode, output, tuple(self.config.stop))

    def invalid_action_tokens(self) -> list[int]:
        """The forced tokens of the invalid-action feedback (`ToolFormat.layout`)."""
        return invalid_action_tokens(self.format, self._encode, tuple(self.config.stop))

    def _take_in(self) -> list[int]:
        """Append delivered observations and re-enter their sequences; the groups that finished."""
        done = []
        while self._inbox:
            eid, output = self._inbox.popleft()
            ep = self._episodes.get(eid)
            if ep is None or not ep.waiting:
                continue  # dropped at a swap meanwhile
            tokens = self.invalid_action_tokens() if ep.pending == "invalid" else self.observation_tokens(output)
            action, appended = ep.observe(tokens)
            self.tool_tokens += len(appended)
            cache = self._caches.pop(eid)
            if action == "done":
                if self._finished(eid):
                    done.append(self._owner[eid])
                continue
            (uid,) = self._gen.insert([appended], max_tokens=[ep.left], caches=[cache])
            self._live[uid] = eid
        return done

    def _finished(self, eid: int) -> bool:
        group = self._groups[self._owner[eid]]
        group.left -= 1
        return not group.left

    def _pop(self, gid: int) -> FinishedGroupLike:
        group = self._groups.pop(gid)
        completions = []
        for eid in group.episodes:
            del self._owner[eid]
            completions.append(self._completion(self._episodes.pop(eid)))
        return FinishedGroup(group.tag, completions)  # type: ignore[arg-type]  # episode completions

    def _completion(self, ep: Episode) -> EpisodeCompletion:
        if ep.finish is None:
            raise RuntimeError("generation ended with an unfinished episode")
        text_tokens = _text_tokens(ep.tokens, ep.eos, self._eos)
        return EpisodeCompletion(
            tokens=np.array(ep.tokens, dtype=np.int32),
            logprobs=np.array(ep.logprobs, dtype=np.float32),
            mask=np.array(ep.mask, dtype=np.uint8),
            finish_reason=ep.finish,
            text=self.tokenizer.decode(text_tokens),
            turns=ep.turns,
            tool_calls=ep.tool_calls,
            invalid_actions=ep.invalid_actions,
        )


FinishedGroupLike = Any  # macd.generate.FinishedGroup holding EpisodeCompletions

STEPS_PER_CALL = 16


async def run_episodes(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    tool_format: ToolFormat,
    tool: Tool,
    *,
    max_batch: int | None = None,
    mlx: Callable[..., Awaitable[Any]] | None = None,
    on_group: Callable[[int], None] | None = None,
) -> list[list[EpisodeCompletion]]:
    """G episodes per prompt, batched; one list of G completions per prompt, in prompt order.

    `mlx(fn, *args)` runs MLX work (default: inline on the event loop's thread); tools run as
    asyncio tasks (a sync tool in a worker thread, `slime_stoa.tasks.tools.call_tool`), beside decoding.
    `on_group(n)` is called as each prompt's group finishes, `n` the groups finished so far."""

    async def inline(fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    run = mlx or inline
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts:
        return []
    batch = _batch_size(len(prompts), config.group_size, max_batch)
    gen: EpisodeGenerator = await run(
        lambda: EpisodeGenerator(model, tokenizer, config, tool_format, max_batch=batch)
    )
    done: dict[int, list[EpisodeCompletion]] = {}
    tasks: set[asyncio.Task[None]] = set()
    woken = asyncio.Event()

    async def answer(call: ToolCall) -> None:
        gen.deliver(call.episode, await call_tool(tool, call.query))
        woken.set()

    try:
        for i, p in enumerate(prompts):
            await run(gen.insert, p, i)
        while gen.groups:
            woken.clear()
            finished, steps = await run(gen.advance, STEPS_PER_CALL)
            for group in finished:
                done[group.tag] = group.completions
                if on_group is not None:
                    on_group(len(done))
            for call in gen.take_calls():
                task = asyncio.create_task(answer(call))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if not steps and not finished and gen.groups:
                await woken.wait()  # every episode waits for its tool
    finally:
        for task in tasks:
            task.cancel()
        await run(gen.close)
    return [done[i] for i in range(len(prompts))]


__all__ = ["EpisodeCompletion", "EpisodeGenerator", "ToolCall", "ToolGenerator", "run_episodes"]
