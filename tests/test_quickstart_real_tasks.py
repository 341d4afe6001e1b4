"""`stoa quickstart --task gsm8k|math` with a real model: the defaults a real model needs, the data
it reads, and a rerun that never turns an earlier run into another one."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import open_store
from slime_stoa.quickstart.config import QuickstartConfig, QuickstartError
from slime_stoa.quickstart.run import check_same_run
from slime_stoa.quickstart.seeding import tiny_synthetic_model
from tests.shared_data import GSM8K_DIR
from tests.test_quickstart_errors import assert_one_error_line, quickstart


def test_a_real_model_gets_a_real_learning_rate_and_no_warm_start(tmp_path: Path) -> None:
    tiny = QuickstartConfig()
    assert (tiny.lr, tiny.warmup_steps, tiny.eval_prompts, tiny.eval_samples) == (3e-4, 600, 64, 4)
    model = tiny_synthetic_model(tmp_path / "m")
    real = QuickstartConfig(task="gsm8k", model=model, data=tmp_path)
    assert (real.lr, real.warmup_steps, real.max_tokens, real.eval_prompts, real.eval_samples) == (1e-6, 0, 256, 256, 1)
    assert QuickstartConfig(task="gsm8k", model=model, lr=1e-5).lr == 1e-5  # given: kept
    assert QuickstartConfig(model=model).lr == 1e-6  # any --model is a real one


def test_a_real_task_needs_a_real_model_and_its_data(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--model smollm2"):
        QuickstartConfig(task="gsm8k")
    model = tiny_synthetic_model(tmp_path / "m")
    with pytest.raises(QuickstartError, match="--data DIR"):
        QuickstartConfig(task="math", model=model).data_files()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text("")
    with pytest.raises(QuickstartError, match=r"no test\.jsonl"):
        QuickstartConfig(task="gsm8k", model=model, data=tmp_path / "d").data_files()
    (tmp_path / "d" / "test.jsonl").write_text("")
    assert [p.name for p in QuickstartConfig(task="gsm8k", model=model, data=tmp_path / "d").data_files()] == [
        "train.jsonl", "test.jsonl"]
    (tmp_path / "math" / "train").mkdir(parents=True)
    (tmp_path / "math" / "test.jsonl").write_text("")
    files = QuickstartConfig(task="math", model=model, data=tmp_path / "math").data_files()
    assert [p.name for p in files] == ["train", "test.jsonl"]


def test_gsm8k_finds_its_data_in_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_synthetic_model(tmp_path / "m")
    monkeypatch.setenv("STOA_GSM8K_DIR", str(GSM8K_DIR))
    if not (GSM8K_DIR / "test.jsonl").is_file():
        pytest.skip(f"no GSM8K at {GSM8K_DIR}")
    assert QuickstartConfig(task="gsm8k", model=model).data_files()[1] == GSM8K_DIR / "test.jsonl"


def test_an_unsupported_architecture_is_refused_before_any_write(tmp_path: Path) -> None:
    model = tiny_synthetic_model(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    line = assert_one_error_line(quickstart(tmp_path, "--model", str(model)), "'gpt2' is not supported", "llama")
    assert "--model" in line
    assert not (tmp_path / "qs").exists()


def test_the_cli_refuses_a_real_task_without_a_model(tmp_path: Path) -> None:
    assert_one_error_line(quickstart(tmp_path, "--task", "gsm8k"), "--model smollm2")


def _existing_run(tmp_path: Path, *, task: str, model: Path) -> QuickstartConfig:
    cfg = QuickstartConfig(out=tmp_path / "qs")

    async def seed() -> None:
        async with open_store(cfg.store_url, create=True) as store:
            manifest = RunManifest(run=cfg.run, model=str(model), task=task, group_size=8)
            await store.put_if_absent(RunLayout(cfg.run).run_manifest, manifest.to_bytes(None))

    asyncio.run(seed())
    return cfg


def _check(cfg: QuickstartConfig, model_dir: Path) -> None:
    async def check() -> None:
        async with open_store(cfg.store_url) as store:
            await check_same_run(store, cfg, model_dir)

    asyncio.run(check())


def test_a_rerun_of_another_task_family_or_model_is_refused_naming_out(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    tiny = tiny_synthetic_model(out / "model", "qwen2")
    cfg = _existing_run(tmp_path, task="synthetic", model=tiny)
    _check(cfg, tiny)  # the same run: resumed

    def refused(**changes: object) -> str:
        asked = QuickstartConfig(out=out, **changes)  # type: ignore[arg-type]
        with pytest.raises(QuickstartError) as caught:
            _check(asked, asked.model or out / "model")
        assert str(caught.value).startswith(f"--out {out}:") and "another --out" in str(caught.value)
        return str(caught.value)

    assert "a synthetic run" in refused(task="search")
    assert "the tiny qwen2 model" in refused(family="lfm2_moe")
    other = tiny_synthetic_model(tmp_path / "other")
    assert f"not --model {other}" in refused(model=other)


def easy_gsm8k(folder: Path) -> Path:
    """GSM8K-format data a 135M model answers right some of the time in a few tokens (one-step
    sums), so that its groups carry a GRPO signal within the short form's token budget; real
    GSM8K at 24 tokens rewards nothing and the trainer would drop every group."""
    folder.mkdir(parents=True)
    for split, offset in (("train", 0), ("test", 50)):
        rows = [{"question": f"What is {a} + {a + offset % 7}?", "answer": f"{a} + {a + offset % 7} = {2 * a + offset % 7}\n#### {2 * a + offset % 7}"}
                for a in range(1 + offset, 41 + offset)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.mark.slow  # ~5 minutes on two cores: the real model's two evals, a worker and the learner
def test_the_real_model_runs_gsm8k_through_the_whole_loop(tmp_path: Path) -> None:
    """The short form of the real-model quickstart: SmolLM2-135M-Instruct on GSM8K-format data,
    bounded by versions. The worker builds the run's prompts with the real chat template and the
    trainer accepts them (none refused), every version reaches the worker as a verified patch,
    and the worker's recorded logprobs are the learner's (a wrong template, rope or tokenizer
    puts this at tenths of a nat)."""
    pytest.importorskip("mlx_lm")
    pytest.importorskip("gguf")
    from slime_stoa.cli import main
    from slime_stoa.quickstart.real_model import RealModelUnavailable, smollm2_folder

    try:
        smollm2_folder()
    except RealModelUnavailable as exc:
        pytest.skip(str(exc))
    summary = tmp_path / "summary.json"
    assert main([
        "quickstart", "--out", str(tmp_path / "qs"), "--task", "gsm8k", "--model", "smollm2",
        "--data", str(easy_gsm8k(tmp_path / "data")), "--workers", "1", "--worker-batch", "4", "--batch-groups", "2",
        "--group-size", "4", "--max-tokens", "16", "--max-versions", "2", "--eval-prompts", "2", "--minutes", "30",
        "--json", str(summary),
    ]) == 0
    s = json.loads(summary.read_text())
    assert s["task"] == "gsm8k" and s["versions"] == 2 and s["groups_used"] == 4
    assert not s["records_refused"] and s["groups_lost"] == 0 and s["digest_mismatches"] == 0  # refusals by reason
    assert s["digests_checked"] >= 1 and 0 < s["patch_bytes_mean"] < s["full_bytes"] / 50  # ~0.4% changed at 1e-6
    assert s["tensors"] == 30 * 9 + 2  # 30 layers of 9 tensors, the embedding, the final norm (the head is tied)
    assert 0 <= s["eval_pass1_first"] <= 1 and 0 <= s["eval_pass1_last"] <= 1 and s["eval_prompts"] == 2
    assert s["logprob_gap_versions"] == 0 or s["mean_abs_logprob_gap"] < 0.05, s["mean_abs_logprob_gap"]
    assert "no warm start" in s["warm_start"]


def test_a_real_model_waits_for_a_batch_until_its_time_is_up(tmp_path: Path) -> None:
    """On a hard task most of a real model's groups can have equal rewards and be dropped: its
    learner waits what is left of --minutes (the run then ends at its limit, not in an error);
    the tiny model's fleet still has the short wait that reports a stalled fleet."""
    from slime_stoa.quickstart.run import TINY_BATCH_WAIT_S, batch_wait_s

    assert batch_wait_s(QuickstartConfig(), 1200.0) == TINY_BATCH_WAIT_S
    real = QuickstartConfig(model=tiny_synthetic_model(tmp_path / "m"))
    assert batch_wait_s(real, 1200.0) == 1200.0 and batch_wait_s(real, -5.0) == 1.0
