"""The quickstart's synthetic task: name the largest of a few distinct digits.

A prompt is ``"max 3 8 1 5"`` and its label ``"8"`` (``ops=("max", "min")`` mixes in
``"min 3 8 1 5"`` -> ``"1"``). The reward is exact match of the stripped completion, trailing
end-of-text markers allowed.

Why this task. The quickstart trains a tiny randomly-initialised Qwen2 (hidden 64-128, 2-4
layers, a ~512-token byte-level BPE) on CPU for minutes, after a short supervised warm start, and
must show the reward climb from a clear baseline to ~1.0:

- The answer is one token copied from the prompt (a Qwen2-style pre-tokenizer gives every digit
  its own token), so each prompt is a contextual bandit over the few digits shown and GRPO's
  credit assignment is trivial. The rule (attend to the largest digit) is shared by all prompts,
  so every group teaches every other, unlike addition, a 100-entry table to memorise, or "next
  letter", a 25-entry one: in a small trial (a 3-layer, hidden-96 Qwen2, 16 prompts x 8
  samples per step, plain group-normalised policy gradient) addition and "next letter" barely
  moved in 150-300 steps, while "max" rose from ~0.1 to 0.6-0.99 within ~300 steps (how far
  depended on the seed; at a learning rate of 1e-3 some runs fell back onto a favourite digit).
- The warm start teaches the format only: `warmup_pairs` pairs each prompt with a digit drawn at
  random from the digits it shows, so the model learns "answer with one shown digit, then stop"
  and nothing about which. The digits are distinct, so such a model scores 1/length in
  expectation (`baseline_reward`): 0.25 with the default 4 digits, inside the 0.05-0.3 band
  where most groups of 8 hold both a success and a failure, and far below the ~1.0 of a model
  that learned the rule. A model that learned only "answer with a digit" scores 0.1, and RL
  from there stalls near 0.4 on "always 9": the warm start must teach copying a shown digit
  (fresh random targets each step, not one memorisable target per prompt).
- The digits are uniform, so the answers are not: "9" is the answer 40% of the time with 4
  digits. That gives the policy an easy first step ("prefer larger digits") on the way to the
  rule, which a short quickstart run needs; it is also a plateau a badly tuned run can stall on.
  (A variant with uniform answers removed that step and, in the quickstart's 2.5-minute test,
  rose only from 0.05 to 0.10.)
- No system prompt by default and a few-token prompt keep sequences short, so CPU generation and
  training steps stay fast.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import ClassVar

from slime_stoa.tasks.base import Task, TaskItem

OPS = ("max", "min")
DEFAULT_LENGTH = 4
#: Markers a completion may end with when the end-of-text token is decoded into the text.
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "</s>")
MAX_COMPLETION_CHARS = 256  # longer completions cannot match a short label: skip the work


def _check_params(length: int, ops: tuple[str, ...]) -> None:
    if isinstance(length, bool) or not isinstance(length, int) or not 2 <= length <= 10:
        raise ValueError(f"length must be an int in 2..10 (distinct digits), got {length!r}")
    if not ops or any(op not in OPS for op in ops):
        raise ValueError(f"ops must be a non-empty tuple drawn from {OPS}, got {ops!r}")


def solve(op: str, digits: Iterable[int]) -> int:
    """The answer to ``op`` over `digits`."""
    return max(digits) if op == "max" else min(digits)


def generate_items(
    n: int, *, seed: int = 0, length: int = DEFAULT_LENGTH, ops: tuple[str, ...] = ("max",)
) -> tuple[TaskItem, ...]:
    """`n` items of `length` distinct digits each, drawn uniformly.

    Deterministic: the same arguments always give the same items (and `n` items are a prefix of
    `n + 1`).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    ops = tuple(ops)
    _check_params(length, ops)
    rng = random.Random(seed)
    items = []
    for i in range(n):
        op = ops[rng.randrange(len(ops))]
        digits = rng.sample(range(10), length)
        prompt = f"{op} " + " ".join(map(str, digits))
        items.append(TaskItem(index=i, prompt=prompt, label=str(solve(op, digits))))
    return tuple(items)


def parse_prompt(prompt: str) -> tuple[str, list[int]]:
    """(op, digits) of a synthetic prompt; ValueError if it is not one."""
    op, *rest = prompt.split(" ") if isinstance(prompt, str) else ("",)
    if op not in OPS or not rest or not all(len(d) == 1 and d in "0123456789" for d in rest):
        raise ValueError(f'not a synthetic prompt (expected e.g. "max 3 8 1"): {prompt!r:.80}')
    return op, [int(d) for d in rest]


def warmup_pairs(items: Iterable[TaskItem], *, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, target completion) pairs that teach the answer format and nothing else.

    Each target is a digit drawn at random from the prompt's digits, so a model fit to these
    pairs answers with one shown digit and stops, scoring `baseline_reward` on average. Apply the
    chat template to `Synthetic.messages(item)` (the prompt as the only user message) and append
    the end-of-turn token to the target.
    """
    rng = random.Random(seed)
    pairs = []
    for item in items:
        _, digits = parse_prompt(item.prompt)
        pairs.append((item.prompt, str(digits[rng.randrange(len(digits))])))
    return pairs


def baseline_reward(items: Iterable[TaskItem]) -> float:
    """Expected reward of a model that answers a uniformly random shown digit (format only)."""
    shares = []
    for item in items:
        _, digits = parse_prompt(item.prompt)
        shares.append(digits.count(int(item.label)) / len(digits))
    return sum(shares) / len(shares) if shares else 0.0


def normalize_completion(completion: str) -> str:
    """`completion` without surrounding whitespace and trailing end-of-text markers."""
    s = completion.strip()
    for _ in range(4):  # bounded: a few trailing markers at most
        for marker in END_MARKERS:
            if s.endswith(marker):
                s = s[: -len(marker)].rstrip()
                break
        else:
            break
    return s


class Synthetic(Task):
    """Exact-match task over short prompts; no system prompt by default."""

    name: ClassVar[str] = "synthetic"
    default_system_prompt: ClassVar[str | None] = None

    def reward(self, completion: str, label: str) -> float:
        if not isinstance(completion, str) or not isinstance(label, str):
            return 0.0
        if len(completion) > MAX_COMPLETION_CHARS + len(label):
            return 0.0
        return 1.0 if normalize_completion(completion) == label.strip() else 0.0
