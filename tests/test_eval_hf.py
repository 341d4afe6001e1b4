"""`stoa eval --local --engine transformers`: the trainer box samples eval episodes with
transformers' `generate`, with the same episode rules as a worker (`slime_stoa.tasks.episode`).

The search episodes run the scripted policy of `tests/test_search_worker.py` (real HF weights
whose next token depends on the last one only: after a newline it searches for "code word" or
answers "registry", a coin flip each) against the run's real BM25 index from the bucket, so every
turn's text, every observation and every ending can be checked exactly. The single-turn checks run
a random tiny model.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("bm25s")

from slime_stoa.cli import main
from slime_stoa.evaluation.collect import read_split
from slime_stoa.evaluation.hf_generate import eos_ids, hf_answer_prompts, load_hf_model
from slime_stoa.protocol.store import Store
from slime_stoa.tasks.episode import extract_query
from slime_stoa.tasks.prompting import prompt_tokens
from slime_stoa.tasks.search.retriever import Retriever, build_index
from slime_stoa.tasks.synthetic import Synthetic, generate_items
from slime_stoa.tasks.tools import ToolContext, tool_for
from tests.test_eval_fleet import RUN as SYNTHETIC_RUN
from tests.test_eval_fleet import model_dir as synthetic_model_dir  # noqa: F401  (fixture)
from tests.test_eval_fleet import seed_eval_run
from tests.test_search_worker import ANSWER, DATA, FORMAT, MAX_TOKENS, META, QUERY, RUN, Recording, seed_search_run
from tests.test_search_worker import model_dir as scripted_model_dir  # noqa: F401  (fixture)


async def test_search_episodes_follow_the_worker_rules(
    store: Store, scripted_model_dir: Path, tmp_path: Path  # noqa: F811
) -> None:
    manifest = await seed_search_run(store, scripted_model_dir)
    task = await read_split(store, manifest, "train")
    tool = Recording(tool_for(task, ToolContext(run=RUN, store=store, data_dir=tmp_path / "data")))
    model, tok = load_hf_model(scripted_model_dir, "cpu")
    prompts = [prompt_tokens(tok, task, item) for item in task.items[:3]]
    groups = await hf_answer_prompts(model, tok, task, prompts, temperature=1.0, max_tokens=MAX_TOKENS, k=4,
                                     stop=manifest.stop, seed=0, tool=tool)

    body = Retriever.open(build_index(DATA.passages, tmp_path / "ref")).observe(QUERY, k=META["top_k"], max_chars=1500)
    observation = tok.encode(f"\n<information>{body}</information>\n", add_special_tokens=False)
    search = tok.encode(f"<search>{QUERY}</search>", add_special_tokens=False)
    answer = tok.encode(f"<answer>{ANSWER}</answer>", add_special_tokens=False)
    assert [len(g) for g in groups] == [4, 4, 4]
    endings = set()
    for c in (c for g in groups for c in g):
        assert len(c.tokens) <= MAX_TOKENS and 1 <= c.turns <= FORMAT.max_turns
        rest = list(c.tokens)
        for _ in range(c.tool_calls):  # each call: the scripted search, then exactly the retriever's text
            assert rest[: len(search)] == search and extract_query(tok.decode(search), FORMAT) == QUERY
            rest = rest[len(search):]
            assert rest[: len(observation)] == observation[: len(rest)]
            rest = rest[len(observation):]
        if c.finish_reason == "stop":
            assert rest == answer and c.text.endswith(f"<answer>{ANSWER}</answer>")
        elif c.finish_reason == "turns":
            assert rest == search and c.turns == FORMAT.max_turns and c.tool_calls == FORMAT.max_turns - 1
        else:
            assert c.finish_reason == "length" and len(c.tokens) == MAX_TOKENS
        endings.add((c.finish_reason, c.tool_calls))
    assert any(f == "stop" and n > 0 for f, n in endings), endings  # searched, then answered
    assert any(f == "stop" and n == 0 for f, n in endings), endings  # answered at once
    calls = sum(c.tool_calls for g in groups for c in g)
    assert calls > 0 and set(tool.queries) == {QUERY} and len(tool.queries) >= calls


async def test_a_stop_string_is_matched_within_a_turn_only(
    store: Store, scripted_model_dir: Path, tmp_path: Path  # noqa: F811
) -> None:
    """A stop string that would span a turn's start ("\n<": the prompt's or an observation's last
    newline, then the scripted "<search>" or "<answer>") ends nothing, as on a worker: the
    samples are those of a run without it."""
    manifest = await seed_search_run(store, scripted_model_dir)
    task = await read_split(store, manifest, "train")
    tool = tool_for(task, ToolContext(run=RUN, store=store, data_dir=tmp_path / "data"))
    model, tok = load_hf_model(scripted_model_dir, "cpu")
    prompts = [prompt_tokens(tok, task, item) for item in task.items[:2]]
    runs = [
        await hf_answer_prompts(model, tok, task, prompts, temperature=1.0, max_tokens=MAX_TOKENS, k=4, stop=stop,
                                seed=0, tool=tool)
        for stop in (("</answer>",), ("</answer>", "\n<"))
    ]
    assert [[c.tokens for c in g] for g in runs[1]] == [[c.tokens for c in g] for g in runs[0]]
    assert any(c.tool_calls for g in runs[1] for c in g)  # observations, hence turn starts after "\n", were crossed


async def test_single_turn_samples_end_on_eos_a_stop_string_or_the_budget(
    synthetic_model_dir: Path,  # noqa: F811
) -> None:
    model, tok = load_hf_model(synthetic_model_dir, "cpu")
    task = Synthetic(generate_items(4, seed=1))
    prompts = [prompt_tokens(tok, task, item) for item in task.items]
    stop = ("1",)  # a digit the random model writes now and then
    groups = await hf_answer_prompts(model, tok, task, prompts, temperature=1.0, max_tokens=24, k=4, stop=stop, seed=5)
    finishes = set()
    for c in (c for g in groups for c in g):
        assert 1 <= len(c.tokens) <= 24 and c.turns == 1 and c.tool_calls == 0
        finishes.add(c.finish_reason)
        if c.finish_reason == "length":
            assert len(c.tokens) == 24 and "1" not in tok.decode(list(c.tokens))
        else:
            assert c.finish_reason == "stop"
            eos = c.tokens[-1] in eos_ids(model, tok)
            if not eos:  # stopped at the first token whose text holds the stop string
                assert "1" in c.text and "1" not in tok.decode(list(c.tokens[:-1]))
    assert "stop" in finishes, finishes
    again = await hf_answer_prompts(model, tok, task, prompts, temperature=1.0, max_tokens=24, k=4, stop=stop, seed=5)
    assert [[c.tokens for c in g] for g in again] == [[c.tokens for c in g] for g in groups]  # seeded


async def eval_with_transformers(monkeypatch: pytest.MonkeyPatch, store_env: dict[str, str], out: Path,
                                 *args: str) -> list[dict[str, Any]]:
    """`stoa eval ARGS --local --engine transformers --device cpu --json OUT`: its versions."""
    for name, value in store_env.items():
        monkeypatch.setenv(name, value)
    argv = ["eval", *args, "--local", "--engine", "transformers", "--device", "cpu", "--json", str(out)]
    assert await asyncio.to_thread(main, argv) == 0
    return json.loads(out.read_text())["versions"]


async def test_the_model_folders_sampling_defaults_are_not_applied(
    synthetic_model_dir: Path, tmp_path: Path  # noqa: F811
) -> None:
    """A generation_config.json that leaves only the likeliest token (min_p 1.0; real folders ship
    top-k, top-p, min-p or penalties) is ignored: samples are drawn with the temperature alone."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(synthetic_model_dir, folder)
    config = json.loads((folder / "generation_config.json").read_text()) if (folder / "generation_config.json").exists() else {}
    config.update(min_p=1.0, do_sample=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    model, tok = load_hf_model(folder, "cpu")
    task = Synthetic(generate_items(1, seed=1))
    (group,) = await hf_answer_prompts(model, tok, task, [prompt_tokens(tok, task, task.items[0])], temperature=1.0,
                                       max_tokens=12, k=4, stop=(), seed=0)
    assert len({c.tokens for c in group}) > 1  # min_p 1.0 would give four equal (greedy) samples


async def test_cli_evaluates_every_version_with_transformers(
    store: Store, store_url: str, store_env: dict[str, str], synthetic_model_dir: Path, tmp_path: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await seed_eval_run(store, synthetic_model_dir)
    (row,) = await eval_with_transformers(
        monkeypatch, store_env, tmp_path / "e.json", "--store", store_url, "--run", SYNTHETIC_RUN, "--all",
        "--split", "test", "--k", "3", "--prompts", "4", "--seed", "1",
    )
    assert (row["version"], row["k"], row["n_prompts"], row["search_rate"]) == (0, 3, 4, None)
    assert 0.0 <= row["pass@1"] <= row["pass@k"] <= 1.0


async def test_cli_search_eval_with_transformers_reports_the_search_rate(
    store: Store, store_url: str, store_env: dict[str, str], scripted_model_dir: Path, tmp_path: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await seed_search_run(store, scripted_model_dir)
    (row,) = await eval_with_transformers(
        monkeypatch, store_env, tmp_path / "e.json", "--store", store_url, "--run", RUN,
        "--split", "train", "--k", "4", "--prompts", "3", "--seed", "0",
    )
    assert 0.0 < row["search_rate"] < 1.0  # a coin flip per sample: some search, some answer at once
    assert row["pass@1"] == 0.0  # the script's answer is never the label


async def test_engine_needs_local(store: Store, store_url: str, synthetic_model_dir: Path,  # noqa: F811
                                  capsys: pytest.CaptureFixture[str]) -> None:
    await seed_eval_run(store, synthetic_model_dir)
    argv = ["eval", "--store", store_url, "--run", SYNTHETIC_RUN, "--engine", "transformers"]
    assert await asyncio.to_thread(main, argv) == 1
    assert "add --local" in capsys.readouterr().err
