"""The search model reads the passages: on held-out questions the quickstart's trained model
answers better with the real retriever than with one that returns wrong passages.

One short `stoa quickstart --task search` run (warm start, then RL until the search rate has
climbed), then the held-out pass@1 of its last version twice through the same eval path
(`evaluation.local.local_eval`, as `quickstart.heldout.pass1_at` runs it): with the run's BM25
retriever (the summary's `eval_pass1_last`) and with `WrongPassages`, a retriever that answers each
query with random passages other than the ones BM25 finds. On the synthetic task each answer is
stated in one passage only, so a model that copies the answer off its observation loses it with
the wrong passages, while a model that ignored them (or a useless retriever that still raises the
search rate) would score the same both ways.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("torch")
pytest.importorskip("bm25s")
pytest.importorskip("matplotlib")

from slime_stoa.protocol.store import open_store
from slime_stoa.quickstart import heldout
from slime_stoa.quickstart.config import QuickstartConfig
from slime_stoa.tasks import tools
from slime_stoa.tasks.search.formats import format_passages
from slime_stoa.tasks.search.retriever import SearchTool


class WrongPassages:
    """The search tool with its answers swapped: for each query, `top_k` random passages of the
    run's corpus that BM25 does not return for it (the same count, size and format)."""

    def __init__(self, real: SearchTool, seed: int = 0):
        self.real = real
        self.rng = random.Random(seed)
        self.queries = 0

    async def prepare(self) -> None:
        await self.real.prepare()

    async def __call__(self, query: str) -> str:
        retriever = await self.real.retriever()
        cfg = self.real.task.config
        found = {h.index for h in retriever.search(query, cfg.top_k)}
        wrong: list[int] = []
        while len(wrong) < cfg.top_k:
            i = self.rng.randrange(len(retriever))
            if i not in found and i not in wrong:
                wrong.append(i)
        self.queries += 1
        return format_passages([retriever.passages[i] for i in wrong], max_chars=cfg.max_observation_chars)


@pytest.mark.slow  # one short search quickstart (shared with test_quickstart_search) and one more eval
def test_trained_search_model_needs_the_right_passages(
    short_search_quickstart: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out, s = short_search_quickstart
    real, last = s["eval_pass1_last"], s["last_version"]
    made: list[WrongPassages] = []

    async def wrong_pass1() -> float:
        cfg = QuickstartConfig(task="search", out=out)
        original = tools._FACTORIES["search"]

        def wrong_tool(task: Any, context: tools.ToolContext) -> WrongPassages:
            real_tool = original(task, context)
            assert isinstance(real_tool, SearchTool)
            made.append(WrongPassages(real_tool))
            return made[-1]

        tools.register_tool("search", wrong_tool)
        try:
            async with open_store(cfg.store_url) as store:
                return (await heldout.pass1_at(store, cfg.run, [last], seed=cfg.seed, work_dir=tmp_path))[last]
        finally:
            tools.register_tool("search", original)

    wrong = asyncio.run(wrong_pass1())
    print(f"held-out pass@1 at v{last}: real retriever {real:.3f}, wrong passages {wrong:.3f} "
          f"(search rate last {s['search_rate_last']:.2f})")
    assert made and made[0].queries > 0  # the eval asked the wrong retriever
    assert s["search_rate_last"] >= 0.5, s
    assert real >= wrong + 0.03, (real, wrong)
