"""Full-state anchors: bf16 safetensors shards plus HF config files, then a manifest.

An anchor folder in the bucket is a loadable HF checkpoint (shards named as HF does, an index
when there are several, config and tokenizer files), and its manifest — written last — lists
every file with its size, xxh3-128 digest and sha256 content hash and the state digest of the
weights. A signed manifest (a publisher with a run key) signs those hashes: a file whose bytes do
not hash to them is refused (`run_trust.ContentMismatch`) before it is used.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import xxhash

from slime_stoa.protocol.fsutil import atomic_write
from slime_stoa.protocol.hf.folders import INDEX_NAME, WEIGHTS_NAME, plan_shards, safe_child
from slime_stoa.protocol.hf.safetensors_io import FILE_MODE, read_safetensors, safetensors_bytes
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_trust import ContentMismatch, check_content, content_hash
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store

from .codec import PatchCorrupt
from .digest import StateDigest
from .manifests import AnchorFile, AnchorManifest, ManifestError
from .route import SpeedMeter


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def anchor_files(
    state: Mapping[str, np.ndarray], *, shard_bytes: int, extras: Sequence[Path] = ()
) -> list[tuple[str, bytes, bool]]:
    """(file name, bytes, is_weights) of an anchor: shards, an index if sharded, extra files."""
    shards = plan_shards(state, shard_bytes)
    names = shard_names(len(shards))
    files = [
        (name, safetensors_bytes({k: state[k] for k in keys}, metadata={"format": "pt"}), True)
        for name, keys in zip(names, shards, strict=True)
    ]
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": int(sum(a.nbytes for a in state.values()))},
            "weight_map": {k: name for name, keys in zip(names, shards, strict=True) for k in keys},
        }
        files.append((INDEX_NAME, json.dumps(index, indent=2, sort_keys=True).encode(), False))
    for path in extras:
        if path.name not in (WEIGHTS_NAME, INDEX_NAME):
            files.append((path.name, path.read_bytes(), False))
    return files


async def write_anchor(
    store: Store,
    layout: RunLayout,
    *,
    version: int,
    attempt: str,
    state: Mapping[str, np.ndarray],
    state_digest: str,
    extras: Sequence[Path] = (),
    shard_bytes: int = 1 << 30,
    concurrency: int = 4,
    key: SigningKey | None = None,
) -> tuple[str, AnchorManifest]:
    """Upload an anchor (files first, manifest last, signed by `key` when given); returns the
    manifest key and manifest."""
    files = await asyncio.to_thread(anchor_files, state, shard_bytes=shard_bytes, extras=extras)
    limit = asyncio.Semaphore(concurrency)

    async def upload(name: str, data: bytes) -> AnchorFile:
        file_key = layout.anchor_file(version, attempt, name)
        async with limit:
            await store.put_if_absent(file_key, data)
        return AnchorFile(
            name=name, key=file_key, bytes=len(data), xxh3=xxhash.xxh3_128_hexdigest(data), sha256=content_hash(data)
        )

    uploaded = await asyncio.gather(*(upload(name, data) for name, data, _ in files))
    weights = tuple(f for f, (_, _, is_w) in zip(uploaded, files, strict=True) if is_w)
    extras_out = tuple(f for f, (_, _, is_w) in zip(uploaded, files, strict=True) if not is_w)
    manifest = AnchorManifest(
        run=layout.run,
        version=version,
        attempt=attempt,
        state_digest=state_digest,
        weights=weights,
        extras=extras_out,
        created_at=time.time(),
        plane=layout.plane,
    )
    at = layout.anchor_manifest(version, attempt)
    await store.put_if_absent(at, manifest.to_bytes(key))
    return at, manifest


async def fetch_verified(store: Store, file: AnchorFile) -> bytes:
    """An anchor file's bytes, checked against its manifest entry: PatchCorrupt when its size or
    xxh3 differ, ContentMismatch when its sha256 (if the entry has one) differs."""
    data = await store.get_bytes(file.key)
    if file.sha256 is not None:  # the cryptographic check first: any change is a refusal
        if len(data) != file.bytes:
            raise ContentMismatch(f"anchor file {file.key}: {len(data)} bytes, its manifest says {file.bytes}", file.key)
        await asyncio.to_thread(check_content, data, file.sha256, file.key)
    if len(data) != file.bytes or xxhash.xxh3_128_hexdigest(data) != file.xxh3:
        raise PatchCorrupt(f"anchor file {file.key} does not match its manifest (size or digest)")
    return data


async def read_anchor(
    store: Store, manifest: AnchorManifest, *, concurrency: int = 4, meter: SpeedMeter | None = None
) -> tuple[dict[str, np.ndarray], StateDigest]:
    """Download and verify an anchor's weights; returns the bf16 state and its digest.

    With a `meter`, reports the download (all shards together), the digest time (as hashing) and
    the parse + digest time (as loading)."""
    limit = asyncio.Semaphore(concurrency)
    start = time.perf_counter()
    downloaded = [start]
    parsing = [0.0]

    async def load(file: AnchorFile) -> dict[str, tuple[str, np.ndarray]]:
        async with limit:
            data = await fetch_verified(store, file)
        downloaded.append(time.perf_counter())
        try:
            began = time.perf_counter()
            tensors = await asyncio.to_thread(read_safetensors, data)
            parsing[0] += time.perf_counter() - began
            return tensors
        except ValueError as exc:
            raise PatchCorrupt(f"anchor file {file.key}: {exc}") from None

    state: dict[str, np.ndarray] = {}
    for tensors in await asyncio.gather(*(load(f) for f in manifest.weights)):
        for name, (dtype, array) in tensors.items():
            if dtype != "BF16":
                raise PatchCorrupt(f"anchor tensor {name!r} is {dtype}, expected BF16")
            state[name] = array.view(np.uint16)  # fresh, writable, C-ordered (0-d stays 0-d)
    began = time.perf_counter()
    digest = await asyncio.to_thread(StateDigest.of, state)
    if meter is not None:
        elements, hashing = sum(a.size for a in state.values()), time.perf_counter() - began
        meter.download(sum(f.bytes for f in manifest.weights), max(downloaded) - start)
        meter.hash(elements, hashing)
        meter.load(elements, parsing[0] + hashing)
    if digest.root() != manifest.state_digest:
        raise PatchCorrupt(
            f"anchor v{manifest.version}: state digest {digest.root()} != {manifest.state_digest} in its manifest"
        )
    return state, digest


async def download_extras(store: Store, manifest: AnchorManifest, folder: Path) -> list[Path]:
    """Write an anchor's config/tokenizer files into `folder` (verified); returns their paths.

    Every file lands directly inside `folder` and nowhere else: its name must be one safe path
    component (ManifestError otherwise, before anything is fetched), and each file is written to
    a temp file and renamed into place, so a symlink already at that name is replaced, never
    followed."""
    folder.mkdir(parents=True, exist_ok=True)
    targets = []
    for file in manifest.extras:
        if file.name == INDEX_NAME:
            continue
        try:
            targets.append((file, safe_child(folder, file.name)))
        except ValueError as exc:
            raise ManifestError(f"anchor v{manifest.version} extra file: {exc}") from None
    paths = []
    for file, path in targets:
        data = await fetch_verified(store, file)
        await asyncio.to_thread(atomic_write, path, data, mode=FILE_MODE, durable=False)
        paths.append(path)
    return paths
