"""What the consumer needs from the run before it can judge a record: the run manifest, the
task data (prompts and labels) and the tokenizer (to decode completions), all from the bucket
(`slime_stoa.judging.run_data`), and the resolved config.

The run key: a run whose manifest names one is a signed run (records must carry a worker key's
signature, see `slime_stoa.judging.signers`). The manifest is in the bucket, which every worker
can write, so a trainer given the key it expects (`ConsumerConfig.run_key`) refuses a manifest
naming another key or none.

With `ConsumerConfig.keep_dir` the trainer keeps its own copy of the manifest it accepted
(`slime_stoa.protocol.kept`): a manifest a bucket writer deleted or replaced (refused as another
key's, or not parsing) is put back from it, and the trainer starts all the same. Without that
copy, a manifest gone or garbage raises `pause.Broken` naming the repair, and
`RolloutConsumer.open` waits for it; so does one naming another run key than `run_key` when the
run's weight pointer is signed by `run_key` (the key is the run's: the manifest is a forgery).
When nothing in the bucket is that key's, the mismatch is refused at once: most likely the
trainer's own `run_key` is wrong, which no waiting repairs.

In a signed run the task data is checked against its signed task manifest
(`slime_stoa.protocol.task_manifest`): a split replaced or a manifest gone or forged raises
`pause.Broken` too, so the trainer waits for `stoa task prepare ... --key` instead of rescoring
records against labels a bucket writer chose.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from slime_stoa.judging.run_data import load_decoding, read_task
from slime_stoa.judging.scoring import Decode, PromptOf, Rescorer
from slime_stoa.protocol.kept import TrainerCopies
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.history import NotPublished, read_pointer, signs_pointer
from slime_stoa.protocol.pulse.manifests import ManifestError
from slime_stoa.protocol.run_manifest import RunKeyMismatch, RunManifest, RunNotFound, read_run_manifest
from slime_stoa.protocol.run_trust import (
    RunTrust,
    Untrusted,
    first_run_key,
    keep_rotations,
    load_rotations,
    put_back_rotations,
)
from slime_stoa.protocol.shell import task_prepare_command
from slime_stoa.protocol.signing import PublicKey
from slime_stoa.protocol.store import NotFound, Store
from slime_stoa.protocol.task_manifest import TaskDataRefused
from slime_stoa.tasks import Task

from .config import ConsumerConfig, ResolvedConfig
from .pause import Broken


@dataclass(frozen=True)
class RunContext:
    manifest: RunManifest
    task: Task
    config: ResolvedConfig
    rescorer: Rescorer
    run_key: PublicKey | None = None  # None: an unsigned run


async def open_run_context(
    store: Store,
    config: ConsumerConfig,
    *,
    decode: Decode | None = None,
    eos_ids: frozenset[int] = frozenset(),
    tokenizer_dir: Path | None = None,
    prompt_of: PromptOf | None = None,
) -> RunContext:
    """Read the manifest and task, load the tokenizer, resolve the config.

    `decode`: use this decoder (with `eos_ids`) instead of the run's tokenizer; the vocabulary
    then comes from the manifest or `config.record_limits`. `tokenizer_dir`: a local HF folder
    with `tokenizer.json` to use instead of downloading the anchor's. `prompt_of`: build the
    expected prompt tokens with this instead of the run's tokenizer (with a custom `decode`,
    prompts are checked only when it is given).
    """
    manifest = await kept_run_manifest(store, config)
    run_key = manifest.public_key
    task = await signed_task(store, config, manifest)
    decode, eos_ids, prompt_of, vocab = await load_decoding(
        store, manifest, task, decode=decode, eos_ids=eos_ids, tokenizer_dir=tokenizer_dir, prompt_of=prompt_of,
        verify_prompts=config.verify_prompts,
    )
    if config.record_limits is not None:
        vocab = config.record_limits.vocab_size
    if not vocab:
        raise ValueError(
            f"the vocabulary size of run {config.run!r} is unknown: set vocab_size in its manifest, "
            f"or give record_limits"
        )
    resolved = config.resolved(manifest, vocab_size=vocab)
    return RunContext(
        manifest=manifest, task=task, config=resolved, rescorer=Rescorer(task, decode, eos_ids, prompt_of), run_key=run_key
    )


async def signed_task(store: Store, config: ConsumerConfig, manifest: RunManifest) -> Task:
    """The run's training split; one a bucket writer deleted from a signed run's task manifest
    or replaced (its bytes not the ones the run key signed) raises `pause.Broken`, so the trainer
    waits for the operator to prepare it again instead of rescoring against forged labels."""
    try:
        return await read_task(store, manifest)
    except TaskDataRefused as exc:
        raise Broken(f"the task data of run {config.run!r} in {store.url} is refused", task_repair(config, manifest),
                     exc) from exc


def task_repair(config: ConsumerConfig, manifest: RunManifest) -> str:
    """How an operator puts a signed run's task data back."""
    command = task_prepare_command(manifest.task, manifest.task_split, config.store_url, config.run)
    return f"write it again with `{command} --key <run key file>` (the files it was prepared from)"


async def kept_run_manifest(store: Store, config: ConsumerConfig) -> RunManifest:
    """The run manifest (pinned to `config.run_key`, or the first key it vouches for); with
    `config.keep_dir`, the trainer's own copy put back when the bucket's is gone or refused, and
    the accepted one kept (and so are the key rotations)."""
    copies = TrainerCopies.at(config.keep_dir)
    key = RunLayout(config.run).run_manifest
    if copies is not None:
        await put_back_rotations(store, config.run, copies)
    # A trainer restarted with a rotated key: run.json names the run's first key, which the
    # configured one vouches for through the rotations' acceptances.
    pinned = await first_run_key(store, config.run, config.run_key)
    try:
        manifest = await read_run_manifest(store, config.run, pinned=pinned)
    except (RunNotFound, ValueError) as exc:  # gone, garbage, or another key's (RunKeyMismatch)
        if copies is None or copies.kept(key) is None:
            if isinstance(exc, RunKeyMismatch) and not await run_key_vouched(store, config):
                raise  # nothing in the bucket is signed by the configured key: likely its own config, said at once
            raise Broken(
                f"the run manifest {key} in {store.url} is gone or refused", manifest_repair(config), exc
            ) from exc
        await copies.put_back(store, key, f"was refused ({exc})")
        manifest = await read_run_manifest(store, config.run, pinned=pinned)
    if copies is not None:
        with contextlib.suppress(NotFound, ValueError):  # swapped since it was read: kept next time
            data = await store.get_bytes(key)
            if RunManifest.from_bytes(data) == manifest:
                copies.keep(key, data)
        if manifest.run_key is not None:  # and the rotations from its key, as far as they verify
            trust = RunTrust.from_text(config.run, manifest.run_key)
            with contextlib.suppress(Untrusted):
                await load_rotations(store, trust)
            await keep_rotations(store, copies, trust)
    return manifest


async def run_key_vouched(store: Store, config: ConsumerConfig) -> bool:
    """Whether the run's weight pointer verifies under the configured `run_key` (alone, or
    through the rotations from the first key it vouches for): then that key is the run's and a
    manifest naming another one is a bucket writer's forgery, which the trainer waits out like a
    deleted one instead of stopping on. False when there is no key, no pointer yet, or the
    pointer is not that key's (a wrong `run_key` in the trainer's config: reported at once)."""
    first = await first_run_key(store, config.run, config.run_key)
    if first is None or config.run_key is None:
        return False
    if await signs_pointer(store, config.run, PublicKey.from_text(config.run_key)):
        return True  # the key itself signed it (a trainer's current key), whatever the rotations say
    try:
        await read_pointer(store, config.run, trust=RunTrust.from_text(config.run, first))
    except (NotPublished, ManifestError, ValueError):
        return False
    return True


def manifest_repair(config: ConsumerConfig) -> str:
    """How an operator puts a run manifest back that the trainer keeps no copy of."""
    return (
        f"re-create it with `stoa run create --store {config.store_url} --run {config.run} --key <run key file> ...` "
        f"(the options it was created with), and give the trainer a keep_dir so it puts it back itself"
    )
