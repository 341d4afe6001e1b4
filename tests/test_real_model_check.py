"""The real model's per-plane logprob gap and PULSE at real learning rates, as a test: a short form
of `scripts/real_model_check.py` (whose full run gives docs/real-model.md its figures).

On SmolLM2-135M-Instruct and real GSM8K prompts, completions sampled by the worker's generator are
scored by each plane's worker model (bf16, int8, int4) and by the CPU learner: every group's mean
gap must stay under the quarantine's limit for its plane (an honest worker on that plane is never
quarantined), the planes must order as their precision does, and AdamW RL steps at two learning
rates must change more weights at the larger one, each changed weight costing the patch the bits
docs/real-model.md derives (about 16 per changed element).

The script runs in its own process: it chooses MLX's BLAS before MLX loads, as a worker does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_stoa.quickstart.real_model import RealModelUnavailable, smollm2_folder
from tests.shared_data import GSM8K_DIR

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("mlx_lm")
    pytest.importorskip("transformers")
    try:
        smollm2_folder()
    except RealModelUnavailable as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    if not (GSM8K_DIR / "test.jsonl").is_file():
        pytest.skip(f"no GSM8K test split at {GSM8K_DIR / 'test.jsonl'}")
    out = tmp_path_factory.mktemp("real_model_check") / "figures.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "real_model_check.py"), "--gsm8k", str(GSM8K_DIR), "--prompts", "4",
         "--group", "4", "--max-tokens", "64",
         "--steps", "1", "--lrs", "1e-6", "1e-5",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_planes_honest_gap_stays_under_its_quarantine_limit(figures: dict) -> None:
    planes = figures["planes"]
    assert set(planes) == {"bf16", "int8", "int4"}
    for plane, gap in planes.items():
        assert gap["tokens"] > 0
        assert gap["largest_group_mean"] < gap["quarantine_limit"], (plane, gap)
    # the bf16 worker computes the learner's function (float32 compute through a fast BLAS)
    assert planes["bf16"]["mean"] < 1e-3, planes["bf16"]
    assert figures["sampled_gap"]["bf16"]["mean"] < 1e-3, figures["sampled_gap"]
    # fewer bits, further from the learner: a plane that computed the wrong weights would not order
    assert planes["bf16"]["mean"] < planes["int8"]["mean"] < planes["int4"]["mean"], planes


@pytest.mark.slow
def test_pulse_at_real_learning_rates_changes_more_at_the_larger_one(figures: dict) -> None:
    small, large = figures["pulse"]["1e-06"][0], figures["pulse"]["1e-05"][0]
    assert 0 < small["changed_frac"] < large["changed_frac"] < 0.2, (small, large)
    for step in (small, large):
        # a bf16 value is 16 bits; the index costs a few more, the frames' compression wins some back
        assert 8 < step["bits_per_changed"] < 32, step
