"""What judging a run's records needs from the bucket besides the records: the task split
(prompts and labels) and the tokenizer (to decode completions and build the expected prompts).

The tokenizer comes from the run's latest anchor (`tokenizer.json` among its extras, with
`config.json` for the vocabulary and the end-of-sequence ids), unless a `decode` function is
injected (tests) or a local folder is given.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.anchor import download_extras
from slime_stoa.protocol.pulse.history import read_anchor_manifest, read_pointer
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.store import NotFound, Store
from slime_stoa.protocol.task_manifest import read_task_object
from slime_stoa.tasks import Task, load_task

from .scoring import Decode, PromptOf, load_prompt_builder, load_tokenizer, vocab_size_of


def task_data_key(manifest: RunManifest, split: str | None = None) -> str:
    """The key of the run's task data: its `split` (default: the manifest's training split)."""
    return RunLayout(manifest.run).task_data(manifest.task, manifest.task_split if split is None else split)


async def read_task(
    store: Store, manifest: RunManifest, split: str | None = None, *, trust: RunTrust | None = None
) -> Task:
    """The run's task, `split` of it (default: the manifest's training split), checked to be the
    task the manifest names. In a signed run the split's bytes are checked against the signed
    task manifest before they are parsed (`protocol.task_manifest`; TaskDataRefused, a
    ValueError, otherwise), under `trust` (default: the manifest's run key and its rotations)."""
    key = task_data_key(manifest, split)
    if trust is None and manifest.public_key is not None:
        trust = RunTrust(manifest.run, manifest.public_key)
    try:
        data = await read_task_object(store, manifest.run, manifest.task, split or manifest.task_split, trust)
    except NotFound:
        which = "task data" if split is None else f"{split!r} split of task {manifest.task!r}"
        raise ValueError(f"run {manifest.run!r} has no {which} at {key} in {store.url}") from None
    task = load_task(data)
    if task.name != manifest.task:
        raise ValueError(f"{key} holds task {task.name!r}; the run manifest says {manifest.task!r}")
    return task


async def download_tokenizer(store: Store, run: str, folder: Path) -> Path:
    """Write the latest anchor's config and tokenizer files into `folder`; returns `folder`."""
    pointer = await read_pointer(store, run)
    manifest = await read_anchor_manifest(store, pointer.anchor.manifest)
    await download_extras(store, manifest, folder)
    return folder


async def load_decoding(
    store: Store,
    manifest: RunManifest,
    task: Task,
    *,
    decode: Decode | None,
    eos_ids: frozenset[int],
    tokenizer_dir: Path | None,
    prompt_of: PromptOf | None,
    verify_prompts: bool,
) -> tuple[Decode, frozenset[int], PromptOf | None, int | None]:
    """(decode, eos_ids, prompt_of, vocabulary size or None) for judging the run's records.

    An injected `decode` is used as given (with `eos_ids` and `prompt_of`; the vocabulary is then
    the manifest's). Else the tokenizer of `tokenizer_dir`, or of the run's latest anchor when it
    is None (downloaded); `prompt_of` is built from it when `verify_prompts` and none is given;
    the vocabulary is the manifest's, else the tokenizer folder's."""
    vocab = manifest.vocab_size or None
    if decode is None:
        folder = tokenizer_dir
        if folder is None:
            folder = await download_tokenizer(store, manifest.run, Path(tempfile.mkdtemp(prefix="stoa-tokenizer-")))
        decode, eos_ids = load_tokenizer(folder)
        if verify_prompts and prompt_of is None:
            prompt_of = load_prompt_builder(folder, task)
        vocab = vocab or vocab_size_of(folder)
    return decode, eos_ids, prompt_of, vocab
