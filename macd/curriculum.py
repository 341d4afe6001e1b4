"""Which prompts a worker draws, and which finished groups it keeps: the run's dynamic sampling.

Pure policy, no IO. Two options of the run manifest drive it:

- ``dynamic_sampling``: a group whose rewards are all equal carries no GRPO signal (every
  advantage is zero), so the trainer would drop it; the worker does not upload it
  (`has_signal`) and counts it instead.
- ``skip_solved_after`` (N > 0): once a prompt's last N groups on this worker were all correct
  (every sample earned the full reward), the worker stops drawing it, a small curriculum that
  spends Mac time on prompts the policy still gets wrong. When every prompt is solved the worker
  draws from all of them again rather than stop.

Prompts are drawn from a shuffled deck: each prompt once per pass, a new order every pass, so
the groups in flight at one time are distinct prompts whenever the task has enough of them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from slime_stoa.tasks import TaskItem

#: A task's reward for a correct sample (rewards lie in [0, 1]).
CORRECT = 1.0


def has_signal(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ (otherwise every GRPO advantage is zero)."""
    return len(set(rewards)) > 1


def all_correct(rewards: Sequence[float]) -> bool:
    return bool(rewards) and all(r >= CORRECT for r in rewards)


class PromptPicker:
    """Draws task items one at a time, skipping the solved ones (see the module docstring)."""

    def __init__(self, items: Sequence[TaskItem], rng: random.Random, *, skip_solved_after: int = 0):
        if not items:
            raise ValueError("a task needs at least one prompt")
        if skip_solved_after < 0:
            raise ValueError(f"skip_solved_after must be >= 0, got {skip_solved_after}")
        self.items = tuple(items)
        self.rng = rng
        self.skip_solved_after = skip_solved_after
        self._streak: dict[int, int] = {}  # item index -> consecutive all-correct groups
        self._solved: set[int] = set()
        self._deck: list[TaskItem] = []

    @property
    def solved(self) -> int:
        """Prompts no longer drawn."""
        return len(self._solved)

    def draw(self) -> TaskItem:
        """The next prompt: the deck's next unsolved item (a fresh shuffled pass when it runs out)."""
        while True:
            if not self._deck:
                live = [i for i in self.items if i.index not in self._solved] or list(self.items)
                self._deck = self.rng.sample(live, len(live))
            item = self._deck.pop()
            if item.index not in self._solved or len(self._solved) == len(self.items):
                return item

    def record(self, item: TaskItem, rewards: Sequence[float]) -> None:
        """Note a finished group of `item`."""
        if not self.skip_solved_after:
            return
        streak = self._streak.get(item.index, 0) + 1 if all_correct(rewards) else 0
        self._streak[item.index] = streak
        if streak >= self.skip_solved_after:
            self._solved.add(item.index)
