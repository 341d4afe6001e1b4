"""`stoa eval --local --engine mlx`: sampling runs in `python -m macd.eval_process`, its own process,
and gives what macd's generation path gives in this one; a tool task's calls are answered by the
tool here, over the process's pipes; a process that fails is one clear error."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("bm25s")

from macd.eval_process import _inline
from macd.evaluate import answer_prompts
from macd.generate import load_model
from slime_stoa.cli import main
from slime_stoa.evaluation import local
from slime_stoa.evaluation.collect import read_split
from slime_stoa.evaluation.local import EngineFailed, Sampled, mlx_sample
from slime_stoa.protocol.store import Store
from slime_stoa.tasks.prompting import prompt_tokens
from slime_stoa.tasks.synthetic import Synthetic, generate_items
from slime_stoa.tasks.tools import ToolContext, tool_for
from tests.test_eval_fleet import RUN as SYNTHETIC_RUN
from tests.test_eval_fleet import model_dir as synthetic_model_dir  # noqa: F401  (fixture)
from tests.test_eval_fleet import seed_eval_run
from tests.test_search_worker import MAX_TOKENS, QUERY, RUN, Recording, seed_search_run
from tests.test_search_worker import model_dir as scripted_model_dir  # noqa: F401  (fixture)


def in_process(folder: Path, task: Any, n: int, **sampling: Any) -> list[list[Sampled]]:
    model, tok = load_model(folder)
    prompts = [prompt_tokens(tok, task, item) for item in task.items[:n]]
    groups = asyncio.run(answer_prompts(model, tok, task, prompts, mlx=_inline, **sampling))
    return [[Sampled(c.text, c.finish_reason, int(getattr(c, "tool_calls", 0))) for c in g] for g in groups]


async def test_the_process_samples_what_macd_samples_in_process(
    synthetic_model_dir: Path, tmp_path: Path  # noqa: F811
) -> None:
    task = Synthetic(generate_items(5, seed=3))
    sampling: dict[str, Any] = dict(k=3, temperature=1.0, max_tokens=8, stop=("7",), seed=11)
    got = await mlx_sample(synthetic_model_dir, task, n_prompts=4, tool=None, work_dir=tmp_path / "w", **sampling)
    assert [len(g) for g in got] == [3, 3, 3, 3]
    assert got == await asyncio.to_thread(in_process, synthetic_model_dir, task, 4, **sampling)


async def test_a_tool_task_is_answered_by_the_tool_of_this_process(
    store: Store, scripted_model_dir: Path, tmp_path: Path  # noqa: F811
) -> None:
    manifest = await seed_search_run(store, scripted_model_dir)
    task = await read_split(store, manifest, "train")
    tool = Recording(tool_for(task, ToolContext(run=RUN, store=store, data_dir=tmp_path / "data")))
    groups = await mlx_sample(scripted_model_dir, task, n_prompts=3, k=4, temperature=1.0, max_tokens=MAX_TOKENS,
                              stop=manifest.stop, seed=0, tool=tool, work_dir=tmp_path / "w")
    assert [len(g) for g in groups] == [4, 4, 4]
    calls = sum(c.tool_calls for g in groups for c in g)
    assert calls > 0 and set(tool.queries) == {QUERY} and len(tool.queries) >= calls
    assert {c.finish_reason for g in groups for c in g} <= {"stop", "length", "turns"}


async def test_cli_search_eval_with_mlx_reports_the_search_rate(
    store: Store, store_url: str, scripted_model_dir: Path, tmp_path: Path  # noqa: F811
) -> None:
    await seed_search_run(store, scripted_model_dir)
    out = tmp_path / "e.json"
    argv = ["eval", "--store", store_url, "--run", RUN, "--local", "--split", "train", "--k", "4", "--prompts", "3",
            "--seed", "0", "--json", str(out)]
    assert await asyncio.to_thread(main, argv) == 0
    (row,) = json.loads(out.read_text())["versions"]
    assert 0.0 < row["search_rate"] < 1.0 and row["pass@1"] == 0.0  # the script's answer is never the label
    assert row["match"] == "cover_em"  # the search task's default match mode, in every reported row


async def test_a_failing_process_is_one_error_line(
    store: Store, store_url: str, synthetic_model_dir: Path, tmp_path: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    task = Synthetic(generate_items(2, seed=3))
    with pytest.raises(EngineFailed, match=r"the mlx engine \(`.* -m macd.eval_process`\) exited with status 1: error: "):
        await mlx_sample(tmp_path / "no-model", task, n_prompts=2, k=1, temperature=1.0, max_tokens=4, stop=(),
                         seed=None, tool=None, work_dir=tmp_path / "w")
    await seed_eval_run(store, synthetic_model_dir)
    monkeypatch.setattr(local, "MLX_SAMPLER", ("-m", "macd.not_there"))
    argv = ["eval", "--store", store_url, "--run", SYNTHETIC_RUN, "--local", "--split", "test", "--prompts", "1"]
    assert await asyncio.to_thread(main, argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the mlx engine") and "No module named macd.not_there" in err[0]


def test_the_sampler_refuses_a_tool_task_without_its_pipes(scripted_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    from slime_stoa.tasks.search import Search

    task_file = tmp_path / "task.data"
    task_file.write_bytes(Search([], meta={"top_k": 1}).encode())
    done = subprocess.run([sys.executable, "-m", "macd.eval_process", "--model", str(scripted_model_dir), "--task",
                           str(task_file), "--max-tokens", "4", "--temperature", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "uses a tool" in done.stderr.splitlines()[-1], done.stderr
