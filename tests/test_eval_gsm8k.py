"""`stoa eval --local` on GSM8K's real test split (found as `tests.shared_data.gsm8k_dirs` says:
$STOA_GSM8K_DIR, else shared/data/gsm8k beside the checkout), with both engines: macd's MLX path
and transformers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from slime_stoa.cli import main
from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import Store
from slime_stoa.tasks.objects import put_task_objects, task_objects
from tests.shared_data import GSM8K_DIR, needs_gsm8k
from tests.test_eval_fleet import model_dir  # noqa: F401  (fixture)

RUN = "eval-gsm8k"
ENGINE_NEEDS = {"mlx": "mlx_lm", "transformers": "transformers"}


async def seed_gsm8k_run(store: Store, model_dir: Path) -> None:  # noqa: F811
    manifest = RunManifest(run=RUN, model="tiny", task="gsm8k", group_size=4, max_tokens=8, temperature=1.0)
    await store.put(RunLayout(RUN).run_manifest, manifest.to_bytes())
    files = [GSM8K_DIR / "train.jsonl", GSM8K_DIR / "test.jsonl"]
    await put_task_objects(store, RUN, "gsm8k", task_objects("gsm8k", files, split=None, count=0, seed=0, limit=20))
    pub = Publisher(store, RUN, PublisherConfig(extras_dir=model_dir))
    await pub.open()
    await pub.publish(load_hf_state(model_dir))


@needs_gsm8k
@pytest.mark.parametrize("engine", ["mlx", "transformers"])
async def test_local_eval_on_the_gsm8k_test_split(
    engine: str, store: Store, store_url: str, model_dir: Path, tmp_path: Path  # noqa: F811
) -> None:
    pytest.importorskip(ENGINE_NEEDS[engine])
    await seed_gsm8k_run(store, model_dir)
    out = tmp_path / "e.json"
    argv = ["eval", "--store", store_url, "--run", RUN, "--local", "--engine", engine, "--split", "test",
            "--k", "2", "--prompts", "3", "--seed", "0", "--json", str(out)]
    if engine == "transformers":
        argv += ["--device", "cpu"]
    assert await asyncio.to_thread(main, argv) == 0
    (row,) = json.loads(out.read_text())["versions"]
    assert (row["version"], row["split"], row["k"], row["n_prompts"], row["search_rate"]) == (0, "test", 2, 3, None)
    assert row["pass@1"] == 0.0  # a random tiny model does not solve GSM8K in 8 tokens
