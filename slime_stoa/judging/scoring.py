"""Re-scoring: the trainer's own reward for every sample, from the decoded text and the label.

The worker's reward is never trusted. The completion text is derived exactly as workers derive
it (see `macd.generate`): the response tokens decoded with the run's tokenizer, special tokens
kept, minus one final end-of-sequence token when the sample stopped on it. The reward is the
run task's pure `reward(text, label)` for the label of the record's `prompt_index`.

The prompt is checked too: a record's `prompt_tokens` must be exactly the prompt workers build
for its `prompt_index` (`slime_stoa.tasks.prompting.prompt_tokens`, the chat template when the
tokenizer has one); otherwise a worker could pair one prompt's label with another prompt's text.

The decoder and the prompt builder are injectable (`decode(tokens) -> str`, `prompt_of(item) ->
tokens`): the trainer loads the run's tokenizer from the anchor's files (`load_tokenizer`,
`load_prompt_builder`), tests pass any tokenizer they like.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slime_stoa.protocol.records import RolloutGroup
from slime_stoa.protocol.validate import RecordRejected
from slime_stoa.tasks import Task, TaskItem

Decode = Callable[[Sequence[int]], str]
PromptOf = Callable[[TaskItem], Sequence[int]]


@dataclass(frozen=True, slots=True)
class Scored:
    item: TaskItem  # the task item of the record's prompt_index
    texts: tuple[str, ...]  # the decoded completion of each sample
    rewards: tuple[float, ...]  # the trainer's reward of each sample


@dataclass(frozen=True)
class Rescorer:
    """Recomputes rewards with the run's task and tokenizer."""

    task: Task
    decode: Decode
    eos_ids: frozenset[int] = frozenset()
    """Token ids that end a sequence; one final such token is not part of the text."""
    prompt_of: PromptOf | None = None
    """The prompt tokens of a task item, as workers build them; None: prompts are not checked."""
    _prompts: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)

    def expected_prompt(self, index: int) -> tuple[int, ...] | None:
        """The prompt tokens of item `index` (cached), or None when prompts are not checked."""
        if self.prompt_of is None:
            return None
        if index not in self._prompts:
            self._prompts[index] = tuple(int(t) for t in self.prompt_of(self.task.item(index)))
        return self._prompts[index]

    def completion_text(self, tokens: Sequence[int] | np.ndarray, finish_reason: str) -> str:
        ids = [int(t) for t in tokens]
        if finish_reason == "stop" and ids and ids[-1] in self.eos_ids:
            ids.pop()
        return self.decode(ids)

    def finish_problem(
        self, tokens: Sequence[int] | np.ndarray, finish_reason: str, text: str, group: RolloutGroup
    ) -> str | None:
        """Why a sample's finish reason contradicts its tokens, or None.

        The worker's rules (`macd.generate`): "stop" when it drew an EOS token (kept as the last
        token) or completed a stop string; "length" when it drew `max_tokens` tokens without
        either. The validator already refused "length" below the limit; here, with the
        tokenizer: a "stop" at the limit must end on an EOS token or hold a stop string, and a
        "length" must do neither. Skipped when the EOS ids are unknown (empty)."""
        if not self.eos_ids or len(tokens) == 0:
            return None
        ends_on_eos = int(tokens[-1]) in self.eos_ids
        has_stop = any(s in text for s in group.sampling.stop)
        if finish_reason == "length" and (ends_on_eos or has_stop):
            return "'length', but it ends on an EOS token or holds a stop string"
        if finish_reason == "stop" and len(tokens) >= group.sampling.max_tokens and not (ends_on_eos or has_stop):
            return "'stop' at max_tokens without an EOS token or a stop string"
        return None

    def score(self, group: RolloutGroup) -> Scored:
        """Rewards of a validated group; RecordRejected (`task`, `prompt_index`, `prompt`,
        `reward`, `finish_mismatch`) if the record names another task or an item that does not
        exist, carries another prompt than that item's, cannot be scored, or gives a finish
        reason its tokens contradict (`finish_problem`)."""
        if group.task_id != self.task.name:
            raise RecordRejected("task", f"record is for task {group.task_id!r}, the run's is {self.task.name!r}")
        if not 0 <= group.prompt_index < len(self.task):
            raise RecordRejected(
                "prompt_index", f"prompt_index {group.prompt_index} not in [0, {len(self.task)})"
            )
        item = self.task.item(group.prompt_index)
        expected = self.expected_prompt(group.prompt_index)
        if expected is not None and tuple(int(t) for t in group.prompt_tokens) != expected:
            raise RecordRejected(
                "prompt",
                f"prompt_tokens ({len(group.prompt_tokens)} tokens) are not the run's prompt for "
                f"prompt_index {group.prompt_index} ({len(expected)} tokens)",
            )
        texts, rewards = [], []
        for i, sample in enumerate(group.samples):
            try:
                text = self.completion_text(sample.response_tokens, sample.finish_reason)
                reward = float(self.task.reward(text, item.label))
            except Exception as exc:  # a decoder or task bug must not take the consumer down
                raise RecordRejected("reward", f"samples[{i}]: {type(exc).__name__}: {exc}") from exc
            if problem := self.finish_problem(sample.response_tokens, sample.finish_reason, text, group):
                raise RecordRejected("finish_mismatch", f"samples[{i}]: {problem}")
            if not math.isfinite(reward):
                raise RecordRejected("reward", f"samples[{i}]: task reward {reward} is not finite")
            texts.append(text)
            rewards.append(reward)
        return Scored(item=item, texts=tuple(texts), rewards=tuple(rewards))


def tokenizer_decode(tokenizer) -> Decode:
    """`decode` for a `tokenizers.Tokenizer`, keeping special tokens (as workers decode)."""

    def decode(tokens: Sequence[int]) -> str:
        return tokenizer.decode(list(tokens), skip_special_tokens=False)

    return decode


def eos_ids_of(folder: Path, tokenizer=None) -> frozenset[int]:
    """End-of-sequence ids named by an HF folder's config.json, generation_config.json and
    tokenizer_config.json (`eos_token`, looked up in `tokenizer`)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        doc = _read_json(folder / name)
        value = doc.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                ids.add(v)
    eos = _read_json(folder / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if tokenizer is not None and isinstance(eos, str):
        tid = tokenizer.token_to_id(eos)
        if tid is not None:
            ids.add(int(tid))
    return frozenset(ids)


def vocab_size_of(folder: Path) -> int | None:
    """The model's vocabulary (embedding rows) from an HF folder's config.json, if stated."""
    doc = _read_json(folder / "config.json")
    value = doc.get("vocab_size")
    if value is None and isinstance(doc.get("text_config"), dict):
        value = doc["text_config"].get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def load_tokenizer(folder: Path) -> tuple[Decode, frozenset[int]]:
    """(decode, eos ids) from an HF folder holding `tokenizer.json` (ValueError if it has none)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no tokenizer.json in {folder}: the trainer decodes completions with the run's tokenizer")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return tokenizer_decode(tokenizer), eos_ids_of(folder, tokenizer)


def load_prompt_builder(folder: Path, task: Task) -> PromptOf:
    """`prompt_of` for `task` from an HF tokenizer folder, with the chat template workers apply.

    Needs transformers (the trainer's extra; slime ships it)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ValueError(
            "checking record prompts needs transformers (pip install transformers); "
            "or turn the check off with verify_prompts=False (stoa_verify_prompts: false)"
        ) from exc
    from slime_stoa.tasks.prompting import prompt_tokens

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return lambda item: prompt_tokens(tokenizer, task, item)


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}
