"""Eval pass@1 of a quickstart run on its held-out `test` split, at given versions.

Each version's weights are rebuilt from the bucket (verified against the run key of a signed
run) and the test prompts sampled with macd's MLX path, the one the workers use, in its own
process (`evaluation.local.local_eval`; a search task's index is fetched and queried here, as a
worker does), each sample scored with the task's reward. It runs after the workers have stopped,
so it has the cores to itself. The synthetic task's test split is generated with another seed
than its train split; the search task's (questions never trained on) is written with the run's
index.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from slime_stoa.protocol.run_manifest import read_run_manifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store
from slime_stoa.tasks.objects import put_task_objects, task_objects

if TYPE_CHECKING:
    from slime_stoa.evaluation.local import EvalProgress

SPLIT = "test"
EVAL_PROMPTS = 64  # prompts of the test split evaluated
EVAL_K = 4  # samples per prompt (pass@1 is their mean pass rate: less noise than one sample)
SYNTHETIC_TEST_SEED = 1  # the train split is seed 0


async def put_synthetic_test_split(store: Store, run: str, *, key: SigningKey | None = None) -> None:
    """The synthetic task's held-out split (put-if-absent: a rerun writes nothing new); in a
    signed run (the run key `key`) added to the signed task manifest, which readers check it by."""
    objects = task_objects("synthetic", [], split=SPLIT, count=EVAL_PROMPTS, seed=SYNTHETIC_TEST_SEED, limit=None)
    await put_task_objects(store, run, "synthetic", objects, key=key)


async def pass1_at(
    store: Store, run: str, versions: Iterable[int], *, seed: int, work_dir: Path | None = None,
    prompts: int = EVAL_PROMPTS, k: int = EVAL_K, on_progress: Callable[[EvalProgress], None] | None = None,
) -> dict[int, float]:
    """{version: pass@1 on the test split's first `prompts` prompts, `k` samples each} with the
    run's sampling (temperature, max tokens); `on_progress` as each version's sampling starts and
    goes (`evaluation.local.local_eval`: in tokens of the budget for a single-turn task, moving
    with every decode step; in prompts for the search task)."""
    from slime_stoa.evaluation.local import local_eval

    manifest = await read_run_manifest(store, run)
    trust = RunTrust.from_text(run, manifest.run_key) if manifest.run_key else None
    out = {}
    with tempfile.TemporaryDirectory(prefix="stoa-eval-", dir=work_dir) as tmp:
        for version in sorted(set(versions)):
            result = await local_eval(
                store, manifest, version=version, split=SPLIT, k=k, n_prompts=prompts,
                max_tokens=manifest.max_tokens, temperature=manifest.temperature, work_dir=Path(tmp) / f"v{version}",
                threshold=1.0, seed=seed, trust=trust, on_progress=on_progress,
            )
            out[version] = float(result.row()["pass@1"])
    return out
