"""Rollout generation with MLX: G samples per prompt, with the logprobs the trainer recomputes.

Plain synchronous MLX code; one thread owns MLX and calls in here.

How the recorded logprobs are obtained
--------------------------------------
mlx-lm's generation logprobs are ``log_softmax`` of the logits it samples from, taken *before*
its sampler applies a temperature. So we never give mlx-lm a temperature: the model is wrapped so
its logits come out as ``float32(logits) / T`` (one batched op per step, unlike a per-sequence
logits processor, which mlx-lm's batch path applies row by row in Python), and we sample with
temperature 1 and top_p 1 from those. The logprob mlx-lm reports for the sampled token is then
exactly ``log_softmax(logits / T)[token]``, computed in float32, which is what the trainer
recomputes (`teacher_forced_logprobs` is the same computation as one full forward pass).

Batching
--------
Sequences run through mlx-lm's `BatchGenerator` (continuous batching; `max_batch` bounds how
many decode at once). `ContinuousGenerator` keeps one alive for as long as the worker runs:
groups of G samples are inserted while others decode, and queued sequences take the slots of
finished ones, so the batch stays full however the response lengths vary (`generate_groups`
is one batch of groups through it). With ``share_prefill`` (the default) each prompt is
prefilled once and its KV cache handed to the G sequences of its group, so the prompt is not
recomputed G times.

Stopping
--------
* EOS (any of ``tokenizer.eos_token_ids``): finish ``"stop"``. The EOS token *is* kept at the
  end of ``tokens`` with its logprob (the trainer trains on it: that is how the policy learns to
  stop), but it is not part of ``text``.
* A stop string: matched on the decoded text, so it is found however the model happened to
  tokenize it. ``tokens``/``logprobs`` end with the token that completes the first occurrence;
  finish ``"stop"``.
* ``max_tokens`` sampled tokens without either: finish ``"length"``.

``text`` is always ``tokenizer.decode(tokens)`` without a final EOS token, so anyone holding the
tokens (the trainer) derives the same text. After a stop string it may therefore hold the rest of
the last token's characters.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model as build_from_config
from mlx_lm.utils import load_tokenizer

from slime_stoa.tasks.episode import StopMatcher

from . import cpu_compute
from .cpu_fixes import fix_cpu_expert_matmul
from .hf_config import mlx_overrides
from .lfm2_fixes import fix_moe_routing

PREFILL_STEP = 2048  # prompt tokens per forward pass while prefilling

Model = nn.Module  # an mlx-lm model
Tokenizer = TokenizerWrapper


def load_model(folder: Path | str) -> tuple[Model, Tokenizer]:
    """(model, tokenizer) of an HF/MLX model folder, loaded lazily: the weights are only read
    when first used."""
    # (model, tokenizer) without return_config; transformers 5's rope keys as mlx-lm reads them
    loaded = mlx_lm.load(str(folder), lazy=True, model_config=mlx_overrides(_folder_config(folder)))
    apply_model_fixes(loaded[0], _folder_config(folder))
    if cpu_compute.float32_compute_wanted():  # as a bf16 worker computes here (an eval samples as it does)
        cpu_compute.use_float32_compute(loaded[0])
    if cpu_compute.float32_activations_wanted():  # a pre-quantized folder: as a plane worker computes here
        cpu_compute.use_float32_activations(loaded[0])
    return loaded[0], loaded[1]


def build_model(folder: Path | str) -> tuple[Model, Tokenizer]:
    """(model, tokenizer) of an HF/MLX model folder's config and tokenizer files, built by
    mlx-lm's own model classes (`mlx_lm.utils.load_model`), for weights the caller installs
    (`macd.weights.LiveWeights.from_state`). Its parameters are bf16 placeholders never computed
    (MLX is lazy); a folder without weight files is enough. Weight files, if any, are not read:
    mapped lazily, they only shape a pre-quantized folder's layers."""
    path = Path(folder)
    model, config = build_from_config(path, lazy=True, strict=False, model_config=mlx_overrides(_folder_config(path)))
    model.set_dtype(mx.bfloat16)  # what the bf16 master's tensors are, so they fit
    apply_model_fixes(model, config)
    return model, load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))


def apply_model_fixes(model: Model, config: dict[str, Any]) -> list[str]:
    """Make an mlx-lm model compute what the trainer's transformers model does where this mlx-lm
    release differs (`macd.lfm2_fixes`: LFM2-MoE routing in mlx-lm 0.31.x), and run where this
    MLX backend cannot (`macd.cpu_fixes`: bf16 experts on the CPU); the fixes applied."""
    fixes = ["lfm2_moe routing"] if fix_moe_routing(model, config) else []
    return fixes + (["float32 experts on the CPU"] if fix_cpu_expert_matmul(model) else [])


def _folder_config(folder: Path | str) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        return {}
    config: dict[str, Any] = json.loads(path.read_text())
    return config


def release_freed_buffers() -> None:
    """Hand the buffers MLX keeps for reuse back to the system (`mx.clear_cache`; mlx-lm does so
    every 512 decode steps). The worker calls it when groups finish (`macd.mlx_thread.MemoryReleaser`),
    so its memory is the weights and the live KV cache, not also the KV buffers of sequences
    that ended; the next steps refill the cache with what one step needs."""
    mx.clear_cache()


class GenerationCancelled(Exception):
    """`generate_groups` was told to stop; its partial cohort is dropped."""


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How to sample a group. top_p is always 1.0 so the trainer can recompute logprobs."""

    temperature: float
    max_tokens: int
    group_size: int
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclass(frozen=True)
class Completion:
    """One sampled response.

    `tokens` (int32) are the sampled ids, ending with the EOS token when the model stopped by
    itself; `logprobs` (float32, same length) is ``log_softmax(logits / T)`` at each sampled
    token; `finish_reason` is "stop" (EOS or stop string) or "length"; `text` is the decoded
    tokens without a final EOS.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    finish_reason: str
    text: str


class _TemperedModel:
    """A model whose logits come out as ``float32(logits) / temperature``.

    Everything else (``layers``, ``make_cache``, ...) is the wrapped model's, so mlx-lm builds
    the same caches for it.
    """

    def __init__(self, model: Any, temperature: float) -> None:
        self.model = model
        self.temperature = temperature

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        return tempered(self.model(inputs, cache=cache, **kwargs), self.temperature)

    def __getattr__(self, name: str) -> Any:
        if name in ("model", "temperature"):  # not set yet (e.g. while copying)
            raise AttributeError(name)
        return getattr(self.model, name)


def tempered(logits: mx.array, temperature: float) -> mx.array:
    """The logits the recorded logprobs are a log_softmax of: float32, divided by T."""
    return logits.astype(mx.float32) / temperature


class _KeyedSampler:
    """Categorical sampling at temperature 1 from its own PRNG key (global MLX state untouched)."""

    def __init__(self, seed: int | None) -> None:
        self.key = mx.random.key(secrets.randbits(63) if seed is None else seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs, axis=-1, key=sub)


def _as_wrapper(tokenizer: Any) -> TokenizerWrapper:
    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def _prefill(model: Any, tokens: Sequence[int]) -> list[Any]:
    """A fresh KV cache holding `tokens`."""
    cache = make_prompt_cache(model)
    for start in range(0, len(tokens), PREFILL_STEP):
        model(mx.array(list(tokens[start : start + PREFILL_STEP]))[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


# -- the parts every generator of groups shares (this module's and `macd.episodes`') ----------------
def _batch_generator(model: Any, config: SamplingConfig, eos: set[int], *, max_batch: int) -> BatchGenerator:
    """The long-lived mlx-lm `BatchGenerator` of a generator of groups: tempered logits, sampled at
    temperature 1 from the config's seed, EOS the only stop sequences, `max_batch` decoding at once."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return BatchGenerator(
        _TemperedModel(model, config.temperature),  # type: ignore[arg-type]  # a callable wrapper is all it needs
        max_tokens=config.max_tokens,
        stop_tokens=[[e] for e in sorted(eos)],
        sampler=_KeyedSampler(config.seed),
        completion_batch_size=max_batch,
        prefill_batch_size=max_batch,
    )


def _insert_group(gen: BatchGenerator, model: Any, prompt: Sequence[int], size: int, *, share_prefill: bool) -> list[int]:
    """Queue `size` sequences of `prompt` (token ids) in `gen`; their uids. With `share_prefill`
    the prompt (but its last token) is prefilled once, with the weights of this moment, and the
    cache handed to every sequence (merged, i.e. copied, into the batch, so shareable)."""
    tokens = [int(t) for t in prompt]
    if not tokens:
        raise ValueError("prompts must be non-empty")
    if share_prefill:
        cache = _prefill(model, tokens[:-1])
        return list(gen.insert([[tokens[-1]]] * size, caches=[cache] * size))
    return list(gen.insert([tokens] * size))


def _room(capacity: int, sequences: int, group_size: int) -> int:
    """Groups to insert to keep `capacity` sequences decoding with one queued behind them."""
    return max(0, -(-(capacity + 1 - sequences) // group_size))


def _batch_size(prompts: int, group_size: int, max_batch: int | None) -> int:
    """Sequences to decode together for `prompts` groups: all of them, or at most `max_batch`."""
    n = prompts * group_size
    return n if max_batch is None else max(1, min(max_batch, n))


def _picked_logprobs(responses: Sequence[Any]) -> list[float]:
    """The logprob of each response's sampled token: one gather for the step, not one sync each."""
    picked: list[float] = mx.stack([r.logprobs[r.token] for r in responses]).tolist()  # type: ignore[assignment]
    return picked


def _text_tokens(tokens: list[int], eos: bool, eos_ids: set[int]) -> list[int]:
    """The tokens a completion's text decodes: all but a final EOS token."""
    return tokens[:-1] if eos and tokens and tokens[-1] in eos_ids else tokens


@dataclass
class _Track:
    """A sequence being generated."""

    tokens: list[int]
    logprobs: list[float]
    finish: str | None = None
    eos: bool = False


@dataclass(frozen=True)
class FinishedGroup:
    """A group whose G samples all finished, with the tag it was inserted with."""

    tag: Any
    completions: list[Completion]


@dataclass
class _Group:
    tag: Any
    uids: list[int]
    left: int  # samples not finished yet


class Generator(Protocol):
    """A generator of groups the worker's generation loop drives: `ContinuousGenerator`, or for a
    tool task `macd.episodes.EpisodeGenerator` (`ToolGenerator`). Groups carry the tag they were
    inserted with; call every method on the thread that owns MLX."""

    steps: int  # decode steps taken
    tokens: int  # tokens sampled (dropped groups' included)
    tokens_dropped: int  # sampled for groups `discard` dropped

    @property
    def groups(self) -> int: ...  # groups not finished (running or queued)

    @property
    def sequences(self) -> int: ...  # sequences not finished

    @property
    def cache_bytes(self) -> int: ...  # bytes of KV cache held

    def room(self, capacity: int) -> int: ...  # groups to insert to keep `capacity` sequences busy

    def tags(self) -> list[Any]: ...  # the unfinished groups' tags, in insertion order

    def insert(self, prompt: Sequence[int], tag: Any = None) -> None: ...

    def step(self) -> list[FinishedGroup]: ...

    def advance(self, max_steps: int, interrupt: threading.Event | None = None) -> tuple[list[FinishedGroup], int]: ...

    def quiesce(self) -> list[Any]: ...  # drop every unfinished group so the weights may change; their tags

    def discard(self) -> list[Any]: ...

    def close(self) -> None: ...


class _Unfinished(Protocol):
    tag: Any
    left: int  # sequences not finished yet


G = TypeVar("G", bound=_Unfinished)


class _GroupBatch(Generic[G]):
    """What every generator of groups (`ContinuousGenerator`, `macd.episodes.EpisodeGenerator`)
    keeps alike: its unfinished groups in insertion order, each with its tag and its count of
    unfinished sequences, decoded by one long-lived `BatchGenerator`."""

    config: SamplingConfig
    _gen: BatchGenerator
    _groups: dict[int, G]

    @property
    def groups(self) -> int:
        """Groups not finished (running or queued)."""
        return len(self._groups)

    @property
    def sequences(self) -> int:
        """Sequences not finished (running or queued)."""
        return sum(g.left for g in self._groups.values())

    def room(self, capacity: int) -> int:
        """How many groups to insert now to keep `capacity` sequences decoding with one group
        queued behind them, so a slot freed by a finished sample is taken at the next step."""
        return _room(capacity, self.sequences, self.config.group_size)

    def tags(self) -> list[Any]:
        """The tags of the unfinished groups, in insertion order."""
        return [g.tag for g in self._groups.values()]

    def step(self) -> list[FinishedGroup]:
        raise NotImplementedError

    def _can_step(self) -> bool:
        """Whether a decode step can make progress now (a subclass may have nothing to decode
        while groups are unfinished)."""
        return True

    def advance(self, max_steps: int, interrupt: threading.Event | None = None) -> tuple[list[FinishedGroup], int]:
        """Decode up to `max_steps` steps, returning after the first step that finished a group,
        at which `interrupt` is set (checked every step), or once `_can_step` says no:
        (finished groups, steps taken)."""
        finished: list[FinishedGroup] = []
        steps = 0
        while self._groups and steps < max_steps and not finished and self._can_step():
            finished = self.step()
            steps += 1
            if interrupt is not None and interrupt.is_set():
                break
        return finished, steps

    def discard(self) -> list[Any]:
        raise NotImplementedError

    def quiesce(self) -> list[Any]:
        """`discard` every unfinished group, so the weights may change; the dropped groups' tags.

        A decode step mlx-lm already started may still be computing, reading the weights while
        they change: its results belong to the dropped sequences and are never read. Everything
        computed for a group inserted afterwards (its prefill, every decode step) is issued after
        the change. So there is no wait here for the step under way (up to a whole decode step)."""
        return self.discard()

    def close(self) -> None:
        self.discard()
        self._gen.close()


class ContinuousGenerator(_GroupBatch[_Group]):
    """Groups of G samples decoded by one long-lived mlx-lm `BatchGenerator` (continuous batching).

    `insert` queues a prompt's group: with ``share_prefill`` the prompt is prefilled once (with
    the weights of that moment) and its KV cache handed to its G sequences. `step` decodes one
    token of every running sequence; as sequences finish, queued ones take their places, so the
    batch stays full while there is work. `discard` drops every unfinished group (queued ones
    included): before the weights change, since a sequence must be generated by one version
    from its prefill to its last token for its logprobs to be that version's.

    mlx-lm's decode is pipelined (each step already starts computing the next token), so weights
    may only change once `discard` (or `quiesce`) left nothing in flight.
    Plain synchronous MLX code: call it only from the thread that owns MLX.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: SamplingConfig,
        *,
        max_batch: int,
        share_prefill: bool = True,
    ) -> None:
        self.model = model
        self.config = config
        self.share_prefill = share_prefill
        self.tokenizer = _as_wrapper(tokenizer)
        self._eos = set(self.tokenizer.eos_token_ids)
        self._gen = _batch_generator(model, config, self._eos, max_batch=max_batch)
        self._stop = StopMatcher(self.tokenizer, config.stop)
        self._groups: dict[int, _Group] = {}  # insertion order
        self._owner: dict[int, int] = {}  # sequence uid -> group id
        self._tracks: dict[int, _Track] = {}
        self._next_group = 0
        self.steps = 0  # decode steps taken
        self.tokens = 0  # tokens sampled (dropped groups' included)
        self.tokens_dropped = 0  # sampled for groups `discard` dropped

    @property
    def cache_bytes(self) -> int:
        """Bytes of KV cache held (running and queued sequences)."""
        return int(self._gen.prompt_cache_nbytes)

    def insert(self, prompt: Sequence[int], tag: Any = None) -> None:
        """Queue a group of `config.group_size` samples of `prompt` (token ids)."""
        uids = _insert_group(self._gen, self.model, prompt, self.config.group_size, share_prefill=self.share_prefill)
        gid = self._next_group
        self._next_group += 1
        self._groups[gid] = _Group(tag, uids, len(uids))
        for uid in uids:
            self._owner[uid] = gid
            self._tracks[uid] = _Track([], [])

    def step(self) -> list[FinishedGroup]:
        """One decode step; the groups it finished, in the order they finished."""
        responses = self._gen.next_generated()
        if not responses:
            if self._groups:
                raise RuntimeError("generation ended with unfinished sequences")
            return []
        self.steps += 1
        self.tokens += len(responses)
        stopped, done = [], []
        for r, lp in zip(responses, _picked_logprobs(responses), strict=True):
            t = self._tracks[r.uid]
            t.tokens.append(r.token)
            t.logprobs.append(lp)
            if r.finish_reason == "stop":  # mlx-lm's only stop sequences are the EOS tokens
                t.finish, t.eos = "stop", True
            elif self._stop.hit(t.tokens):
                t.finish = "stop"
                if r.finish_reason is None:
                    stopped.append(r.uid)
            elif r.finish_reason is not None:
                t.finish = "length"
            if t.finish is not None:
                group = self._groups[self._owner[r.uid]]
                group.left -= 1
                if not group.left:
                    done.append(self._owner[r.uid])
        if stopped:
            self._gen.remove(stopped)
        return [self._pop(gid) for gid in done]

    def _pop(self, gid: int) -> FinishedGroup:
        group = self._groups.pop(gid)
        completions = []
        for uid in group.uids:
            del self._owner[uid]
            completions.append(_completion(self.tokenizer, self._tracks.pop(uid), self._eos))
        return FinishedGroup(group.tag, completions)

    def discard(self) -> list[Any]:
        """Drop every unfinished group; their tags, in insertion order."""
        uids = [uid for g in self._groups.values() for uid in g.uids if self._tracks[uid].finish is None]
        self.tokens_dropped += sum(len(self._tracks[uid].tokens) for g in self._groups.values() for uid in g.uids)
        if uids:
            self._gen.remove(uids)
        tags = [g.tag for g in self._groups.values()]
        self._groups.clear()
        self._owner.clear()
        self._tracks.clear()
        return tags


def generate_groups(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    *,
    max_batch: int | None = None,
    share_prefill: bool = True,
    cancel: threading.Event | None = None,
    on_group: Callable[[int], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[list[Completion]]:
    """Sample `config.group_size` completions for each prompt (token ids), batched.

    Returns one list of G completions per prompt, in prompt order. `max_batch` bounds the
    number of sequences decoded together (default: all B*G at once). Deterministic for a given
    `config.seed`, model, prompts and batch settings. Setting `cancel` (from any thread) ends
    generation at the next decode step with `GenerationCancelled`. `on_group(n)` is called as
    each prompt's group finishes, `n` the groups finished so far.

    `on_progress(done, total)` counts the token budget: `total` is B * G * `config.max_tokens`,
    `done` the tokens sampled so far plus the unused budget of every sample already finished.
    It is called once before the first decode step (``done`` 0) and after every step (after
    that step's `on_group` calls), never goes back, and ends at exactly `total`. The rest of the
    budget (`total - done`) bounds the tokens still to sample, so a time left estimated from its
    rate is an upper bound (samples that stop early finish sooner than their budget says).
    """
    prompts = [[int(t) for t in p] for p in prompts]
    if any(not p for p in prompts):
        raise ValueError("prompts must be non-empty")
    if not prompts:
        return []
    budget = config.max_tokens
    total = len(prompts) * config.group_size * budget
    batch = _batch_size(len(prompts), config.group_size, max_batch)
    gen = ContinuousGenerator(model, tokenizer, config, max_batch=batch, share_prefill=share_prefill)
    done: dict[int, list[Completion]] = {}
    spare = 0  # the unused budget of the samples of finished groups
    told = 0  # the last `done` told to on_progress
    try:
        if on_progress is not None:
            on_progress(0, total)
        for i, p in enumerate(prompts):
            gen.insert(p, i)
        while gen.groups:
            for group in gen.step():
                done[group.tag] = group.completions
                spare += sum(budget - len(c.tokens) for c in group.completions)
                if on_group is not None:
                    on_group(len(done))
            if on_progress is not None:
                # finished samples of unfinished groups: their tracks are still held
                waiting = sum(budget - len(t.tokens) for t in gen._tracks.values() if t.finish is not None)
                told = max(told, min(total, gen.tokens + spare + waiting))
                on_progress(told, total)
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("generation cancelled")
    finally:
        gen.close()
    return [done[i] for i in range(len(prompts))]


def _completion(tok: TokenizerWrapper, t: _Track, eos: set[int]) -> Completion:
    if t.finish is None:
        raise RuntimeError("generation ended with an unfinished sequence")
    tokens = np.array(t.tokens, dtype=np.int32)
    logprobs = np.array(t.logprobs, dtype=np.float32)
    return Completion(tokens, logprobs, t.finish, tok.decode(_text_tokens(t.tokens, t.eos, eos)))


def teacher_forced_logprobs(
    model: Any,
    prompt_tokens: Sequence[int],
    response_tokens: Sequence[int],
    temperature: float,
) -> np.ndarray:
    """``log_softmax(logits / T)`` at each response token, from one forward pass (float32)."""
    prompt, response = [int(t) for t in prompt_tokens], [int(t) for t in response_tokens]
    if not prompt:
        raise ValueError("prompt_tokens must be non-empty")
    if not response:
        return np.zeros(0, dtype=np.float32)
    inputs = mx.array(prompt + response[:-1])[None]
    logits = tempered(model(inputs)[0, len(prompt) - 1 :], temperature)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logprobs, mx.array(response)[:, None], axis=-1)[:, 0]
    return np.array(picked, dtype=np.float32)
