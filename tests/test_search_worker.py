"""The search task through the real worker: multi-turn episodes, the BM25 retriever fetched from
the bucket, schema v2 records, and the consumer admitting them as masked samples.

A random tiny model almost never writes ``</search>``, so the model here is a scripted policy
built as real MLX weights (`scripted_model`): attention and MLP outputs are zeroed, so each next
token depends on the last token only, and the output head makes that a fixed chain. After the
prompt's last token (a newline) it writes ``<search>code word</search>`` or
``<answer>registry</answer>`` with probability 1/2 each; an observation also ends on a newline,
so after one it again searches or answers. Everything else is the real worker path: the run's
`Search` task and index from `prepare_search`, the registered `SearchTool`, `EpisodeGenerator`
on the MLX thread, tool calls on the asyncio side, spool, upload, consumer.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("bm25s")
tokenizers = pytest.importorskip("tokenizers")

from macd.config import DaemonConfig
from macd.worker import Worker, WorkerOptions
from slime_stoa.protocol.hf.folders import bf16_bits_to_f32, f32_to_bf16_bits, load_hf_state, save_hf_folder
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import Store
from slime_stoa.protocol.validate import RecordLimits, load_record
from slime_stoa.quickstart.seeding import synthetic_texts
from slime_stoa.quickstart.tiny_model import build_tiny_model
from slime_stoa.tasks import tools
from slime_stoa.tasks.episode import extract_query
from slime_stoa.tasks.objects import put_task_objects
from slime_stoa.tasks.prompting import prompt_tokens
from slime_stoa.tasks.search import Search
from slime_stoa.tasks.search.formats import format_search_r1
from slime_stoa.tasks.search.prepare import prepare_search
from slime_stoa.tasks.search.presets import TASK_PRESETS
from slime_stoa.tasks.search.retriever import Retriever, build_index
from slime_stoa.tasks.search.synthetic import generate, task_items
from slime_stoa.trainer.consumer import ConsumerConfig, RolloutConsumer, sample_fields

from .test_episodes import spans

RUN = "search-worker-test"
TAGS = ("<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>")
QUERY, ANSWER = "code word", "registry"
DATA = generate(12, seed=7)
META = {"top_k": 1, "max_searches": 2}  # 3 model turns at most
MAX_TOKENS = 96
_FORMAT = Search([], meta=META).tool_format
assert _FORMAT is not None
FORMAT = _FORMAT  # the run's tool format (the query is read between its search tags)


def scripted_model(folder: Path) -> Path:
    """A tiny Qwen2 (see the module doc) whose tokenizer has the search tags as added tokens."""
    texts = synthetic_texts(500) + list(DATA.passages) + [q.question for q in DATA.qa]
    build_tiny_model(folder, texts=texts, vocab_size=512, tie_word_embeddings=False)
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens(list(TAGS))
    tok.save(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = vocab
    (folder / "config.json").write_text(json.dumps(config))

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    (newline,) = ids("\n")
    # Search-R1's observation ends "\n\n": a token of several newlines starts a turn as one does
    also = [t for t in ids("\n\n") if t != newline]
    chains = [ids(f"<search>{QUERY}</search>"), ids(f"<answer>{ANSWER}</answer>")]
    tokens = [newline, *chains[0], *chains[1]]
    assert len(set(tokens + also)) == len(tokens) + len(also), "the script needs distinct tokens"
    state = {k: bf16_bits_to_f32(v) for k, v in load_hf_state(folder).items()}
    hidden = config["hidden_size"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = np.concatenate([state[name], np.zeros((vocab - len(state[name]), hidden), np.float32)])
    for name, w in state.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[:] = 0.0  # the residual stream is the last token's embedding
    embed, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    head[:] = 0.0
    slot = {t: i for i, t in enumerate(tokens)}  # each scripted token gets its own axis
    for t in tokens:
        embed[t] = 0.0
        embed[t, slot[t]] = 1.0
    for t in also:
        embed[t] = embed[newline]
    for chain in chains:
        prev = newline
        for t in chain:
            head[t, slot[prev]] = 8.0  # logit 64 after `prev` (RMSNorm scales the axis to 8)
            prev = t
    save_hf_folder({k: f32_to_bf16_bits(v) for k, v in state.items()}, folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return scripted_model(tmp_path_factory.mktemp("scripted") / "model")


class Recording:
    """Wraps the registered search tool: the queries it was asked, and whether it was prepared."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.prepared = inner, 0
        self.queries: list[str] = []

    async def prepare(self) -> None:
        await self.inner.prepare()
        self.prepared += 1

    async def __call__(self, query: str) -> str:
        self.queries.append(query)
        return await self.inner(query)


async def seed_search_run(store: Store, model_dir: Path, meta: dict[str, Any] = META,
                          max_tokens: int = MAX_TOKENS) -> RunManifest:
    """run.json, the search task with its index (as `stoa task prepare search` writes them), v0."""
    manifest = RunManifest(run=RUN, model="tiny", task="search", group_size=4, max_tokens=max_tokens,
                           temperature=1.0, stop=("</answer>",))
    await store.put(RunLayout(RUN).run_manifest, manifest.to_bytes())
    prepared = await prepare_search(store, RUN, {"train": task_items(DATA)}, DATA.passages, meta=meta)
    await put_task_objects(store, RUN, "search", dict(prepared.objects))
    pub = Publisher(store, RUN, PublisherConfig(extras_dir=model_dir))
    await pub.open()
    await pub.publish(load_hf_state(model_dir))
    return manifest


async def test_worker_runs_search_episodes_end_to_end(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlx_lm

    made: list[Recording] = []
    registered = tools._FACTORIES["search"]  # what macd registers at import

    def recording_factory(task: Any, ctx: tools.ToolContext) -> Recording:
        made.append(Recording(registered(task, ctx)))
        return made[-1]

    monkeypatch.setitem(tools._FACTORIES, "search", recording_factory)
    await seed_search_run(store, model_dir)
    data_dir, shared_dir = tmp_path / "data", tmp_path / "shared"
    monkeypatch.setenv("STOA_SHARED_DIR", str(shared_dir))  # the Mac's folder for its one copy of the index
    config = DaemonConfig(store=store_url, run=RUN, name="test-mac", worker_id="test-mac-5e4c11", data_dir=data_dir, batch=2)
    worker = Worker(config, store, WorkerOptions(seed=3, heartbeat_s=0.5, max_cohorts=2))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    assert await asyncio.wait_for(run, 120) == 0  # max_cohorts: 4 groups, then it stops
    layout = RunLayout(RUN)
    tok = mlx_lm.load(str(model_dir))[1]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    limits = RecordLimits(vocab_size=vocab, expected_group_size=4, max_turns=3)
    keys = [i.key async for i in store.list(layout.rollouts_prefix())]
    groups = [load_record(await store.get_bytes(k), limits) for k in keys]
    assert len(groups) == worker.groups_recorded == 4

    # The registered tool: built once, its index fetched from the bucket and opened before generating.
    (tool,) = made
    assert tool.prepared == 1 and [p.parent.parent.name for p in shared_dir.glob("search-index/sha256-*/manifest.json")] == ["search-index"]
    assert not (data_dir / "search-index").exists()
    reference = build_index(DATA.passages, tmp_path / "reference-index")
    body = Retriever.open(reference).observe(QUERY, k=META["top_k"], max_chars=1500)
    assert body.startswith("Doc 1: The code word of ")  # a real passage answers the scripted query
    observation = f"\n<information>{body}</information>\n"

    calls = 0
    shapes = set()
    for g in groups:
        assert g.task_id == "search" and g.sampling.stop == ("</answer>",)
        prompt_text = tok.decode(g.prompt_tokens.tolist())
        assert prompt_text.endswith("<|im_start|>assistant\n") and "search engine" in prompt_text
        for s in g.samples:
            tokens, mask = s.response_tokens.tolist(), s.mask
            runs = spans(mask)
            assert runs[0][0] == 1 and s.turns == sum(v for v, _, _ in runs)
            assert s.tool_calls == len(runs) - s.turns
            calls += s.tool_calls
            assert s.logprobs[mask == 0].view(np.uint32).tolist() == [0] * int((mask == 0).sum())  # +0.0 exactly
            # each coin flip (search or answer) is a logprob of log(1/2); the rest of the script is certain
            flips = [float(s.logprobs[start]) for v, start, _ in runs if v == 1]
            assert np.allclose(flips, np.log(0.5), atol=1e-2), flips
            for k, (v, start, end) in enumerate(runs):
                text = tok.decode(tokens[start:end])
                if v == 1 and k + 1 < len(runs):  # a model turn that called the tool
                    assert text == f"<search>{QUERY}</search>" and extract_query(text, FORMAT) == QUERY
                elif v == 0:  # exactly the observation the retriever gives (cut by the budget at the end)
                    assert text == observation or (end == len(tokens) and observation.startswith(text)), text
            last = tok.decode(tokens[runs[-1][1]:])
            shapes.add((s.finish_reason, s.tool_calls))
            if s.finish_reason == "stop":
                assert last == f"<answer>{ANSWER}</answer>" and s.reward == 0.0
            elif s.finish_reason == "turns":
                assert last == f"<search>{QUERY}</search>" and s.turns == 3
            else:
                assert s.finish_reason == "length" and len(tokens) == MAX_TOKENS
    assert calls > 0 and any(f == "stop" and c > 0 for f, c in shapes), shapes  # episodes searched, then answered
    assert set(tool.queries) == {QUERY} and len(tool.queries) >= calls

    # The trainer's consumer admits them (tokenizer from the anchor) and builds masked samples. The
    # script's answer is never right (rewards all 0), so all-equal groups are kept here.
    cfg = ConsumerConfig(store_url=store_url, run=RUN, poll_interval_s=0.02, wait_timeout_s=10.0, filter_all_equal=False)
    consumer = await RolloutConsumer.open(store, cfg, restore=False)
    try:
        batch = await consumer.next_batch(4, trainer_version=0)
    finally:
        await consumer.close()
    assert len(batch.groups) == 4 and batch.metrics["rollout/stoa_rejected"] == 0
    for consumed in batch.groups:
        assert consumed.rewards == (0.0,) * 4 and consumed.texts[0] == tok.decode(consumed.group.samples[0].response_tokens.tolist())
        for f, s in zip(sample_fields(consumed), consumed.group.samples, strict=True):
            assert f["loss_mask"] == s.mask.tolist() and len(f["rollout_log_probs"]) == len(s.response_tokens)
            assert f["metadata"]["stoa_tool_calls"] == s.tool_calls


async def test_a_slow_tool_does_not_hold_a_new_version_back(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Episodes waiting for their tool take no decode steps, so a drain counted in steps alone
    would wait for the tool (here: its 30 s timeout). The drain also ends after `swap_drain_s`:
    the waiting groups are dropped and restart on the new weights."""
    from tests.conftest import async_wait_until
    from tests.test_worker import scrambled

    class Slow:
        async def __call__(self, query: str) -> str:
            await asyncio.sleep(600)
            return "never"

    monkeypatch.setitem(tools._FACTORIES, "search", lambda task, ctx: Slow())
    await seed_search_run(store, model_dir)
    config = DaemonConfig(store=store_url, run=RUN, name="slow-mac", worker_id="slow-mac-1", data_dir=tmp_path / "d", batch=2)
    worker = Worker(config, store, WorkerOptions(seed=3, heartbeat_s=0.5, weights_poll_s=0.05, swap_drain_s=1.0))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    try:
        await async_wait_until(lambda: worker.groups_in_flight >= 1 or run.done(), timeout=60, message="groups in flight")
        pub = Publisher(store, RUN, PublisherConfig(extras_dir=model_dir))
        await pub.open()
        await pub.publish(scrambled(load_hf_state(model_dir), np.random.default_rng(1)))
        await async_wait_until(lambda: worker.swaps or run.done(), timeout=60, message="the swap to v1")
    finally:
        stop.set()
        assert await asyncio.wait_for(run, 120) == 0
    (swap, *_) = worker.swaps
    assert swap.version == 1 and swap.drain_s < 10.0  # not the tool's 30 s timeout


async def test_worker_and_trainer_agree_under_the_papersearchqa_preset(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `papersearchqa` preset through the real worker and the trainer's consumer: Search-R1's
    prompt as the one user message (the consumer rebuilds the prompt tokens from the task and
    admits the record only when they agree), observations of the top 3 passages whole in
    Search-R1's layout and text, encoded whole, at most 2 searches, and the loss masks the
    trainer builds equal to the worker's."""
    import mlx_lm

    meta = dict(TASK_PRESETS["papersearchqa"].meta)
    task = Search(task_items(DATA), meta=meta)
    fmt = task.tool_format
    assert fmt is not None and fmt.max_turns == 3 and fmt.layout == "search-r1" and fmt.max_observation_tokens == 500
    await seed_search_run(store, model_dir, meta=meta, max_tokens=400)
    monkeypatch.setenv("STOA_SHARED_DIR", str(tmp_path / "shared"))
    config = DaemonConfig(store=store_url, run=RUN, name="test-mac", worker_id="test-mac-5e4c11", data_dir=tmp_path / "data", batch=2)
    worker = Worker(config, store, WorkerOptions(seed=3, heartbeat_s=0.5, max_cohorts=2))
    assert await asyncio.wait_for(asyncio.create_task(worker.run(asyncio.Event())), 120) == 0
    tok = mlx_lm.load(str(model_dir))[1]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    limits = RecordLimits(vocab_size=vocab, expected_group_size=4, max_turns=3)
    keys = [i.key async for i in store.list(RunLayout(RUN).rollouts_prefix())]
    groups = [load_record(await store.get_bytes(k), limits) for k in keys]
    assert len(groups) == 4

    hits = Retriever.open(build_index(DATA.passages, tmp_path / "reference-index")).search(QUERY, 3)
    assert len(hits) == 3
    observation = f"\n\n<information>{format_search_r1([h.text for h in hits]).strip()}</information>\n\n"
    assert observation.startswith("\n\n<information>Doc 1(Title: The code word of ") and "\nDoc 3(Title: " in observation
    obs_tokens = tok.encode(observation, add_special_tokens=False)
    assert len(obs_tokens) < 500  # whole, not cut
    calls = 0
    for g in groups:
        item = task.item(g.prompt_index)
        assert g.prompt_tokens.tolist() == prompt_tokens(tok, task, item)
        prompt_text = tok.decode(g.prompt_tokens.tolist())
        assert task.messages(item) == [{"role": "user", "content": task.config.tags.search_r1_prompt(item.prompt)}]
        assert "<|im_start|>system" not in prompt_text and "Answer the given question. You must conduct reasoning" in prompt_text
        for s in g.samples:
            tokens, runs = s.response_tokens.tolist(), spans(s.mask)
            calls += s.tool_calls
            assert s.tool_calls <= 2 and s.turns <= 3
            for v, start, end in runs:
                if v == 0:  # the observation's tokens are Search-R1's text encoded whole
                    assert tokens[start:end] == obs_tokens or end == len(tokens), tok.decode(tokens[start:end])
            if s.finish_reason == "turns":
                assert s.tool_calls == 2 and tok.decode(tokens[runs[-1][1]:]) == f"<search>{QUERY}</search>"
    assert calls > 0

    cfg = ConsumerConfig(store_url=store_url, run=RUN, poll_interval_s=0.02, wait_timeout_s=10.0, filter_all_equal=False)
    consumer = await RolloutConsumer.open(store, cfg, restore=False)
    try:
        batch = await consumer.next_batch(4, trainer_version=0)
    finally:
        await consumer.close()
    assert len(batch.groups) == 4 and batch.metrics["rollout/stoa_rejected"] == 0
    for consumed in batch.groups:
        for f, s in zip(sample_fields(consumed), consumed.group.samples, strict=True):
            assert f["loss_mask"] == s.mask.tolist()


async def test_a_deleted_index_names_the_command_that_puts_it_back(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index manifest deleted by a token holder: the worker waits, its heartbeat naming `stoa
    task prepare search` with this run and store, and goes on once the index is back."""
    await seed_search_run(store, model_dir)
    key = RunLayout(RUN).task_index_file("search", "manifest.json")
    genuine = await store.get_bytes(key)
    await store.delete(key)
    monkeypatch.setenv("STOA_SHARED_DIR", str(tmp_path / "shared"))
    config = DaemonConfig(store=store_url, run=RUN, name="test-mac", worker_id="test-mac-5e4c11",
                          data_dir=tmp_path / "data", batch=2)
    worker = Worker(config, store, WorkerOptions(seed=3, heartbeat_s=0.5, max_cohorts=1, idle_poll_s=0.05,
                                                 setup_retry_max_s=0.2))
    run = asyncio.create_task(worker.run(asyncio.Event()))

    async def said() -> str:
        while "stoa task prepare" not in (worker.reporter.beat.last_error or ""):
            assert not run.done(), run
            await asyncio.sleep(0.02)
        return worker.reporter.beat.last_error or ""

    line = await asyncio.wait_for(said(), 60)
    assert line.startswith("tool: the run's search data is missing from the bucket (")
    assert f"`stoa task prepare search QA_FILE CORPUS_FILE --store {shlex.quote(store_url)} --run {RUN} --split train`" in line
    await store.put(key, genuine)  # the operator puts it back
    assert await asyncio.wait_for(run, 120) == 0 and worker.groups_recorded == 2
