"""Full-state anchors: bf16 safetensors shards plus HF config files, then a manifest.

An anchor folder in the bucket is a loadable HF checkpoint (shards named as HF does, an index
when there are several, config and tokenizer files), and its manifest — written last — lists
every file with its size, xxh3-128 digest and sha256 content hash and the state digest of the
weights. A signed manifest (a publisher with a run key) signs those hashes: a file whose bytes do
not hash to them is refused (`run_trust.ContentMismatch`) before it is used.

The writer holds one file's bytes at a time (`write_anchor`): shards are planned from the
tensors' shapes alone and each is built, hashed, uploaded and dropped before the next, so an
anchor version costs one shard of memory beyond the state, not a serialized copy of it; a state
read on demand (`step_diff.TensorsOnDemand`) is read once per tensor.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from slime_stoa.protocol.fsutil import atomic_write
from slime_stoa.protocol.hf.folders import INDEX_NAME, WEIGHTS_NAME, plan_shards, safe_child
from slime_stoa.protocol.hf.safetensors_io import FILE_MODE, le_bytes, parse_header, plan_header, read_safetensors
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_trust import ContentMismatch, check_content, content_hash
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store

from .codec import PatchCorrupt
from .digest import StateDigest
from .manifests import AnchorFile, AnchorManifest, ManifestError
from .route import SpeedMeter
from .step_diff import TensorsOnDemand


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


SHARD_METADATA = {"format": "pt"}  # what transformers wants in a checkpoint's header


@dataclass(frozen=True, slots=True)
class AnchorPart:
    """One file of an anchor, not built yet: `build()` returns its bytes (a weights shard reads
    its tensors then), so a writer holds one file's bytes at a time."""

    name: str
    is_weights: bool
    build: Callable[[], bytes | bytearray]


def stand_ins(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each tensor's shape and dtype as an array of no bytes (a broadcast scalar): what plans the
    shards, their headers and the index without reading a tensor (a `TensorsOnDemand` state
    fetches from the weights' holder on every read)."""
    if isinstance(state, TensorsOnDemand):
        return {name: np.broadcast_to(np.zeros((), np.uint16), shape) for name, shape in state.shapes.items()}
    return {name: np.broadcast_to(np.zeros((), bits.dtype), bits.shape) for name, bits in state.items()}


def shard_bytes_of(state: Mapping[str, np.ndarray], names: Sequence[str], specs: Mapping[str, np.ndarray]) -> bytearray:
    """The safetensors bytes of `state`'s tensors `names` (`safetensors_bytes`' own, byte for
    byte) in one buffer of their size: the header planned from the stand-ins `specs`, then each
    tensor read once and copied to its place, one at a time (`plan_header` and `le_bytes` are
    `safetensors_bytes`' own header plan and byte view, so the bytes are its)."""
    header, _ = plan_header({name: specs[name] for name in names}, None, SHARD_METADATA)
    planned = parse_header(header, len(header) + sum(specs[name].nbytes for name in names))
    out = bytearray(planned.data_start + (planned.tensors[-1].end if planned.tensors else 0))
    with memoryview(out) as view:  # a slice of a memoryview never resizes: a size mismatch raises
        view[: len(header)] = header
        for entry in planned.tensors:
            bits = state[entry.name]
            if tuple(bits.shape) != entry.shape or bits.dtype != specs[entry.name].dtype:
                raise ValueError(f"tensor {entry.name!r}: read as {bits.dtype}{tuple(bits.shape)}, planned otherwise")
            view[planned.data_start + entry.begin : planned.data_start + entry.end] = le_bytes(bits).data
            del bits  # before the next read: one tensor read at a time
    return out


def anchor_files(
    state: Mapping[str, np.ndarray], *, shard_bytes: int, extras: Sequence[Path] = ()
) -> list[AnchorPart]:
    """The files of an anchor, in manifest order: shards, an index if sharded, extra files."""
    specs = stand_ins(state)
    shards = plan_shards(specs, shard_bytes)
    names = shard_names(len(shards))
    files = [
        AnchorPart(name, True, functools.partial(shard_bytes_of, state, keys, specs))
        for name, keys in zip(names, shards, strict=True)
    ]
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": int(sum(a.nbytes for a in specs.values()))},
            "weight_map": {k: name for name, keys in zip(names, shards, strict=True) for k in keys},
        }
        files.append(AnchorPart(INDEX_NAME, False, functools.partial(_json_bytes, index)))
    for path in extras:
        if path.name not in (WEIGHTS_NAME, INDEX_NAME):
            files.append(AnchorPart(path.name, False, path.read_bytes))
    return files


def _json_bytes(doc: object) -> bytes:
    return json.dumps(doc, indent=2, sort_keys=True).encode()


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
    manifest key and manifest.

    One file at a time: each is built, hashed, uploaded and dropped before the next is built, so
    the anchor holds one shard's bytes at most (plus the tensor being copied into it), never a
    serialized copy of the whole state. `concurrency` is accepted and not used: the chain's call
    passes its config's value."""
    del concurrency
    uploaded: list[tuple[AnchorFile, bool]] = []
    for part in anchor_files(state, shard_bytes=shard_bytes, extras=extras):
        uploaded.append((await _upload(store, layout.anchor_file(version, attempt, part.name), part), part.is_weights))
    manifest = AnchorManifest(
        run=layout.run,
        version=version,
        attempt=attempt,
        state_digest=state_digest,
        weights=tuple(f for f, is_w in uploaded if is_w),
        extras=tuple(f for f, is_w in uploaded if not is_w),
        created_at=time.time(),
        plane=layout.plane,
    )
    at = layout.anchor_manifest(version, attempt)
    await store.put_if_absent(at, manifest.to_bytes(key))
    return at, manifest


async def _upload(store: Store, file_key: str, part: AnchorPart) -> AnchorFile:
    """Build one anchor file, upload it and return its manifest entry; its bytes are dropped on return."""
    data = await asyncio.to_thread(part.build)
    xxh3, sha256 = await asyncio.to_thread(lambda: (xxhash.xxh3_128_hexdigest(data), content_hash(data)))
    await store.put_if_absent(file_key, data)
    return AnchorFile(name=part.name, key=file_key, bytes=len(data), xxh3=xxh3, sha256=sha256)


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
