"""Canaries: an undisclosed subset of the task's prompts on which a worker is held to strict checks.

Which prompts are canaries is a keyed HMAC-SHA256 of the task name and prompt index with a
trainer-side secret (`is_canary`): the subset is a fixed share (`rate`) of the prompts, the same
for every worker, and without the secret a worker cannot tell a canary from any other prompt
(the secret lives on the trainer's disk, `load_or_create_secret`, or only in memory; never in
the bucket). Every task here has labels, so every prompt's answer is known; a canary differs
only in how strictly its group is judged (`canary_problem`), and a failure is a strike against
the worker (`quarantine.Quarantine.observe_canary`) on top of the record being refused:

- rewards: each worker reward must equal the trainer's recomputation exactly (a normal group
  only counts a disagreement beyond `reward_tolerance`);
- logprobs: every sampled token's logprob must be <= 0 (`LOGPROB_TOLERANCE`: float32 rounding
  only), and the group's mean per-token logprob must be >= -(ln V + `LOGPROB_SLACK_NATS`), V the
  vocabulary. Why that band, whatever the temperature: the expected logprob of a token sampled
  from a distribution is minus its entropy, and a temperature only moves the entropy within
  [0, ln V]; so no temperature makes sampled tokens rarer than uniform on average (the slack
  covers the spread of a small group's mean). A worker that reports its tokens as less likely
  than that inflates the importance ratio p/mu. A tighter, temperature-aware check needs the
  trainer's own logprobs: when the learner measures the gap on a canary group
  (`RolloutConsumer.observe_logprob_gap` with its prompt index), a mean gap above
  `max_logprob_gap` is a strike too;
- format (off by default): at least `min_format_rate` of the samples' answers must parse in the
  task's format (`answer_parses`; a task without a known format is not checked). Off by
  default because a model early in training may not have the format yet (and a group of
  unparseable answers scores all zero and is filtered anyway).

`ConsumerConfig.canary` configures it (`CanaryConfig`); `rate` 0 turns canaries off.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slime_stoa.protocol.cli_fields import setting
from slime_stoa.protocol.records import RolloutGroup
from slime_stoa.protocol.signing import KeyFileError, read_private_file, write_private_file

SECRET_BYTES = 32
#: A canary's logprobs may exceed 0 by float32 rounding only (~1e-6 for logits around 30).
LOGPROB_TOLERANCE = 1e-5
#: How far below -ln V a canary group's mean per-token logprob may fall (see the module doc).
LOGPROB_SLACK_NATS = 1.0


@dataclass(frozen=True, kw_only=True)
class CanaryConfig:
    """Canary settings (`ConsumerConfig.canary`)."""

    rate: float = setting("Share of the task's prompts that are canaries, in [0, 1]; 0 turns canaries off.", 0.0)
    key_file: Path | None = setting(
        "A 0600 file holding the secret that picks the canaries (created if missing). None: a fresh "
        "secret in memory each time the consumer starts (the subset then changes with every restart).",
        None,
    )
    max_logprob_gap: float = setting(
        "Largest mean |trainer - worker| logprob per token (nats) the learner may measure on a canary "
        "group before it counts as failed.",
        0.1,
    )
    min_format_rate: float = setting(
        "Least share of a canary group's samples whose answer must parse in the task's format "
        "(`answer_parses`); 0 turns the format check off.",
        0.0,
    )

    def __post_init__(self) -> None:
        for name in ("rate", "min_format_rate"):
            value = getattr(self, name)
            if not _number(value) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
        if not (_number(self.max_logprob_gap) and self.max_logprob_gap > 0):
            raise ValueError(f"max_logprob_gap must be a number > 0, got {self.max_logprob_gap!r}")
        if self.key_file is not None and not isinstance(self.key_file, Path):
            raise ValueError(f"key_file must be a Path or None, got {self.key_file!r}")

    def secret(self) -> bytes:
        """The secret that picks the canaries: `key_file`'s (when set and canaries are on), else a
        fresh one."""
        return load_or_create_secret(self.key_file) if self.key_file is not None and self.rate > 0 else new_secret()


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def load_or_create_secret(path: Path) -> bytes:
    """The canary secret kept in `path` (a 0600 file, created with a fresh secret if missing).
    ValueError (`KeyFileError`) if the file is readable by others or not a secret of ours."""
    path = Path(path)
    if not path.exists():
        with contextlib.suppress(KeyFileError):  # created meanwhile by another process: read that one
            write_private_file(path, new_secret())
    secret = read_private_file(path)
    if len(secret) != SECRET_BYTES:
        raise KeyFileError(f"{path}: holds {len(secret)} bytes, a canary secret has {SECRET_BYTES}")
    return secret


def is_canary(secret: bytes, task: str, prompt_index: int, rate: float) -> bool:
    """Whether prompt `prompt_index` of `task` is a canary under `secret` at `rate`: the first 8
    bytes of HMAC-SHA256(secret, "stoa.canary/1|<task>|<index>") read as a fraction of 2**64."""
    if rate <= 0:
        return False
    if rate >= 1:
        return True
    mac = hmac.new(secret, f"stoa.canary/1|{task}|{prompt_index}".encode(), hashlib.sha256).digest()
    return int.from_bytes(mac[:8], "big") < rate * 2**64


def answer_parses(task: str, text: str) -> bool | None:
    """Whether `text` holds an answer in `task`'s format, or None for a task without a known
    format. synthetic: a single digit (end-of-text markers aside); gsm8k: an extractable number."""
    if task == "synthetic":
        from slime_stoa.tasks.synthetic import normalize_completion

        answer = normalize_completion(text)
        return len(answer) == 1 and answer.isdigit()
    if task == "gsm8k":
        from slime_stoa.tasks.gsm8k import extract_answer

        return extract_answer(text) is not None
    return None


def canary_problem(
    group: RolloutGroup,
    *,
    rewards: Sequence[float],
    texts: Sequence[str],
    vocab_size: int,
    config: CanaryConfig,
) -> str | None:
    """Why a canary group fails the strict checks (see the module doc), or None. `rewards` and
    `texts`: the trainer's rewards and decoded completions of its samples."""
    for i, (sample, reward) in enumerate(zip(group.samples, rewards, strict=True)):
        if float(sample.reward) != float(reward):
            return f"samples[{i}]: worker reward {sample.reward} is not the trainer's {reward}"
    total, tokens = 0.0, 0
    for i, sample in enumerate(group.samples):
        lp = np.asarray(sample.logprobs, dtype=np.float64)
        mask = getattr(sample, "mask", None)  # tool tokens (mask 0) are not sampled
        if mask is not None and len(mask) == len(lp):
            lp = lp[np.asarray(mask) == 1]
        if len(lp) and float(lp.max()) > LOGPROB_TOLERANCE:
            return f"samples[{i}]: a sampled token's logprob is {float(lp.max()):.3g} > 0"
        total += float(lp.sum())
        tokens += len(lp)
    floor = -(math.log(vocab_size) + LOGPROB_SLACK_NATS)
    if tokens and total / tokens < floor:
        return (
            f"mean logprob {total / tokens:.3g} per token is below {floor:.3g} (-ln V - {LOGPROB_SLACK_NATS:g}): "
            "tokens reported as less likely than uniform sampling"
        )
    if config.min_format_rate > 0:
        parsed = [answer_parses(group.task_id, t) for t in texts]
        if parsed and parsed[0] is not None:
            rate = sum(bool(p) for p in parsed) / len(parsed)
            if rate < config.min_format_rate:
                return f"{rate:.0%} of the answers parse, fewer than {config.min_format_rate:.0%}"
    return None


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
