"""A synthetic search task whose answers exist only in its corpus (pure and seeded).

Each question asks for an attribute of a made-up entity ("What is the code word of Entity
Vekoral?"); exactly one passage states it ("The code word of Vekoral is zumatiq."). The corpus also
holds distractor passages about other entities, so the answer cannot be guessed from the question
and a model must search. Entity names and values are random pronounceable words; every name and
every value is distinct within one generation, so each question has one right answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from slime_stoa.tasks.base import TaskItem
from slime_stoa.tasks.search.rewards import encode_label

ATTRIBUTES = ("code word", "home city", "favourite colour", "secret number", "mascot")
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "tr", "kl", "st")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")


@dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticQA:
    """One question with its answer and the position of the one passage that holds it."""

    question: str
    answer: str
    passage: int


@dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticSearchData:
    """A corpus (`passages`) and questions (`qa`) answerable only from it."""

    passages: tuple[str, ...]
    qa: tuple[SyntheticQA, ...]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))


def _fresh(rng: random.Random, used: set[str], syllables: int) -> str:
    while True:
        word = _word(rng, syllables)
        if word not in used:
            used.add(word)
            return word


def generate(count: int, *, seed: int, distractors: int = 3) -> SyntheticSearchData:
    """`count` questions and a corpus of `count * (1 + distractors)` passages, shuffled.

    Each question's entity has one gold passage; each distractor passage states a different
    attribute of another, unasked entity. Same arguments, same data."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be an int >= 1, got {count!r}")
    if isinstance(distractors, bool) or not isinstance(distractors, int) or distractors < 0:
        raise ValueError(f"distractors must be an int >= 0, got {distractors!r}")
    rng = random.Random(seed)
    used: set[str] = set()
    facts = []  # (entity, attribute, value, asked)
    for i in range(count * (1 + distractors)):
        entity = _fresh(rng, used, 3).capitalize()
        facts.append((entity, rng.choice(ATTRIBUTES), _fresh(rng, used, 3), i < count))
    order = list(range(len(facts)))
    rng.shuffle(order)
    passages = [""] * len(facts)
    qa = []
    for slot, i in enumerate(order):
        entity, attribute, value, asked = facts[i]
        passages[slot] = f"The {attribute} of {entity} is {value}. {entity} is listed in the registry."
        if asked:
            qa.append((i, SyntheticQA(question=f"What is the {attribute} of {entity}?", answer=value, passage=slot)))
    qa.sort(key=lambda pair: pair[0])
    return SyntheticSearchData(passages=tuple(passages), qa=tuple(q for _, q in qa))


def task_items(data: SyntheticSearchData) -> tuple[TaskItem, ...]:
    """The questions as search task items (label: the one answer, JSON-encoded)."""
    return tuple(TaskItem(index=i, prompt=q.question, label=encode_label(q.answer)) for i, q in enumerate(data.qa))
