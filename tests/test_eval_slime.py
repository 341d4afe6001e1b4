"""slime's eval path: `generate_rollout(..., evaluation=True)` with a real worker answering, and the
plugin contract (one function serves both the rollout and the eval path)."""

from __future__ import annotations

import asyncio
import inspect
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

from macd.config import DaemonConfig
from macd.worker import Worker, WorkerOptions
from slime_stoa.protocol.eval_request import parse_request
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import Store
from tests import slime_standins
from tests.test_eval_fleet import RUN, model_dir, seed_eval_run  # noqa: F401  (fixture)


def test_one_function_is_both_the_rollout_and_the_eval_path() -> None:
    from slime_stoa import generate_rollout

    params = inspect.signature(generate_rollout).parameters
    assert list(params) == ["args", "rollout_id", "data_source", "evaluation"]
    assert params["evaluation"].default is False
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values())


def test_eval_settings_are_checked_before_anything_is_opened() -> None:
    from slime_stoa.trainer.slime.eval_rollout import eval_datasets_from_args

    datasets = eval_datasets_from_args(types.SimpleNamespace(eval_prompt_data=["gsm8k-test", "test", "b", "dev"]))
    assert [(d.name, d.split) for d in datasets] == [("gsm8k-test", "test"), ("b", "dev")]
    for bad in (None, [], ["only-a-name"], ["n", "../x"]):
        with pytest.raises(ValueError):
            eval_datasets_from_args(types.SimpleNamespace(eval_prompt_data=bad))


async def test_generate_rollout_evaluation_returns_slimes_eval_output(
    store: Store, store_url: str, store_env: dict[str, str], model_dir: Path, tmp_path: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from slime_stoa.trainer.slime import rollout

    for name, value in store_env.items():  # the rollout function opens the store from the environment
        monkeypatch.setenv(name, value)
    for name, module in slime_standins.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    await seed_eval_run(store, model_dir)
    config = DaemonConfig(store=store_url, run=RUN, name="eval-mac", worker_id="eval-mac-2", data_dir=tmp_path / "d", batch=2)
    worker = Worker(config, store, WorkerOptions(seed=5, heartbeat_s=0.5, eval_poll_s=0.2))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    args = types.SimpleNamespace(
        stoa_bucket=store_url, stoa_run=RUN, stoa_tokenizer_dir=str(model_dir), stoa_poll_interval_s=0.2,
        stoa_wait_timeout_s=240, rollout_batch_size=2, n_samples_per_prompt=4,
        eval_prompt_data=["synth-test", "test"], n_samples_per_eval_prompt=2, eval_max_response_len=5, stoa_eval_prompts=4,
    )
    try:
        out = await asyncio.to_thread(rollout.generate_rollout, args, 7, None, evaluation=True)
    finally:
        stop.set()
        assert await asyncio.wait_for(run, 300) == 0
        if rollout._SESSION is not None:
            await asyncio.to_thread(rollout._SESSION.close)
            rollout._SESSION = None
    assert set(out.data) == {"synth-test"}
    entry = out.data["synth-test"]
    assert set(entry) == {"rewards", "truncated", "samples"}
    assert len(entry["rewards"]) == len(entry["truncated"]) == len(entry["samples"]) == 4 * 2
    samples = entry["samples"]
    assert [s.metadata["stoa_prompt_index"] for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [s.group_index for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]  # slime's zero_std/* groups by it
    assert [s.index for s in samples] == list(range(8))
    assert [s.reward for s in samples] == entry["rewards"]
    assert all(isinstance(s.status, slime_standins.Sample.Status) for s in samples)
    assert [s.status is slime_standins.Sample.Status.TRUNCATED for s in samples] == entry["truncated"]
    assert all(s.metadata["stoa_weight_version"] == 0 and s.response_length <= 5 for s in samples)
    assert out.metrics["eval/stoa_trainer_version"] == 0.0 and out.metrics["eval/stoa_synth-test_n_prompts"] == 4.0
    assert 0.0 <= out.metrics["eval/stoa_synth-test_pass@1"] <= out.metrics["eval/stoa_synth-test_pass@k"] <= 1.0
    key = RunLayout(RUN).eval_request(0, "test")
    request = parse_request(await store.get_bytes(key), key=key, run=RUN)
    assert (request.k, request.max_tokens, request.prompts) == (2, 5, ())  # answered, then closed
