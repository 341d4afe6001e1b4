"""The JSON documents of the weight plane: the pointer, version manifests and anchor manifests.

Pure data with strict parsing: a document that does not parse is a `ManifestError` naming the key,
never a crash further down.

- The pointer (`current.json`) names the current version, its state digest and its manifest.
- A version manifest lists the patches that reach its version: a `step` patch from the previous
  version and optionally a `catchup` patch (absolute values, the union of every change since the
  last anchor), which is valid on ANY state from `base_min` to `base_max`. It also names the
  latest anchor at or below its version, and its parent version's manifest (the chain).
- An anchor manifest lists the safetensors shards and HF config files of a full state.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .frames import PatchIndex

POINTER_FORMAT = "stoa.pointer/1"
VERSION_FORMAT = "stoa.version/1"
ANCHOR_FORMAT = "stoa.anchor/1"
_HEX = re.compile(r"^[0-9a-f]{16,128}$")


class ManifestError(ValueError):
    """A pointer or manifest is malformed or inconsistent."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Ref:
    """Where another manifest of the run lives."""

    version: int
    manifest: str  # key
    state_digest: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Pointer:
    run: str
    version: int
    state_digest: str
    manifest: str  # key of this version's manifest
    anchor: Ref  # the latest anchor at or below `version`
    updated_at: float

    def to_bytes(self) -> bytes:
        return _dump({"format": POINTER_FORMAT, **asdict(self)})

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "pointer") -> Pointer:
        doc = _load(data, POINTER_FORMAT, where)
        return cls(
            run=_str(doc, "run", where),
            version=_int(doc, "version", where),
            state_digest=_digest(doc, "state_digest", where),
            manifest=_str(doc, "manifest", where),
            anchor=_ref(doc.get("anchor"), f"{where}.anchor"),
            updated_at=_float(doc, "updated_at", where),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PatchRef:
    """One patch object that reaches a version from any base in [base_min, base_max]."""

    kind: str  # "step" (from version - 1) or "catchup" (from any state since the anchor)
    key: str
    bytes: int
    count: int  # changed elements
    base_min: int
    base_max: int
    base_digest: str | None  # required state digest of the base (step patches)
    index: PatchIndex

    def covers(self, version: int) -> bool:
        return self.base_min <= version <= self.base_max

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("kind", "key", "bytes", "count", "base_min", "base_max", "base_digest")}
        out["index"] = self.index.to_json()
        return out

    @classmethod
    def from_json(cls, doc: Any, where: str) -> PatchRef:
        if not isinstance(doc, dict):
            raise ManifestError(f"{where}: expected an object")
        kind = _str(doc, "kind", where)
        if kind not in ("step", "catchup"):
            raise ManifestError(f"{where}: unknown patch kind {kind!r}")
        base_digest = doc.get("base_digest")
        if base_digest is not None:
            base_digest = _digest(doc, "base_digest", where)
        index_doc = doc.get("index")
        if not isinstance(index_doc, dict):
            raise ManifestError(f"{where}.index: not a JSON object")
        try:
            index = PatchIndex.from_json(index_doc)
        except Exception as exc:  # PatchCorrupt, or anything a hostile document triggers
            raise ManifestError(f"{where}.index: {exc}") from None
        ref = cls(
            kind=kind,
            key=_str(doc, "key", where),
            bytes=_int(doc, "bytes", where),
            count=_int(doc, "count", where),
            base_min=_int(doc, "base_min", where),
            base_max=_int(doc, "base_max", where),
            base_digest=base_digest,
            index=index,
        )
        if ref.base_min > ref.base_max or ref.bytes != index.body_size or ref.count != index.count:
            raise ManifestError(f"{where}: inconsistent patch entry (bases, size or count)")
        if kind == "step" and (ref.base_min != ref.base_max or base_digest is None):
            raise ManifestError(f"{where}: a step patch needs exactly one base and its digest")
        if index.mode == "rel" and base_digest is None:
            raise ManifestError(f"{where}: a base-relative patch needs its base digest")
        return ref


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionManifest:
    run: str
    version: int
    attempt: str
    state_digest: str
    parent: Ref | None  # None for the first version
    anchor: Ref  # latest anchor at or below this version (itself when it wrote one)
    anchor_bytes: int  # size of that anchor's files, to cost the anchor path without a GET
    since_anchor_bytes: int  # step-patch bytes published since that anchor (the anchor policy)
    patches: tuple[PatchRef, ...]
    elements: int  # bf16 elements in the state (a full sync costs 2 bytes each)
    created_at: float

    def patch(self, kind: str) -> PatchRef | None:
        return next((p for p in self.patches if p.kind == kind), None)

    def to_bytes(self) -> bytes:
        doc = {"format": VERSION_FORMAT, **{k: getattr(self, k) for k in ("run", "version", "attempt", "state_digest")}}
        doc["parent"] = asdict(self.parent) if self.parent else None
        doc["anchor"] = asdict(self.anchor)
        doc["anchor_bytes"] = self.anchor_bytes
        doc["since_anchor_bytes"] = self.since_anchor_bytes
        doc["patches"] = [p.to_json() for p in self.patches]
        doc["elements"] = self.elements
        doc["created_at"] = self.created_at
        return _dump(doc)

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> VersionManifest:
        doc = _load(data, VERSION_FORMAT, where)
        patches = doc.get("patches")
        if not isinstance(patches, list) or len(patches) > 8:
            raise ManifestError(f"{where}: 'patches' must be a short list")
        manifest = cls(
            run=_str(doc, "run", where),
            version=_int(doc, "version", where),
            attempt=_str(doc, "attempt", where),
            state_digest=_digest(doc, "state_digest", where),
            parent=None if doc.get("parent") is None else _ref(doc["parent"], f"{where}.parent"),
            anchor=_ref(doc.get("anchor"), f"{where}.anchor"),
            anchor_bytes=_int(doc, "anchor_bytes", where),
            since_anchor_bytes=_int(doc, "since_anchor_bytes", where),
            patches=tuple(PatchRef.from_json(p, f"{where}.patches[{i}]") for i, p in enumerate(patches)),
            elements=_int(doc, "elements", where),
            created_at=_float(doc, "created_at", where),
        )
        for p in manifest.patches:
            if p.base_max >= manifest.version:
                raise ManifestError(f"{where}: patch {p.key} does not go forward")
        if manifest.anchor.version > manifest.version:
            raise ManifestError(f"{where}: anchor {manifest.anchor.version} is ahead of the version")
        return manifest


@dataclass(frozen=True, slots=True, kw_only=True)
class AnchorFile:
    name: str
    key: str
    bytes: int
    xxh3: str  # xxh3-128 hex of the object's bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class AnchorManifest:
    run: str
    version: int
    attempt: str
    state_digest: str
    weights: tuple[AnchorFile, ...]  # safetensors shards
    extras: tuple[AnchorFile, ...] = field(default=())  # config.json, tokenizer files, ...
    created_at: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.weights + self.extras)

    def to_bytes(self) -> bytes:
        doc = {"format": ANCHOR_FORMAT, **{k: getattr(self, k) for k in ("run", "version", "attempt", "state_digest")}}
        doc["weights"] = [asdict(f) for f in self.weights]
        doc["extras"] = [asdict(f) for f in self.extras]
        doc["created_at"] = self.created_at
        return _dump(doc)

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> AnchorManifest:
        doc = _load(data, ANCHOR_FORMAT, where)
        return cls(
            run=_str(doc, "run", where),
            version=_int(doc, "version", where),
            attempt=_str(doc, "attempt", where),
            state_digest=_digest(doc, "state_digest", where),
            weights=_files(doc.get("weights"), f"{where}.weights"),
            extras=_files(doc.get("extras"), f"{where}.extras"),
            created_at=_float(doc, "created_at", where),
        )


# -- strict JSON helpers --------------------------------------------------------------------------


def _dump(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _load(data: bytes, fmt: str, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise ManifestError(f"{where}: expected a {fmt} document")
    return doc


def _str(doc: Mapping[str, Any], key: str, where: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value or len(value) > 1024:
        raise ManifestError(f"{where}: '{key}' must be a non-empty string")
    return value


def _int(doc: Mapping[str, Any], key: str, where: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ManifestError(f"{where}: '{key}' must be a non-negative integer")
    return value


def _float(doc: Mapping[str, Any], key: str, where: str) -> float:
    value = doc.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ManifestError(f"{where}: '{key}' must be a number")
    return float(value)


def _digest(doc: Mapping[str, Any], key: str, where: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not _HEX.match(value):
        raise ManifestError(f"{where}: '{key}' must be a hex digest")
    return value


def _ref(doc: Any, where: str) -> Ref:
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: expected an object")
    return Ref(
        version=_int(doc, "version", where),
        manifest=_str(doc, "manifest", where),
        state_digest=_digest(doc, "state_digest", where),
    )


def _files(docs: Any, where: str) -> tuple[AnchorFile, ...]:
    if not isinstance(docs, list) or len(docs) > 10_000:
        raise ManifestError(f"{where}: expected a list of files")
    out = []
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise ManifestError(f"{where}[{i}]: expected an object")
        out.append(
            AnchorFile(
                name=_str(doc, "name", f"{where}[{i}]"),
                key=_str(doc, "key", f"{where}[{i}]"),
                bytes=_int(doc, "bytes", f"{where}[{i}]"),
                xxh3=_digest(doc, "xxh3", f"{where}[{i}]"),
            )
        )
    return tuple(out)
