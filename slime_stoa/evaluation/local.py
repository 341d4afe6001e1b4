"""Eval without the fleet: a version's weights rebuilt from the bucket and sampled in-process with
macd's MLX generation path (`macd.evaluate.answer_prompts`, the one workers use), scored with
the split's task reward. Needs the worker extra (mlx, mlx-lm); the int8 plane is not emulated:
the version's bf16 state is what is sampled.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from slime_stoa.protocol.hf.folders import save_hf_folder
from slime_stoa.protocol.pulse.anchor import download_extras
from slime_stoa.protocol.pulse.history import read_anchor_manifest, rebuild
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.store import Store
from slime_stoa.tasks.prompting import prompt_tokens

from .collect import read_split
from .report import PromptResult, VersionResult


async def _inline(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


async def local_eval(
    store: Store, manifest: RunManifest, *, version: int, split: str, k: int, n_prompts: int | None,
    max_tokens: int, temperature: float, work_dir: Path, threshold: float, seed: int | None = None,
    trust: RunTrust | None = None,
) -> VersionResult:
    """k samples for each of the split's first `n_prompts` prompts (None: all) from `version`."""
    from macd.evaluate import answer_prompts
    from macd.generate import load_model

    task = await read_split(store, manifest, split)
    items = task.items[: len(task) if n_prompts is None else n_prompts]
    rebuilt = await rebuild(store, manifest.run, version, trust=trust)
    anchor = await read_anchor_manifest(store, rebuilt.manifest.anchor.manifest, trust=trust)
    folder = work_dir / f"v{version}"
    await download_extras(store, anchor, folder / "extras")
    await asyncio.to_thread(save_hf_folder, rebuilt.state, folder, source_dir=folder / "extras")
    model, tokenizer = load_model(folder)
    tool = None
    if task.tool_format is not None:
        from macd.tools import ToolContext, tool_for

        tool = tool_for(task, ToolContext(run=manifest.run, store=store, data_dir=work_dir))
    prompts = [prompt_tokens(tokenizer, task, item) for item in items]
    groups = await answer_prompts(
        model, tokenizer, task, prompts, temperature=temperature, max_tokens=max_tokens, k=k, stop=manifest.stop,
        seed=seed, mlx=_inline, tool=tool,
    )
    results = tuple(
        PromptResult(
            prompt_index=item.index,
            rewards=tuple(float(task.reward(c.text, item.label)) for c in group),
            truncated=tuple(c.finish_reason in ("length", "turns") for c in group),
            tool_calls=tuple(int(c.tool_calls) for c in group) if tool is not None else None,
        )
        for item, group in zip(items, groups, strict=True)
    )
    return VersionResult(version, split, k, results, threshold)
