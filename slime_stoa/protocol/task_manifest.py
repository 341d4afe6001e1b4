"""The signed task manifest of a signed run: `runs/<run>/tasks/<task>/task.json`.

Any worker's token can write the bucket, task data included: a replaced split would make the
trainer rescore records against forged labels and workers generate from forged prompts. So in a
signed run (its run manifest names a run key) `stoa task prepare --key` writes, beside the task
objects, one small document naming each task object (its file name in the task's folder) with
its size and sha256, signed by the run key:

    {"format": "stoa.task-manifest/1", "run": ..., "task": ...,
     "objects": {"train.jsonl.zst": {"size": 1234, "sha256": "<64 hex>"}, ...},
     "signature": {...}}

A reader reads the manifest with a size cap, checks its signature under the run's trust (any run
key it holds: a manifest signed before a rotation stays valid, as the worker registry does)
before it looks at any field, then reads the object no larger than the size the manifest signs
and checks its sha256 before parsing it. The search index is covered through its split: the task
data pins the index manifest's sha256, which pins every chunk.

`parse_task_manifest`, `task_manifest_bytes` and `check_task_object` are pure;
`read_task_object` is the IO edge every reader of task data goes through. An unsigned run
(`trust` None) reads its task objects as before.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .layout import RunLayout, check_name
from .run_trust import RunTrust, Untrusted, content_hash, load_rotations
from .shell import task_prepare_command
from .signing import PublicKey, SignatureError, SigningKey, canonical_json, sign_document, verify_document
from .store import NotFound, Store
from .store.capped import TooLarge, read_capped_bytes
from .strict_json import load_json

FORMAT = "stoa.task-manifest/1"
MAX_TASK_MANIFEST_BYTES = 64 << 10  # one entry is about 120 bytes
MAX_TASK_OBJECTS = 256
_HEX = frozenset("0123456789abcdef")


class TaskDataRefused(Untrusted):
    """A signed run's task object is refused: its task manifest is missing, forged or does not
    name it, or its bytes are not the ones the manifest signs. `key`: the object refused."""


@dataclass(frozen=True, slots=True)
class TaskObject:
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class TaskManifest:
    """A task's objects ({file name in the task's folder: size and sha256}), as the run key signed them."""

    run: str
    task: str
    objects: Mapping[str, TaskObject]

    def with_objects(self, objects: Mapping[str, bytes]) -> TaskManifest:
        """This manifest with `objects` ({file name: bytes}) added or replaced."""
        new = {name: TaskObject(len(data), content_hash(data)) for name, data in objects.items()}
        return TaskManifest(self.run, self.task, {**self.objects, **new})

    def to_doc(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "run": self.run, "task": self.task, "created_at": time.time(),
            "objects": {n: {"size": o.size, "sha256": o.sha256} for n, o in sorted(self.objects.items())},
        }


def empty_manifest(run: str, task: str) -> TaskManifest:
    return TaskManifest(check_name("run", run), check_name("task", task), {})


def task_manifest_bytes(manifest: TaskManifest, key: SigningKey) -> bytes:
    """The manifest signed by the run key `key`, as stored."""
    data = canonical_json(sign_document(manifest.to_doc(), key))
    if len(data) > MAX_TASK_MANIFEST_BYTES or len(manifest.objects) > MAX_TASK_OBJECTS:
        raise ValueError(f"task {manifest.task!r} has too many objects for one task manifest ({len(manifest.objects)})")
    return data


def parse_task_manifest(
    data: bytes, *, run: str, task: str, keys: PublicKey | Iterable[PublicKey], where: str
) -> TaskManifest:
    """The manifest `data` read from `where`: Untrusted unless it is at most
    MAX_TASK_MANIFEST_BYTES, signed by one of `keys`, and the manifest of `task` of `run` with
    well-formed entries (checked in that order: no field is trusted before the signature)."""
    try:
        doc = load_json(data, max_bytes=MAX_TASK_MANIFEST_BYTES)
        verify_document(doc, keys, where=where)
    except (SignatureError, ValueError) as exc:  # SignatureError is a ValueError; said as it is
        raise Untrusted(str(exc) if isinstance(exc, SignatureError) else f"{where}: {exc}", where) from None
    if set(doc) != {"format", "run", "task", "created_at", "objects", "signature"} or doc["format"] != FORMAT:
        raise Untrusted(f"{where}: not a {FORMAT} document", where)
    if doc["run"] != run or doc["task"] != task:
        raise Untrusted(f"{where}: the manifest of task {doc['task']!r:.80} of run {doc['run']!r:.80}, "
                        f"not of task {task!r} of run {run!r}", where)
    objects = doc["objects"]
    if not isinstance(objects, dict) or len(objects) > MAX_TASK_OBJECTS:
        raise Untrusted(f"{where}: objects must be a mapping of at most {MAX_TASK_OBJECTS}", where)
    return TaskManifest(run, task, {name: _entry(name, entry, where) for name, entry in objects.items()})


def _entry(name: str, entry: Any, where: str) -> TaskObject:
    try:
        check_name("file", name)
    except ValueError as exc:
        raise Untrusted(f"{where}: {exc}", where) from None
    size, sha = (entry.get("size"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
    if (not isinstance(entry, dict) or set(entry) != {"size", "sha256"} or isinstance(size, bool)
            or not isinstance(size, int) or size < 0 or not isinstance(sha, str) or len(sha) != 64
            or not set(sha) <= _HEX):
        raise Untrusted(f"{where}: entry {name!r} must be {{size: bytes, sha256: 64 hex digits}}", where)
    return TaskObject(size, sha)


def check_task_object(manifest: TaskManifest, name: str, data: bytes, *, key: str, repair: str) -> None:
    """TaskDataRefused unless `data` (the object `name`, at `key`) has the size and sha256 `manifest` signs."""
    entry = manifest.objects.get(name)
    if entry is None:
        raise TaskDataRefused(f"{key}: not in the run's signed task manifest: refused unread; {repair}", key)
    if len(data) != entry.size or content_hash(data) != entry.sha256:
        raise TaskDataRefused(
            f"{key}: not the task data the run key signed (its size or sha256 differs): refused unparsed; {repair}", key
        )


def prepare_repair(store_url: str, run: str, task: str, split: str) -> str:
    """How the operator writes the task data and its signed manifest again."""
    return f"the operator writes it again with `{task_prepare_command(task, split, store_url, run)} --key RUN_KEY_FILE`"


async def read_task_manifest(store: Store, run: str, task: str, trust: RunTrust) -> TaskManifest:
    """The task manifest of `task`, verified under `trust` (its rotations loaded first).
    NotFound when there is none; Untrusted when it does not check."""
    key = RunLayout(run).task_manifest(task)
    if not trust.loaded:
        await load_rotations(store, trust)
    try:
        data = await read_capped_bytes(store, key, MAX_TASK_MANIFEST_BYTES)
    except TooLarge as exc:
        raise Untrusted(f"{key}: {exc}", key) from None
    return parse_task_manifest(data, run=run, task=task, keys=trust.keys, where=key)


async def read_task_object(store: Store, run: str, task: str, split: str, trust: RunTrust | None) -> bytes:
    """The task data of `split`: in a signed run (`trust`) checked against the signed task
    manifest before it is returned (TaskDataRefused otherwise, naming the object and the repair);
    in an unsigned run read as it is. NotFound when the object itself is missing."""
    layout = RunLayout(run)
    key = layout.task_data(task, split)
    if trust is None:
        return await store.get_bytes(key)
    repair = prepare_repair(store.url, run, task, split)
    try:
        manifest = await read_task_manifest(store, run, task, trust)
    except NotFound:
        await store.head(key)  # the object missing too: NotFound, the task was never prepared
        raise TaskDataRefused(
            f"{key}: run {run!r} is signed but has no task manifest ({layout.task_manifest(task)}): refused unread; "
            f"{repair}", key
        ) from None
    except Untrusted as exc:
        raise TaskDataRefused(f"{key}: its task manifest is refused ({exc}); {repair}", key) from None
    name = key.removeprefix(layout.task_prefix(task))
    entry = manifest.objects.get(name)
    if entry is None:
        raise TaskDataRefused(f"{key}: not in the run's signed task manifest: refused unread; {repair}", key)
    try:
        data = await read_capped_bytes(store, key, entry.size)
    except TooLarge:
        raise TaskDataRefused(
            f"{key}: larger than the task data the run key signed ({entry.size:,} bytes): refused unread; {repair}", key
        ) from None
    check_task_object(manifest, name, data, key=key, repair=repair)
    return data


async def write_task_manifest(
    store: Store, run: str, task: str, objects: Mapping[str, bytes], key: SigningKey, trust: RunTrust
) -> str:
    """Sign `objects` ({split: task data}, just written) into the task's manifest, keeping the
    entries of its other splits when the bucket's manifest verifies under `trust` (one that does
    not is a forgery: replaced). Returns the manifest's key."""
    layout = RunLayout(run)
    try:
        manifest = await read_task_manifest(store, run, task, trust)
    except (NotFound, Untrusted):
        manifest = empty_manifest(run, task)
    names = {layout.task_data(task, split).removeprefix(layout.task_prefix(task)): data for split, data in objects.items()}
    where = layout.task_manifest(task)
    await store.put(where, task_manifest_bytes(manifest.with_objects(names), key))
    return where


__all__ = [
    "FORMAT", "MAX_TASK_MANIFEST_BYTES", "TaskDataRefused", "TaskManifest", "TaskObject", "check_task_object",
    "empty_manifest", "parse_task_manifest", "prepare_repair", "read_task_manifest", "read_task_object",
    "task_manifest_bytes", "write_task_manifest",
]
