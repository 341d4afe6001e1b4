"""MATH: competition problems (Hendrycks et al.) whose answer is the last ``\\boxed{}``.

The reward is 1.0 when the completion's last boxed answer is equivalent to the label, else 0.0.
Both are normalised with MATH's conventions (`math_answer.normalize`), then compared in order:

1. the same text: equivalent;
2. both exact numbers (``0.5``, ``\\frac{1}{2}``, ``1/2``): equal as fractions, or not;
3. either answer over the bounds of `math_answer.too_complex` (size, nesting, power towers, huge
   exponents or factorials): not equivalent, without computing anything;
4. otherwise symbolic equivalence by math-verify in a grading child process
   (`math_grader.MathGrader`), graded 0 when it gives no answer within its timeout.

So a reward never takes longer than the grader's timeout plus, once per child, its start-up, on any
thread. The reward is a function of the completion and the label only; a comparison that runs into
the timeout on a loaded machine can grade a correct answer 0 (a normal one takes milliseconds).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from slime_stoa.tasks.base import Task, TaskItem
from slime_stoa.tasks.math_answer import MAX_BOXED_SCAN_CHARS, as_number, last_boxed, normalize, too_complex
from slime_stoa.tasks.math_grader import MathGrader, default_grader

SYSTEM_PROMPT = (
    "Solve the math problem. Reason step by step, then write the final answer in \\boxed{}."
)
INSTALL_HINT = "the math task grades with math-verify: pip install 'math-verify>=0.9'"


def answers_equivalent(pred: str | None, label: str, grader: MathGrader | None = None) -> bool:
    """Whether the answer `pred` (a boxed answer's content) is equivalent to `label`."""
    if pred is None or not isinstance(label, str) or max(len(pred), len(label)) > MAX_BOXED_SCAN_CHARS:
        return False
    gold, guess = normalize(label), normalize(pred)
    if not guess:
        return False
    if gold == guess:
        return True
    gold_number, guess_number = as_number(gold), as_number(guess)
    if gold_number is not None and guess_number is not None:
        return gold_number == guess_number
    if too_complex(gold) or too_complex(guess):
        return False
    return (grader or default_grader()).equivalent(gold, guess)


class MathTask(Task):
    """MATH with a step-by-step system prompt; reward 1.0 iff the last boxed answer is the label."""

    name: ClassVar[str] = "math"
    default_system_prompt: ClassVar[str | None] = SYSTEM_PROMPT

    def __init__(
        self, items: Iterable[TaskItem], *, meta: Mapping[str, Any] | None = None, grader: MathGrader | None = None
    ) -> None:
        if importlib.util.find_spec("math_verify") is None:
            raise ValueError(INSTALL_HINT)
        super().__init__(items, meta=meta)
        self.grader = grader

    def reward(self, completion: str, label: str) -> float:
        try:
            return 1.0 if answers_equivalent(last_boxed(completion), label, self.grader) else 0.0
        except Exception:  # the reward never raises: an answer the grader chokes on scores 0
            return 0.0


__all__ = ["INSTALL_HINT", "SYSTEM_PROMPT", "MathTask", "answers_equivalent"]
