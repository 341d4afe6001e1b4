"""Eval sampling with transformers on the trainer box (`stoa eval --local --engine transformers`).

The same episodes as a worker's, driven by `transformers`' `generate` instead of MLX: each
sample is a `slime_stoa.tasks.episode.Episode` (single-turn tasks: one turn, no tool), fed the
tokens `generate` sampled one by one with what their text holds (an EOS id, a stop string or the
answer tag, a closed tool call), so a call, an answer, a stop and the token budget end a sample
exactly where they would on a Mac. A tool call's query goes to the task's tool (never raising:
`slime_stoa.tasks.tools.call_tool`) and its output comes back as observation tokens the next
turn starts from; an invalid action gets the format's feedback instead, and a call closed inside
an open answer ends the sample (`slime_stoa.tasks.episode.turn_action`). Each turn re-prefills
prompt and history (no KV cache across turns: eval, not the hot path). Sampling is plain
temperature sampling (top-k and top-p off, as on workers).

Progress: the token budget done (prompts x k x max tokens: every sample's model and tool tokens,
plus the unused budget of each finished sample, so an ETA from its rate is an upper bound) after
every `generate` call (a decode chunk: one turn of up to `max_batch` samples) and tool answers.

Logprobs are not kept: eval scores text. Torch and transformers are the trainer extra.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_stoa.tasks import Task
from slime_stoa.tasks.episode import Episode, StopMatcher, invalid_action_tokens, observation_tokens, turn_action
from slime_stoa.tasks.tools import Tool, call_tool

DEFAULT_MAX_BATCH = 16  # sequences per `generate` call


@dataclass(frozen=True)
class HfCompletion:
    """One finished sample: `tokens` the whole response (model and tool tokens), `text` its
    decoded form without a final EOS (what is scored), as in `macd.episodes.EpisodeCompletion`."""

    tokens: tuple[int, ...]
    text: str
    finish_reason: str
    turns: int
    tool_calls: int  # observations, invalid-action feedback included
    invalid_actions: int = 0


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_hf_model(folder: Path, device: str) -> tuple[Any, Any]:
    """An HF model folder as (model, tokenizer) for sampling: bf16 on a GPU, float32 on a CPU,
    with none of the folder's sampling defaults."""
    import torch
    import transformers

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(str(folder), **{dtype_kw: dtype})
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    # The folder's generation_config.json may shape sampling (top-k, top-p, repetition penalty,
    # as Qwen's does): `generate` would apply whatever a call leaves unset. Workers sample with
    # the temperature alone, so only the special token ids are kept.
    found = model.generation_config
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=found.bos_token_id, eos_token_id=found.eos_token_id, pad_token_id=found.pad_token_id,
    )
    return model.to(device).eval(), tokenizer


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The ids that end a sample: the tokenizer's EOS and the model's generation config's."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if not ids:
        raise ValueError("the model's tokenizer has no EOS token: a sample could not end")
    return ids


def _turn_stop(matchers: Sequence[StopMatcher], width: int) -> Any:
    """transformers stopping criteria ending a row once the tokens it generated in this call (one
    turn) hold a stop string or a closed call: the episode's own test. transformers'
    `stop_strings` would also match across the turn's start (prompt, observation), which the
    episode, as on a worker, does not."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class TurnStop(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            done = [any(m.hit(row) for m in matchers) for row in input_ids[:, width:].tolist()]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([TurnStop()])


class _Sampler:
    """Feeds `generate`'s tokens to episodes; one per eval call."""

    def __init__(self, model: Any, tokenizer: Any, task: Task, *, temperature: float, max_tokens: int,
                 stop: tuple[str, ...], seed: int | None, tool: Tool | None, max_batch: int) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if max_tokens < 1 or max_batch < 1:
            raise ValueError("max_tokens and max_batch must be >= 1")
        self.model, self.tokenizer, self.fmt, self.tool = model, tokenizer, task.tool_format, tool
        self.temperature, self.max_tokens, self.max_batch = temperature, max_tokens, max_batch
        self.eos = eos_ids(model, tokenizer)
        self.stop = tuple(stop)
        self.stops = (*stop, self.fmt.answer_close) if self.fmt is not None else tuple(stop)
        self._stop = StopMatcher(tokenizer, self.stops)
        self._call = StopMatcher(tokenizer, (self.fmt.call_close,) if self.fmt is not None else ())
        if seed is not None:  # `generate` samples from torch's global generator
            import torch

            torch.manual_seed(seed)

    def new_episode(self) -> Episode:
        if self.fmt is None:
            return Episode(budget=self.max_tokens, max_turns=1)
        return Episode(budget=self.max_tokens, max_turns=self.fmt.max_turns, turn_budget=self.fmt.max_turn_tokens,
                       no_action_feedback=self.fmt.no_action == "feedback")

    def _generate(self, histories: Sequence[Sequence[int]], max_new: int) -> list[list[int]]:
        """One `generate` call over left-padded histories: the new tokens of each."""
        import torch

        pad = min(self.eos)
        width = max(len(h) for h in histories)
        ids = torch.full((len(histories), width), pad, dtype=torch.long)
        mask = torch.zeros((len(histories), width), dtype=torch.long)
        for row, history in enumerate(histories):
            ids[row, width - len(history):] = torch.tensor(list(history), dtype=torch.long)
            mask[row, width - len(history):] = 1
        device = self.model.device
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                temperature=self.temperature, top_k=0, top_p=1.0, max_new_tokens=max_new,
                eos_token_id=sorted(self.eos), pad_token_id=pad,
                stopping_criteria=_turn_stop((self._stop, self._call), width),
            )
        return [[int(t) for t in row] for row in out[:, width:].tolist()]

    def feed(self, ep: Episode, new: Sequence[int]) -> str:
        """Report `new` tokens to `ep` until it stops, calls or runs out: its last action."""
        action = "continue"
        for token in new:
            turn, eos = [*ep.turn_tokens, token], token in self.eos
            stopped = not eos and self._stop.hit(turn)
            call, query = None, ""
            if not (eos or stopped) and self._call.hit(turn):
                assert self.fmt is not None
                call, query = turn_action(self.tokenizer.decode(turn), self.fmt)
            action = ep.sampled(token, 0.0, eos=eos, stopped=stopped, call=call)
            if action == "call":
                ep.ask(query)
            if action != "continue":
                return action
        raise RuntimeError("generate ended a sample its episode did not end (stopping rules out of step)")

    async def run(
        self, prompts: Sequence[Sequence[int]], k: int, on_group: Callable[[int], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> list[list[HfCompletion]]:
        episodes = [[self.new_episode() for _ in range(k)] for _ in prompts]
        finished = 0
        total = len(prompts) * k * self.max_tokens

        def tell() -> None:
            nonlocal finished
            if on_progress is not None:
                on_progress(self.budget_done(episodes), total)
            if on_group is not None and (now := _finished_groups(episodes)) > finished:
                finished = now
                on_group(finished)

        active = [(p, ep) for p, group in enumerate(episodes) for ep in group]
        while active:
            calls = []
            for start in range(0, len(active), self.max_batch):
                chunk = active[start : start + self.max_batch]
                histories = [[*prompts[p], *ep.tokens] for p, ep in chunk]
                news = await asyncio.to_thread(self._generate, histories, max(ep.turn_left for _, ep in chunk))
                for (p, ep), new in zip(chunk, news, strict=True):
                    if self.feed(ep, new) in ("call", "invalid"):
                        calls.append((p, ep))
                tell()
            await asyncio.gather(*(self._answer(ep) for _, ep in calls))
            active = [(p, ep) for p, ep in calls if ep.finish is None]
            tell()
        return [[self._completion(ep) for ep in group] for group in episodes]

    def budget_done(self, episodes: Sequence[Sequence[Episode]]) -> int:
        """Budget tokens done: each sample's tokens, a finished one's whole budget."""
        return sum(self.max_tokens if ep.finish is not None else len(ep.tokens) for group in episodes for ep in group)

    async def _answer(self, ep: Episode) -> None:
        assert self.fmt is not None and self.tool is not None
        if ep.pending == "invalid":
            ep.observe(invalid_action_tokens(self.fmt, self._encode, self.stop))
            return
        output = await call_tool(self.tool, ep.query or "")
        ep.observe(observation_tokens(self.fmt, self._encode, output, self.stop))

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def _completion(self, ep: Episode) -> HfCompletion:
        assert ep.finish is not None
        text_tokens = ep.tokens[:-1] if ep.eos else ep.tokens
        return HfCompletion(tokens=tuple(ep.tokens), text=self.tokenizer.decode(text_tokens),
                            finish_reason=ep.finish, turns=ep.turns, tool_calls=ep.tool_calls,
                            invalid_actions=ep.invalid_actions)


async def hf_answer_prompts(
    model: Any, tokenizer: Any, task: Task, prompts: Sequence[Sequence[int]], *, temperature: float,
    max_tokens: int, k: int, stop: tuple[str, ...], seed: int | None = None, tool: Tool | None = None,
    max_batch: int = DEFAULT_MAX_BATCH, on_group: Callable[[int], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[list[HfCompletion]]:
    """k samples per prompt (token ids), in prompt order; a tool task needs its `tool`.
    `on_group(n)` as prompts' groups finish (`n` finished so far); `on_progress(done, total)` in
    budget tokens (module doc) after every `generate` call and tool answers, before `on_group`."""
    if task.tool_format is not None and tool is None:
        raise ValueError(f"task {task.name!r} uses a tool: give one to answer its calls")
    sampler = _Sampler(model, tokenizer, task, temperature=temperature, max_tokens=max_tokens, stop=stop,
                       seed=seed, tool=tool, max_batch=max_batch)
    return await sampler.run(prompts, k, on_group, on_progress)


def _finished_groups(episodes: Sequence[Sequence[Episode]]) -> int:
    return sum(all(ep.finish is not None for ep in group) for group in episodes)


__all__ = ["DEFAULT_MAX_BATCH", "HfCompletion", "default_device", "eos_ids", "hf_answer_prompts", "load_hf_model"]
