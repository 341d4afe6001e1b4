"""Progress of an eval's sampling in tokens of the budget (prompts x k x max tokens, a finished
sample's unused budget counted as done): `generate_groups` tells it after every decode step, so
it moves long before any prompt's group finishes and ends at exactly the budget; the sampling
process writes it as rate-limited lines (`ProgressLines`), the parent reads them back, and the
meters (`SamplingMeter`: `stoa eval --local`, the quickstart's held-out eval) show it, with an
upper-bound ETA. Bounded by work: fake clocks, tiny random models, few tokens."""

from __future__ import annotations

import io
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from macd.eval_process import ProgressLines, progress_line
from slime_stoa.evaluation.local import EvalProgress, parse_progress
from slime_stoa.quickstart.meter import SamplingMeter, eta_text


def events_of(told: list[tuple[str, Any]], kind: str) -> list[Any]:
    return [value for k, value in told if k == kind]


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from slime_stoa.quickstart.seeding import tiny_synthetic_model

    return tiny_synthetic_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize(("max_batch", "stop"), [(None, ()), (4, ("1",))])
def test_generate_groups_tells_the_budget_done_at_every_step(
    synthetic_model: Path, max_batch: int | None, stop: tuple[str, ...]
) -> None:
    os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
    pytest.importorskip("mlx_lm")
    from macd.generate import SamplingConfig, generate_groups, load_model
    from slime_stoa.tasks.prompting import prompt_tokens
    from slime_stoa.tasks.synthetic import Synthetic, generate_items

    model, tok = load_model(synthetic_model)
    task = Synthetic(generate_items(3, seed=3))
    prompts = [prompt_tokens(tok, task, item) for item in task.items]
    config = SamplingConfig(temperature=1.0, max_tokens=40, group_size=2, stop=stop, seed=5)
    told: list[tuple[str, Any]] = []
    groups = generate_groups(model, tok, prompts, config, max_batch=max_batch,
                             on_group=lambda n: told.append(("group", n)),
                             on_progress=lambda done, total: told.append(("tokens", (done, total))))
    total = 3 * 2 * 40
    progress = events_of(told, "tokens")
    assert {t for _, t in progress} == {total}
    done = [d for d, _ in progress]
    assert done[0] == 0 and done[-1] == total and told[-1] == ("tokens", (total, total))
    assert done == sorted(done)  # never goes back
    assert events_of(told, "group") == [1, 2, 3]
    first_group = told.index(("group", 1))
    assert any(0 < d < total for d, _ in events_of(told[:first_group], "tokens"))  # moves before any group finishes
    assert len(progress) > 3  # a step at a time, not a group at a time
    sampled = sum(len(c.tokens) for g in groups for c in g)
    assert sampled < total or stop == ()  # the stop string ended some samples early: their budget counted done


def test_the_sampling_process_writes_rate_limited_lines_the_parent_reads() -> None:
    out, now = io.StringIO(), [0.0]
    lines = ProgressLines(out, 4, every_s=0.5, share=0.01, clock=lambda: now[0])
    lines.tokens(0, 1000)
    for done in range(1, 1001):  # a token a step, no time passing: a line per 1% of the budget
        if done == 700:
            lines.group(1)
        lines.tokens(done, 1000)
    got = [parse_progress(line) for line in out.getvalue().splitlines()]
    assert [p.tokens_done for p in got if p is not None] == list(range(0, 1001, 10))
    assert got[-1] == EvalProgress(1, 4, 1000, 1000) and got[69] == EvalProgress(0, 4, 690, 1000)
    out.truncate(0)
    out.seek(0)
    lines = ProgressLines(out, 4, every_s=0.5, share=0.5, clock=lambda: now[0])
    for done in range(0, 10):  # slow steps: a line every half second
        lines.tokens(done, 1000)
        now[0] += 0.3
    assert [p.tokens_done for p in map(parse_progress, out.getvalue().splitlines()) if p] == [0, 2, 4, 6, 8]
    out.truncate(0)
    out.seek(0)
    lines = ProgressLines(out, 3)  # a tool task: no tokens counted, a line of prompts per group
    for n in (1, 2, 3):
        lines.group(n)
    assert out.getvalue().splitlines() == [progress_line(n, 3) for n in (1, 2, 3)]
    assert [parse_progress(line) for line in out.getvalue().splitlines()] == [EvalProgress(n, 3) for n in (1, 2, 3)]


def test_the_sampling_meter_shows_budget_tokens_with_an_upper_bound_eta() -> None:
    out, now = io.StringIO(), [0.0]
    with SamplingMeter(Console(file=out, width=200), "eval v2 (test, k=4)", clock=lambda: now[0]) as meter:
        meter.start(8)  # prompts, until the sampling tells its budget
        now[0] = 30.0  # loading: not counted in the rate
        meter.show(EvalProgress(0, 8, 0, 800))
        for step in range(1, 11):
            now[0] += 1.0
            meter.show(EvalProgress(step // 4, 8, 80 * step, 800))
    lines = out.getvalue().splitlines()
    assert len(lines) == 10
    assert lines[0] == "stoa eval v2 (test, k=4): token 80/800 (10%), 80.0 tokens/s, ETA <= 9s, prompts 0/8"
    assert lines[4].endswith("ETA <= 5s, prompts 1/8")
    assert lines[-1].startswith("stoa eval v2 (test, k=4): token 800/800 (100%)")
    assert eta_text(600.0, bound=True) == "ETA <= 10m" and eta_text(600.0) == "ETA 10m"
    out.truncate(0)
    out.seek(0)
    with SamplingMeter(Console(file=out, width=200), "eval v2 (test, k=4)", clock=lambda: now[0]) as meter:
        for n in range(5):  # a tool task: prompts
            meter.show(EvalProgress(n, 4))
    assert out.getvalue().splitlines()[-1].startswith("stoa eval v2 (test, k=4): prompt 4/4 (100%)")


async def test_the_quickstart_heldout_eval_bar_moves_before_any_prompt_is_done(
    store: Any, synthetic_model: Path, tmp_path: Path
) -> None:
    pytest.importorskip("mlx_lm")
    from slime_stoa.protocol.run_manifest import RunManifest
    from slime_stoa.quickstart.progress import Progress
    from slime_stoa.quickstart.run import heldout_eval
    from slime_stoa.quickstart.seeding import seed_run
    from slime_stoa.tasks.objects import put_task_objects, task_objects

    run = "eval-progress"
    manifest = RunManifest(run=run, model="tiny", task="synthetic", group_size=2, max_tokens=32, temperature=1.0)
    await seed_run(store, manifest, synthetic_model, task_count=8)
    await put_task_objects(store, run, "synthetic", task_objects("synthetic", [], split="test", count=4, seed=7, limit=None))
    out, notes = io.StringIO(), []
    report = SimpleNamespace(console=Console(file=out, width=200), note=notes.append)
    cfg = SimpleNamespace(run=run, seed=1, out=tmp_path, eval_prompts=3, eval_samples=2)
    progress = Progress()
    await heldout_eval(store, cfg, progress, report, 0)  # type: ignore[arg-type]
    lines = [line for line in out.getvalue().splitlines() if line.startswith("stoa eval v0")]
    assert len(lines) > 2 and all(": token " in line and "ETA <= " in line for line in lines)
    assert any(", prompts 0/3" in line and "(100%)" not in line for line in lines)  # before any group finished
    assert lines[-1].startswith("stoa eval v0 (held-out test split, 2 sample(s) per prompt): token 192/192 (100%)")
    assert lines[-1].endswith("prompts 3/3")
    assert 0 in progress.eval_pass1 and notes and notes[-1].startswith("eval pass@1 on the held-out test split at v0")


def _moves_before_the_first_group(told: list[tuple[str, Any]], total: int) -> None:
    """Budget progress that starts before any group finishes, never goes back, ends at `total`."""
    done = [d for d, t in events_of(told, "tokens") if t == total]
    assert len(done) == len(events_of(told, "tokens")) and done == sorted(done) and done[-1] == total
    first_group = next(i for i, (kind, _) in enumerate(told) if kind == "group")
    assert any(0 < d < total for d, _ in events_of(told[:first_group], "tokens"))


async def test_a_tool_tasks_mlx_episodes_tell_the_budget_before_any_prompt_finishes(store: Any, tmp_path: Path) -> None:
    """Search episodes (the scripted policy, the run's real BM25 index) sampled as `stoa eval --local`'s
    process samples them (`EpisodeBudget` running their MLX work)."""
    pytest.importorskip("mlx_lm")
    pytest.importorskip("bm25s")
    os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
    from macd.eval_process import EpisodeBudget
    from macd.evaluate import answer_prompts
    from macd.generate import load_model
    from slime_stoa.evaluation.collect import read_split
    from slime_stoa.tasks.prompting import prompt_tokens
    from slime_stoa.tasks.tools import ToolContext, tool_for
    from tests.test_search_worker import MAX_TOKENS, RUN, scripted_model, seed_search_run

    folder = scripted_model(tmp_path / "model")
    manifest = await seed_search_run(store, folder)
    task = await read_split(store, manifest, "train")
    tool = tool_for(task, ToolContext(run=RUN, store=store, data_dir=tmp_path / "data"))
    model, tok = load_model(folder)
    prompts = [prompt_tokens(tok, task, item) for item in task.items[:3]]
    told: list[tuple[str, Any]] = []
    budget = EpisodeBudget(3, 4, MAX_TOKENS, lambda done, total: told.append(("tokens", (done, total))))
    groups = await answer_prompts(model, tok, task, prompts, temperature=1.0, max_tokens=MAX_TOKENS, k=4,
                                  stop=manifest.stop, seed=0, mlx=budget, tool=tool, max_batch=4,
                                  on_group=lambda n: told.append(("group", n)))
    _moves_before_the_first_group(told, 3 * 4 * MAX_TOKENS)
    assert events_of(told, "group")[-1] == 3 and any(c.tool_calls for g in groups for c in g)


async def test_the_transformers_engine_tells_the_budget_before_any_prompt_finishes(store: Any, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("bm25s")
    from slime_stoa.evaluation.collect import read_split
    from slime_stoa.evaluation.hf_generate import hf_answer_prompts, load_hf_model
    from slime_stoa.tasks.prompting import prompt_tokens
    from slime_stoa.tasks.tools import ToolContext, tool_for
    from tests.test_search_worker import MAX_TOKENS, RUN, scripted_model, seed_search_run

    folder = scripted_model(tmp_path / "model")
    manifest = await seed_search_run(store, folder)
    task = await read_split(store, manifest, "train")
    tool = tool_for(task, ToolContext(run=RUN, store=store, data_dir=tmp_path / "data"))
    model, tok = load_hf_model(folder, "cpu")
    prompts = [prompt_tokens(tok, task, item) for item in task.items[:3]]
    told: list[tuple[str, Any]] = []
    groups = await hf_answer_prompts(model, tok, task, prompts, temperature=1.0, max_tokens=MAX_TOKENS, k=4,
                                     stop=manifest.stop, seed=0, tool=tool, max_batch=4,
                                     on_group=lambda n: told.append(("group", n)),
                                     on_progress=lambda done, total: told.append(("tokens", (done, total))))
    _moves_before_the_first_group(told, 3 * 4 * MAX_TOKENS)
    assert events_of(told, "group")[-1] == 3 and any(c.tool_calls for g in groups for c in g)
