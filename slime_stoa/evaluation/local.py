"""Eval without the fleet: a version's weights rebuilt from the bucket and sampled in-process,
scored with the split's task reward. Two engines:

* ``mlx`` (the default): macd's MLX generation path (`macd.evaluate.answer_prompts`, the one
  workers use); needs the worker extra (mlx, mlx-lm).
* ``transformers``: `slime_stoa.evaluation.hf_generate` on the trainer box (a GPU when there is
  one), the same episodes driven by transformers' `generate`; needs the trainer extra.

The int8 plane is not emulated: the version's bf16 state is what is sampled.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Literal

from slime_stoa.protocol.hf.folders import save_hf_folder
from slime_stoa.protocol.pulse.anchor import download_extras
from slime_stoa.protocol.pulse.history import read_anchor_manifest, rebuild
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.store import Store
from slime_stoa.tasks.prompting import prompt_tokens
from slime_stoa.tasks.tools import ToolContext, tool_for

from .collect import read_split
from .report import PromptResult, VersionResult

Engine = Literal["mlx", "transformers"]
ENGINES: tuple[Engine, ...] = ("mlx", "transformers")


async def _inline(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


async def local_eval(
    store: Store, manifest: RunManifest, *, version: int, split: str, k: int, n_prompts: int | None,
    max_tokens: int, temperature: float, work_dir: Path, threshold: float, seed: int | None = None,
    trust: RunTrust | None = None, engine: Engine = "mlx", device: str | None = None,
) -> VersionResult:
    """k samples for each of the split's first `n_prompts` prompts (None: all) from `version`,
    sampled by `engine` (`device`: the transformers engine's torch device, default a GPU if any)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    task = await read_split(store, manifest, split)
    items = task.items[: len(task) if n_prompts is None else n_prompts]
    rebuilt = await rebuild(store, manifest.run, version, trust=trust)
    anchor = await read_anchor_manifest(store, rebuilt.manifest.anchor.manifest, trust=trust)
    folder = work_dir / f"v{version}"
    await download_extras(store, anchor, folder / "extras")
    await asyncio.to_thread(save_hf_folder, rebuilt.state, folder, source_dir=folder / "extras")
    tool = None
    if task.tool_format is not None:
        tool = tool_for(task, ToolContext(run=manifest.run, store=store, data_dir=work_dir))
    if engine == "transformers":
        from .hf_generate import default_device, hf_answer_prompts, load_hf_model

        model, tokenizer = await asyncio.to_thread(load_hf_model, folder, device or default_device())
        prompts = [prompt_tokens(tokenizer, task, item) for item in items]
        groups: list[list[Any]] = await hf_answer_prompts(
            model, tokenizer, task, prompts, temperature=temperature, max_tokens=max_tokens, k=k,
            stop=manifest.stop, seed=seed, tool=tool,
        )
    else:
        from macd.evaluate import answer_prompts
        from macd.generate import load_model

        model, tokenizer = load_model(folder)
        prompts = [prompt_tokens(tokenizer, task, item) for item in items]
        groups = await answer_prompts(
            model, tokenizer, task, prompts, temperature=temperature, max_tokens=max_tokens, k=k,
            stop=manifest.stop, seed=seed, mlx=_inline, tool=tool,
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
