"""`stoa quickstart --task search`: a retrieval task where searching is necessary.

The data is `tasks.search.synthetic`: questions about made-up entities ("What is the code word of
Vekoral?") whose answers are stated only in one passage of the corpus, so the answer cannot be
guessed and a query naming the entity is needed to find it. The run's task data and BM25 index
are written as `stoa task prepare search` writes them (`prepare_search`); a held-out `test`
split (questions never trained on, their passages in the same corpus) is what eval pass@1 reads.

The tiny model's tokenizer is trained on the task's own text, with the tool tags added as whole
tokens. The warm start (`warm_start_search`) is partial on purpose. It teaches, on every train
question, the mechanics: how to write a query (the entity's name, copied from the question) and
how to read the answer off an observation (the value after "is", copied into the answer tags).
But it teaches the first move, search or answer, as a coin that searches only
`SEARCH_SHARE` of the time and otherwise answers at once, without looking anything up
(`GUESS`, never right). RL has to learn that searching pays: the search rate and with it the reward
start low and climb.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import PreconditionFailed, Store
from slime_stoa.tasks.base import TaskItem
from slime_stoa.tasks.objects import put_task_objects
from slime_stoa.tasks.search.formats import SearchTags
from slime_stoa.tasks.search.rewards import decode_label
from slime_stoa.tasks.search.synthetic import generate, task_items
from slime_stoa.tasks.search.task import Search

from .meter import StepMeter
from .seeding import tiny_family_model
from .warmstate import WarmState, run_warm_steps

#: Task meta: one passage per search, one search per episode (a second call ends it, "turns"),
#: no system prompt (the tiny model learns the tool format from the warm start, not from prose).
SEARCH_META: Mapping[str, Any] = {"top_k": 1, "max_searches": 1, "system_prompt": None}
QUESTIONS = 400  # questions generated (corpus: 4 passages each, 3 of them distractors)
TEST_QUESTIONS = 64  # the last ones: the held-out `test` split
DATA_SEED = 11
SEARCH_SHARE = 0.15  # warm start: share of first moves that search (the rest guess)
GUESS = "unknown"  # warm start: the answer given at once, without searching (never right)
TAGS = SearchTags()
TOOL_TOKENS = tuple(TAGS.open(k) for k in ("search", "information", "answer")) + tuple(
    TAGS.close(k) for k in ("search", "information", "answer")
)


@dataclass(frozen=True, kw_only=True)
class SearchData:
    """The corpus and the questions of the quickstart's search task.

    - `passages`: the whole corpus (every question's passage and the distractors).
    - `train`, `test`: the question splits (workers draw from `train`; eval reads `test`).
    """

    passages: tuple[str, ...]
    train: tuple[TaskItem, ...]
    test: tuple[TaskItem, ...]


def search_data(seed: int = DATA_SEED) -> SearchData:
    """The quickstart's search data (deterministic)."""
    data = generate(QUESTIONS, seed=seed)
    items = task_items(data)
    cut = len(items) - TEST_QUESTIONS
    test = tuple(replace(item, index=i) for i, item in enumerate(items[cut:]))
    return SearchData(passages=data.passages, train=tuple(items[:cut]), test=test)


def entity(question: str) -> str:
    """The entity a synthetic question asks about ("What is the X of Name?" -> "Name")."""
    return question.rsplit(" of ", 1)[1].rstrip("?")


def answer_of(item: TaskItem) -> str:
    return decode_label(item.label)[0]


def query_text(item: TaskItem) -> str:
    """A demonstrated call: the entity's name with the space it has in the question, so that its
    tokens are the question's (the model copies them)."""
    return f"{TAGS.open('search')} {entity(item.prompt)}{TAGS.close('search')}"


def answer_text(value: str) -> str:
    """A demonstrated answer, with the space the value has in its passage (same tokens)."""
    return f"{TAGS.open('answer')} {value}{TAGS.close('answer')}"


def search_texts(data: SearchData) -> list[str]:
    """Text to train the tiny tokenizer on: passages, questions, the system prompt, demonstrations."""
    task = Search([], meta=dict(SEARCH_META))
    items = data.train + data.test
    texts = list(data.passages) + [i.prompt for i in items] + ([task.system_prompt] if task.system_prompt else [])
    texts += [query_text(i) + answer_text(answer_of(i)) + answer_text(GUESS) for i in items]
    return texts


def tiny_search_model(folder: Path, data: SearchData, family: str = "qwen2", **kwargs: Any) -> Path:
    """A tiny model of `family` whose tokenizer was trained on the search task's text, tags as
    single tokens."""
    return tiny_family_model(folder, family, texts=search_texts(data), added_tokens=TOOL_TOKENS, **kwargs)


async def seed_search_run(
    store: Store,
    manifest: RunManifest,
    model_dir: Path,
    *,
    data: SearchData,
    publisher: PublisherConfig | None = None,
    key: SigningKey | None = None,
) -> Publisher:
    """`seeding.seed_run` for the search task: run.json, the index and the train and test splits
    (as `stoa task prepare search` writes them: put-if-absent, a rerun writes nothing new), then
    anchor v0 of `model_dir`; returns the publisher (a run that exists is resumed)."""
    from slime_stoa.tasks.search.prepare import prepare_search  # bm25s

    if key is not None and manifest.run_key is None:
        manifest = replace(manifest, run_key=key.public.to_text())
    with contextlib.suppress(PreconditionFailed):
        await store.put_if_absent(RunLayout(manifest.run).run_manifest, manifest.to_bytes(key))
    prepared = await prepare_search(
        store, manifest.run, {"train": data.train, "test": data.test}, data.passages, meta=dict(SEARCH_META)
    )
    await put_task_objects(store, manifest.run, "search", dict(prepared.objects), key=key)  # signed: its task manifest
    pub = Publisher(store, manifest.run, publisher or PublisherConfig(extras_dir=model_dir), key=key)
    if await pub.open() is None:
        await pub.publish(load_hf_state(model_dir))
    return pub


@dataclass(frozen=True)
class Demonstration:
    """The token ids of one train question's demonstration (see the module doc).

    - `prompt`: the question as the worker prompts it (chat template, system prompt).
    - `call`: the model's search call; `observation`: the tokens the worker forces after it.
    - `answer`: the right answer after the observation; `guess`: a wrong answer given at once.
    """

    prompt: np.ndarray
    call: np.ndarray
    observation: np.ndarray
    answer: np.ndarray
    guess: np.ndarray

    def pairs(self, search: bool) -> list[tuple[np.ndarray, np.ndarray]]:
        """(context, target) pairs of one supervised step. The first move is the coin: the call's
        first token (search) or the guess; the query and the answer after the observation are
        taught either way, with the observation as context only (never a target)."""
        first = self.call[:1] if search else self.guess
        seen = np.concatenate([self.prompt, self.call, self.observation])
        return [
            (self.prompt, first),
            (np.concatenate([self.prompt, self.call[:1]]), self.call[1:]),
            (seen, self.answer),
        ]


def demonstrations(tokenizer: Any, items: Sequence[TaskItem], passages: Sequence[str], work_dir: Path) -> list[Demonstration]:
    """A demonstration per item, its observation from a real BM25 index over `passages`, with the
    tokens the worker would force (`macd.episodes`: the tags around the cleaned output)."""
    from slime_stoa.tasks.prompting import prompt_tokens
    from slime_stoa.tasks.search.retriever import Retriever, build_index

    task = Search(items, meta=dict(SEARCH_META))
    fmt, cfg = task.tool_format, task.config
    assert fmt is not None
    folder = work_dir / "warm-start-index"
    retriever = Retriever.open(folder if folder.is_dir() else build_index(passages, folder))

    def ids(text: str) -> np.ndarray:
        return np.array(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)

    values = [answer_of(i) for i in items]
    out = []
    for n, item in enumerate(items):
        body = retriever.observe(" " + entity(item.prompt), k=cfg.top_k, max_chars=cfg.max_observation_chars)
        content = fmt.clean_output(body, max_chars=16 * fmt.max_observation_tokens, extra=Search.run_stop)
        observation = np.concatenate(
            [ids(fmt.observation_open), ids(content)[: fmt.max_observation_tokens], ids(fmt.observation_close)]
        )
        out.append(Demonstration(
            prompt=np.array(prompt_tokens(tokenizer, task, item), dtype=np.int64),
            call=ids(query_text(item)),
            observation=observation,
            answer=ids(answer_text(values[n])),
            guess=ids(answer_text(GUESS)),
        ))
    return out


def warm_start_search(learner: Any, model_dir: Path, work_dir: Path, data: SearchData, *, steps: int, lr: float,
                      rl_lr: float, seed: int, interrupt: Any = None, batch: int = 16, path: Path | None = None,
                      key: dict[str, Any] | None = None, meter: StepMeter | None = None,
                      on_resume: Callable[[WarmState], None] = lambda s: None) -> str:
    """Supervised steps on `demonstrations` of the train split (see the module doc); returns a
    one-line account. `interrupt` is checked before every step (`Interrupted`); `path`: where
    the warm start's state is saved and resumed from (`warmstate`, `key` naming this warm start);
    `meter` shows the steps."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    demos = demonstrations(tokenizer, data.train, data.passages, work_dir)
    rng = np.random.default_rng(seed)

    def step(_: int) -> float:
        picked = rng.choice(len(demos), size=min(batch, len(demos)), replace=False)
        pairs = [p for i in picked for p in demos[i].pairs(bool(rng.random() < SEARCH_SHARE))]
        return learner.supervised_step(pairs)

    # The steps run on the quickstart's one torch thread: the tiny model's matrices are too small
    # to gain from a second one, and on busy cores torch's threads spin waiting for each other
    # (measured on 2 loaded cores: 0.19 s a step on one thread, 1.5-6 s on two).
    for group in learner.optimizer.param_groups:
        group["lr"] = lr
    try:
        state = run_warm_steps(
            learner, steps=steps, step=step, rng=rng, path=path, key={"batch": batch, **(key or {})},
            check=interrupt.check if interrupt is not None else lambda: None, meter=meter, on_resume=on_resume,
        )
    finally:
        for group in learner.optimizer.param_groups:
            group["lr"] = rl_lr
    losses = state.losses
    start, end = (np.mean(losses[:10]), np.mean(losses[-10:])) if losses else (float("nan"),) * 2
    return (
        f"supervised warm start on search demonstrations: {state.step} steps, loss {start:.2f} -> {end:.2f} "
        f"(taught: the query and reading the answer; first move: search {SEARCH_SHARE:.0%}, else answer {GUESS!r} at once)"
    )


def warm_start_search_note(steps: int) -> str:
    """What the search warm start does, said before it starts."""
    return (
        f"supervised warm start on search demonstrations: {steps} steps (how to query and read the answer; "
        f"it searches on only {SEARCH_SHARE:.0%} of questions: RL has to learn that searching pays)"
    )


def search_rate(tool_calls: Iterable[int]) -> float:
    """Share of samples that called the tool at least once (NaN for none)."""
    calls = list(tool_calls)
    return sum(c > 0 for c in calls) / len(calls) if calls else float("nan")
