"""`stoa eval --local`: every kept version sampled with macd's MLX path (in its own process), written as
CSV, JSON and a learning-curve PNG; and the command's refusals."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from slime_stoa.cli import main
from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.store import Store
from tests.test_eval_fleet import RUN, model_dir, seed_eval_run  # noqa: F401  (fixture)


async def test_local_eval_of_every_version_writes_csv_json_and_png(
    store: Store, store_url: str, store_env: dict[str, str], model_dir: Path, tmp_path: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig

    for name, value in store_env.items():
        monkeypatch.setenv(name, value)
    await seed_eval_run(store, model_dir)
    pub = Publisher(store, RUN, PublisherConfig(extras_dir=model_dir))
    await pub.open()
    state = load_hf_state(model_dir)
    for bits in state.values():
        flat = bits.reshape(-1)
        flat[np.random.default_rng(0).random(flat.size) < 0.02] ^= 1
    await pub.publish(state)
    out = tmp_path / "out"
    argv = ["eval", "--store", store_url, "--run", RUN, "--all", "--local", "--split", "test", "--k", "3",
            "--prompts", "4", "--seed", "1", "--csv", str(out / "e.csv"), "--png", str(out / "e.png"),
            "--json", str(out / "e.json")]
    import asyncio

    assert await asyncio.to_thread(main, argv) == 0
    doc = json.loads((out / "e.json").read_text())
    assert [v["version"] for v in doc["versions"]] == [0, 1]
    for v in doc["versions"]:
        assert (v["k"], v["n_prompts"], v["split"], v["search_rate"]) == (3, 4, "test", None)
        assert 0.0 <= v["pass@1"] <= v["pass@k"] <= 1.0
    rows = list(csv.DictReader((out / "e.csv").open()))
    assert [r["version"] for r in rows] == ["0", "1"] and set(rows[0]) >= {"pass@1", "pass@k", "k", "n_prompts"}
    assert (out / "e.png").read_bytes().startswith(b"\x89PNG")


async def test_refusals_name_the_problem(
    store: Store, store_url: str, model_dir: Path, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    import asyncio

    await seed_eval_run(store, model_dir)
    base = ["eval", "--store", store_url, "--run", RUN]
    assert await asyncio.to_thread(main, [*base, "--all"]) == 1
    assert "--all needs --local" in capsys.readouterr().err
    assert await asyncio.to_thread(main, [*base, "--local", "--version", "5"]) == 1
    assert "v5" in capsys.readouterr().err
    assert await asyncio.to_thread(main, [*base, "--local", "--split", "dev"]) == 1
    assert "no 'dev' split" in capsys.readouterr().err
