"""Seed a complete run in a store for tests and the quickstart: model, manifest, task, anchor."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import PreconditionFailed, Store
from slime_stoa.tasks import generate_items
from slime_stoa.tasks.objects import put_task_objects, task_objects

from .tiny_model import FAMILIES, build_tiny_family


def synthetic_texts(count: int = 2000, seed: int = 0) -> list[str]:
    """Text of the synthetic task to train the tiny tokenizer on (prompts and answers)."""
    items = generate_items(count, seed=seed)
    return [f"{i.prompt} {i.label}" for i in items] + [i.prompt for i in items]


async def seed_run(
    store: Store,
    manifest: RunManifest,
    model_dir: Path,
    *,
    task_count: int = 2000,
    publisher: PublisherConfig | None = None,
    key: SigningKey | None = None,
    objects: dict[str, bytes] | None = None,
) -> Publisher:
    """Write run.json, the task (`objects`: {split: encoded task data}, as `stoa task prepare`
    makes them; default the generated synthetic train split) and anchor v0 of `model_dir`;
    returns the publisher.

    With the run key `key`, the run is signed: the manifest carries its public half (set here
    when `manifest.run_key` is None), the task's signed manifest is written beside its objects,
    and everything the publisher writes is signed. A run that
    already exists is resumed: the publisher continues from the bucket."""
    if key is not None and manifest.run_key is None:
        manifest = replace(manifest, run_key=key.public.to_text())
    with contextlib.suppress(PreconditionFailed):
        await store.put_if_absent(RunLayout(manifest.run).run_manifest, manifest.to_bytes(key))
    if objects is None:
        objects = task_objects(manifest.task, [], split=manifest.task_split, count=task_count, seed=0, limit=None)
    await put_task_objects(store, manifest.run, manifest.task, objects, key=key)  # signed: with its task manifest
    pub = Publisher(store, manifest.run, publisher or PublisherConfig(extras_dir=model_dir), key=key)
    if await pub.open() is None:
        await pub.publish(load_hf_state(model_dir))
    return pub


def tiny_synthetic_model(folder: Path, family: str = "qwen2", **kwargs: Any) -> Path:
    """A tiny model of `family` whose tokenizer was trained on the synthetic task's text."""
    return tiny_family_model(folder, family, texts=synthetic_texts(), **kwargs)


def tiny_family_model(
    folder: Path, family: str, *, texts: Iterable[str], num_layers: int | None = None, **shape: Any
) -> Path:
    """A tiny random model of `family` (`tiny_model.FAMILIES`); `shape`: the builder's arguments
    (hidden_size, num_heads, num_kv_heads, intermediate_size, added_tokens), its defaults otherwise.

    With `num_layers`, LFM2 models get one attention layer (the second) among short-convolution
    layers, and LFM2-MoE models a dense first layer and experts in every other (8 experts, 2
    routed per token), so both need at least 2 layers."""
    if family in ("qwen2", "llama"):
        depth = {} if num_layers is None else {"num_layers": num_layers}
        return build_tiny_family(folder, family, texts=texts, **depth, **shape)
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    if num_layers is not None:
        if num_layers < 2:
            raise ValueError(f"a tiny {family} model needs 2 layers or more (got {num_layers})")
        shape["layer_types"] = ["full_attention" if i == 1 else "conv" for i in range(num_layers)]
        if family == "lfm2_moe":
            shape["num_dense_layers"] = 1
    if family == "lfm2_moe" and "hidden_size" in shape:
        shape.setdefault("moe_intermediate_size", max(int(shape["hidden_size"]) // 2, 16))
    return build_tiny_family(folder, family, texts=texts, **shape)
