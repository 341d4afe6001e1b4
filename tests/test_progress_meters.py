"""Progress of stoa's long commands, one display everywhere (`slime_stoa.quickstart.meter`): its
units and lines off a terminal; `stoa eval --local` showing its sampling as the sampling
process reports it (in budget tokens, the prompts done beside); `stoa task prepare` and `stoa weights export` showing theirs."""

from __future__ import annotations

import asyncio
import io
import json
from collections import deque
from pathlib import Path

import pytest
from rich.console import Console

from slime_stoa.evaluation.local import PROGRESS_PREFIX, EvalProgress, _keep_tail, parse_progress
from slime_stoa.protocol.store import Store
from slime_stoa.quickstart.meter import StepMeter, cli_console
from tests.test_weights_cli import seeded_run  # noqa: F401  (fixture)


def test_the_meter_counts_in_its_unit_and_advances() -> None:
    out, now = io.StringIO(), [0.0]
    with StepMeter(Console(file=out, width=200), "eval v3 (test, k=8)", 20, unit="prompt", clock=lambda: now[0]) as meter:
        for _ in range(20):
            now[0] += 0.5
            meter.advance()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and meter.done == 20
    assert lines[0] == "stoa eval v3 (test, k=8): prompt 2/20 (10%), 2.0 prompts/s, ETA 9s"
    assert lines[-1].startswith("stoa eval v3 (test, k=8): prompt 20/20 (100%), 2.0 prompts/s, ETA 0s")


def test_a_command_console_is_stderr_and_quiet_is_none() -> None:
    console = cli_console()
    assert console is not None and console.stderr
    assert cli_console(quiet=True) is None
    with StepMeter(None, "nothing", 3) as meter:  # no console: nothing shown, nothing fails
        meter.advance(3)
    assert meter.done == 3


def test_progress_lines_of_the_sampling_process_are_told_not_kept() -> None:
    assert parse_progress(f"{PROGRESS_PREFIX}3/12") == EvalProgress(3, 12)
    assert parse_progress(f"{PROGRESS_PREFIX}40/96 3/12") == EvalProgress(3, 12, 40, 96)
    for other in ("stoa-eval-progress x/12", "stoa-eval-progress 3", "error: no model", f"{PROGRESS_PREFIX}3/-1",
                  f"{PROGRESS_PREFIX}1/2 3/4 5/6", f"{PROGRESS_PREFIX}1/2 3", f"{PROGRESS_PREFIX}", f"{PROGRESS_PREFIX}²/3"):
        assert parse_progress(other) is None

    async def read(text: bytes) -> tuple[list[EvalProgress], list[str]]:
        stream = asyncio.StreamReader()
        stream.feed_data(text)
        stream.feed_eof()
        told: list[EvalProgress] = []
        tail: deque[str] = deque(maxlen=20)
        await _keep_tail(stream, tail, told.append)
        return told, list(tail)

    text = f"loading\n{PROGRESS_PREFIX}1/2\nwarning: slow\n{PROGRESS_PREFIX}9/12 2/2\n"
    told, tail = asyncio.run(read(text.encode()))
    assert told == [EvalProgress(1, 2), EvalProgress(2, 2, 9, 12)] and tail == ["loading", "warning: slow"]


@pytest.mark.slow  # a real eval process: python -m pytest --slow tests/test_progress_meters.py
async def test_eval_local_shows_the_budget_and_prompts_done_off_a_terminal(
    store: Store, store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("mlx_lm")
    from slime_stoa.cli import main
    from slime_stoa.quickstart.seeding import tiny_synthetic_model
    from tests.test_eval_fleet import RUN, seed_eval_run

    await seed_eval_run(store, tiny_synthetic_model(tmp_path / "model"))
    out = tmp_path / "e.json"
    argv = ["eval", "--store", store_url, "--run", RUN, "--local", "--split", "test", "--k", "2", "--prompts", "10",
            "--seed", "1", "--json", str(out)]
    assert await asyncio.to_thread(main, argv) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("stoa eval v0")]
    assert len(lines) > 1 and all(": token " in line and "tokens/s" in line and "ETA" in line for line in lines)
    assert lines[-1].startswith("stoa eval v0 (test, k=2): token 120/120 (100%)")  # 10 prompts x 2 x 6 tokens
    assert lines[-1].endswith(", prompts 10/10")
    assert json.loads(out.read_text())["versions"][0]["n_prompts"] == 10
    assert "token 120/120" not in captured.out  # the results stay alone on stdout
    # --quiet: none
    assert await asyncio.to_thread(main, [*argv, "--quiet"]) == 0
    assert "stoa eval v0" not in capsys.readouterr().err


def test_task_prepare_shows_the_files_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from slime_stoa.cli import main

    url = f"file://{tmp_path / 'bucket'}"
    (tmp_path / "bucket").mkdir()
    files = []
    for split in ("train", "test"):
        path = tmp_path / f"{split}.jsonl"
        path.write_text("".join(json.dumps({"question": f"{split} {i}?", "answer": f"so #### {i}"}) + "\n" for i in range(5)))
        files.append(str(path))
    assert main(["task", "prepare", "gsm8k", *files, "--store", url, "--run", "r"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("stoa task prepare gsm8k: file ")]
    assert [line.split(" (")[0] for line in lines] == ["stoa task prepare gsm8k: file 1/2", "stoa task prepare gsm8k: file 2/2"]
    assert "files/s" in lines[-1] and captured.out.count("wrote ") == 2
    assert main(["task", "prepare", "synthetic", "--store", url, "--run", "r", "--count", "5"]) == 0
    assert "stoa task prepare" not in capsys.readouterr().err  # generated: nothing read, no progress


def test_weights_export_shows_its_phases(
    seeded_run: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    from slime_stoa.cli import main

    assert main(["weights", "export", "--version", "2", str(tmp_path / "v2")]) == 0
    captured = capsys.readouterr()
    lines = [line.split(" (")[0] for line in captured.err.splitlines() if line.startswith("stoa weights export: ")]
    assert lines == [f"stoa weights export: phase {n}/3" for n in (1, 2, 3)]
    assert captured.out.startswith("exported v2")
    assert main(["weights", "export", "--quiet", "--version", "1", str(tmp_path / "v1")]) == 0
    assert "stoa weights export" not in capsys.readouterr().err


@pytest.mark.slow  # transformers and a BM25 index: about 10 s
async def test_the_transformers_engine_tells_each_finished_prompt(store: Store, tmp_path: Path) -> None:
    pytest.importorskip("torch")
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
    told: list[int] = []
    groups = await hf_answer_prompts(model, tok, task, prompts, temperature=1.0, max_tokens=MAX_TOKENS, k=4,
                                     stop=manifest.stop, seed=0, tool=tool, max_batch=4, on_group=told.append)
    assert [len(g) for g in groups] == [4, 4, 4]
    assert told == sorted(set(told)) and told[-1] == 3  # rising, each count once, ending at every prompt
