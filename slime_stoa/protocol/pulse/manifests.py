"""The JSON documents of the weight plane: the pointer, version manifests and anchor manifests.

Pure data with strict parsing: a document that does not parse is a `ManifestError` naming the key,
never a crash further down.

- The pointer (`current.json`) names the current version, its state digest and its manifest.
- A version manifest lists the patches that reach its version: a `step` patch from the previous
  version and optionally a `catchup` patch (absolute values, the union of every change since the
  last anchor), which is valid on ANY state from `base_min` to `base_max`. It also names the
  latest anchor at or below its version, and its parent version's manifest (the chain).
- An anchor manifest lists the safetensors shards and HF config files of a full state.
- The weight lineage (`Origin`, in each version manifest; the pointer carries its epoch): which
  version a version's weights were trained or restored from. The chain (`parent`) is how to get
  from v-1 to v; the lineage is where the weights come from. They differ only after a trainer
  restarted from an earlier version's checkpoint: the new branch's first version restores that
  version's weights (a new `epoch`), its patch still goes from the pointer's last version.

Nothing read from the bucket is trusted (every worker's token can write there), so parsing checks
every name and key against the layout grammar before anything uses it: the run name, the attempt,
and every key a document names must be exactly the layout's key for what it claims to be, inside
the document's own run (`runs/<run>/...`): a pointer names a version manifest of its version, a
version manifest names its own patches and its parent's and anchor's manifests, an anchor
manifest names files of its own folder whose names are single safe path components. Readers
that know where a document came from pass it (`Pointer.from_bytes(run=...)`,
`VersionManifest.from_bytes(key=...)`, `AnchorManifest.from_bytes(key=...)`) and the document must
then be the one that belongs there.

A quantized plane's documents (`layout.RunLayout(run, plane)`) carry their `plane`, and every key
they name is checked against that plane's layout; a document without one is of the bf16
weights (its bytes as before planes existed). A plane's version manifest also names the bf16
version it quantizes (`source`: same version, that version's manifest and state digest). A
reader of a plane's pointer passes the plane (`Pointer.from_bytes(plane=...)`): a pointer of
another plane (or of the bf16 weights) is refused.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from slime_stoa.protocol.hf.folders import WEIGHTS_NAME
from slime_stoa.protocol.layout import QuantPlane, RunLayout, check_attempt, check_name, check_plane, version_str
from slime_stoa.protocol.run_trust import RunTrust, Untrusted
from slime_stoa.protocol.signing import PublicKey, SignatureError, SigningKey
from slime_stoa.protocol.strict_json import check_timestamp, load_json

from .frames import PatchIndex
from .signed_bytes import Unsigned, signed_bytes, verify_signed_bytes

POINTER_FORMAT = "stoa.pointer/1"
VERSION_FORMAT = "stoa.version/1"
ANCHOR_FORMAT = "stoa.anchor/1"
_HEX = re.compile(r"[0-9a-f]{16,128}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
ANCHOR_MANIFEST_NAME = "manifest.json"
_SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


class ManifestError(ValueError):
    """A pointer or manifest is malformed or inconsistent."""


class UntrustedDocument(ManifestError, Untrusted):
    """A pointer or manifest is refused: a reader with a `RunTrust` found it unsigned, signed by
    a key it does not trust for its version, or without a content hash for an object it names."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Ref:
    """Where another manifest of the run lives."""

    version: int
    manifest: str  # key
    state_digest: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Origin:
    """Where a version's weights come from on the weight lineage.

    Read from documents without it (older publishers) as a straight line: epoch 0, step =
    version, trained from the chain parent.
    """

    epoch: int  # the branch: 0 until a trainer restarts from an earlier version, +1 at each such restart
    step: int  # training steps from the run's first version along the lineage (a restore adds none)
    parent: Ref | None  # the version these weights were trained or restored from; None for the first
    restored: bool = False  # the weights ARE the parent's (a trainer restart from its checkpoint)

    @property
    def parent_step(self) -> int | None:
        """The lineage step of `parent` (None without a parent)."""
        if self.parent is None:
            return None
        return self.step if self.restored else self.step - 1

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "parent": asdict(self.parent) if self.parent else None,
            "restored": self.restored,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Pointer:
    run: str
    version: int
    state_digest: str
    manifest: str  # key of this version's manifest
    anchor: Ref  # the latest anchor at or below `version`
    updated_at: float
    epoch: int = 0  # the lineage branch of `version` (its manifest's `lineage.epoch`)
    plane: QuantPlane | None = None  # a quantized plane's pointer (None: the bf16 weights')

    def to_bytes(self, key: SigningKey | None = None) -> bytes:
        """The pointer's JSON, signed by `key` when given."""
        return _dump(_without_plane({"format": POINTER_FORMAT, **asdict(self)}), key)

    @classmethod
    def from_bytes(
        cls, data: bytes, where: str = "pointer", *, run: str | None = None, trust: RunTrust | None = None,
        plane: QuantPlane | None = None,
    ) -> Pointer:
        """Parse a pointer; ManifestError if malformed. With `run`, it must be that run's; it
        must be `plane`'s (None: the bf16 weights'); with `trust`, signed by the run's newest
        key (UntrustedDocument otherwise)."""
        signer = _signer(trust, data, where)
        doc = _load(data, POINTER_FORMAT, where)
        pointer = cls(
            run=_run(doc, where),
            version=_version(doc, "version", where),
            state_digest=_digest(doc, "state_digest", where),
            manifest=_str(doc, "manifest", where),
            anchor=_ref(doc.get("anchor"), f"{where}.anchor"),
            updated_at=_time(doc, "updated_at", where),
            epoch=_int(doc, "epoch", where) if "epoch" in doc else 0,
            plane=_plane(doc, where),
        )
        if pointer.plane != plane:
            raise ManifestError(f"{where}: a pointer of {_plane_name(pointer.plane)}, not of {_plane_name(plane)}")
        if pointer.epoch > pointer.version:
            raise ManifestError(f"{where}: epoch {pointer.epoch} is past version {pointer.version}")
        if run is not None and pointer.run != run:
            raise ManifestError(f"{where}: names run {pointer.run!r}, not {run!r}")
        layout = RunLayout(pointer.run, pointer.plane)
        _check_version_key(layout, pointer.manifest, pointer.version, f"{where}.manifest")
        _check_anchor_ref(layout, pointer.anchor, pointer.version, f"{where}.anchor")
        _verify(trust, signer, where, None, pointer.run)
        return pointer


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
    sha256: str | None = None  # content hash of the object (signed runs require it; None: older publishers)

    def covers(self, version: int) -> bool:
        return self.base_min <= version <= self.base_max

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("kind", "key", "bytes", "count", "base_min", "base_max", "base_digest")}
        out["index"] = self.index.to_json()
        if self.sha256 is not None:
            out["sha256"] = self.sha256
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
            base_min=_version(doc, "base_min", where),
            base_max=_version(doc, "base_max", where),
            base_digest=base_digest,
            index=index,
            sha256=_sha256(doc, where),
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
    lineage: Origin | None = None  # None: a straight line (see `origin`)
    plane: QuantPlane | None = None  # a quantized plane's version (None: the bf16 weights')
    source: Ref | None = None  # a plane's version: the bf16 version it quantizes (same version)

    @property
    def origin(self) -> Origin:
        """The lineage of this version; for a document without one, trained from the chain parent."""
        if self.lineage is not None:
            return self.lineage
        return Origin(epoch=0, step=self.version, parent=self.parent)

    def patch(self, kind: str) -> PatchRef | None:
        return next((p for p in self.patches if p.kind == kind), None)

    def to_bytes(self, key: SigningKey | None = None) -> bytes:
        """The manifest's JSON, signed by `key` when given."""
        doc = {"format": VERSION_FORMAT, **{k: getattr(self, k) for k in ("run", "version", "attempt", "state_digest")}}
        doc["parent"] = asdict(self.parent) if self.parent else None
        doc["anchor"] = asdict(self.anchor)
        doc["anchor_bytes"] = self.anchor_bytes
        doc["since_anchor_bytes"] = self.since_anchor_bytes
        doc["patches"] = [p.to_json() for p in self.patches]
        doc["elements"] = self.elements
        doc["created_at"] = self.created_at
        if self.lineage is not None:
            doc["lineage"] = self.lineage.to_json()
        if self.plane is not None:
            doc["plane"] = self.plane
        if self.source is not None:
            doc["source"] = asdict(self.source)
        return _dump(doc, key)

    @classmethod
    def from_bytes(
        cls, data: bytes, where: str, *, key: str | None = None, trust: RunTrust | None = None
    ) -> VersionManifest:
        """Parse a version manifest; ManifestError if malformed or if it names a key outside
        its run or other than the layout's. With `key` (where it was read from), the manifest
        must be the one that belongs at that key (same run, version and attempt). With `trust`,
        it must be signed by the key of its version and carry every patch's content hash
        (UntrustedDocument otherwise)."""
        signer = _signer(trust, data, where)
        doc = _load(data, VERSION_FORMAT, where)
        patches = doc.get("patches")
        if not isinstance(patches, list) or len(patches) > 8:
            raise ManifestError(f"{where}: 'patches' must be a short list")
        manifest = cls(
            run=_run(doc, where),
            version=_version(doc, "version", where),
            attempt=_attempt(doc, where),
            state_digest=_digest(doc, "state_digest", where),
            parent=None if doc.get("parent") is None else _ref(doc["parent"], f"{where}.parent"),
            anchor=_ref(doc.get("anchor"), f"{where}.anchor"),
            anchor_bytes=_int(doc, "anchor_bytes", where),
            since_anchor_bytes=_int(doc, "since_anchor_bytes", where),
            patches=tuple(PatchRef.from_json(p, f"{where}.patches[{i}]") for i, p in enumerate(patches)),
            elements=_int(doc, "elements", where),
            created_at=_time(doc, "created_at", where),
            lineage=_origin(doc["lineage"], f"{where}.lineage") if doc.get("lineage") is not None else None,
            plane=_plane(doc, where),
            source=None if doc.get("source") is None else _ref(doc["source"], f"{where}.source"),
        )
        layout = RunLayout(manifest.run, manifest.plane)
        _check_source(manifest, f"{where}.source")
        if key is not None:
            _check_location(layout.parse_version_manifest(key), manifest, key, where)
        kinds = [p.kind for p in manifest.patches]
        if len(set(kinds)) != len(kinds):
            raise ManifestError(f"{where}: more than one patch of a kind")
        for i, p in enumerate(manifest.patches):
            if p.base_max >= manifest.version:
                raise ManifestError(f"{where}: patch {p.key} does not go forward")
            if p.kind == "step" and p.base_min != manifest.version - 1:
                raise ManifestError(f"{where}: the step patch must start at v{manifest.version - 1}")
            expected = layout.patch(manifest.version, manifest.attempt, p.kind, p.base_min)
            if p.key != expected:
                raise ManifestError(f"{where}.patches[{i}]: key {p.key!r:.200} is not this version's {p.kind} patch {expected}")
        if manifest.parent is not None:
            if manifest.parent.version != manifest.version - 1:
                raise ManifestError(f"{where}: parent v{manifest.parent.version} is not v{manifest.version - 1}")
            _check_version_key(layout, manifest.parent.manifest, manifest.parent.version, f"{where}.parent")
        _check_anchor_ref(layout, manifest.anchor, manifest.version, f"{where}.anchor")
        if manifest.lineage is not None:
            _check_origin(layout, manifest, f"{where}.lineage")
        _verify(trust, signer, where, manifest.version, manifest.run)
        if trust is not None and any(p.sha256 is None for p in manifest.patches):
            raise UntrustedDocument(f"{where}: a patch has no content hash", where)
        return manifest


@dataclass(frozen=True, slots=True, kw_only=True)
class AnchorFile:
    name: str
    key: str
    bytes: int
    xxh3: str  # xxh3-128 hex of the object's bytes
    sha256: str | None = None  # content hash (signed runs require it; None: older publishers)

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "key": self.key, "bytes": self.bytes, "xxh3": self.xxh3}
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class AnchorManifest:
    run: str
    version: int
    attempt: str
    state_digest: str
    weights: tuple[AnchorFile, ...]  # safetensors shards
    extras: tuple[AnchorFile, ...] = field(default=())  # config.json, tokenizer files, ...
    created_at: float = 0.0
    plane: QuantPlane | None = None  # a quantized plane's anchor (None: the bf16 weights')

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.weights + self.extras)

    def to_bytes(self, key: SigningKey | None = None) -> bytes:
        """The manifest's JSON, signed by `key` when given."""
        doc = {"format": ANCHOR_FORMAT, **{k: getattr(self, k) for k in ("run", "version", "attempt", "state_digest")}}
        doc["weights"] = [f.to_json() for f in self.weights]
        doc["extras"] = [f.to_json() for f in self.extras]
        doc["created_at"] = self.created_at
        if self.plane is not None:
            doc["plane"] = self.plane
        return _dump(doc, key)

    @classmethod
    def from_bytes(
        cls, data: bytes, where: str, *, key: str | None = None, trust: RunTrust | None = None
    ) -> AnchorManifest:
        """Parse an anchor manifest; ManifestError if malformed, if a file name is not a single
        safe path component (the layout's file-name grammar), or if a file's key is not that
        name inside this anchor's folder. With `key` (where it was read from), the manifest must
        be the one that belongs at that key (same run, version and attempt). With `trust`, it
        must be signed by the key of its version and carry every file's content hash."""
        signer = _signer(trust, data, where)
        doc = _load(data, ANCHOR_FORMAT, where)
        manifest = cls(
            run=_run(doc, where),
            version=_version(doc, "version", where),
            attempt=_attempt(doc, where),
            state_digest=_digest(doc, "state_digest", where),
            weights=_files(doc.get("weights"), f"{where}.weights"),
            extras=_files(doc.get("extras"), f"{where}.extras"),
            created_at=_time(doc, "created_at", where),
            plane=_plane(doc, where),
        )
        layout = RunLayout(manifest.run, manifest.plane)
        if key is not None:
            _check_location(layout.parse_anchor_manifest(key), manifest, key, where)
        if not manifest.weights:
            raise ManifestError(f"{where}: an anchor needs at least one weights file")
        seen: set[str] = set()
        for group, files in (("weights", manifest.weights), ("extras", manifest.extras)):
            for i, f in enumerate(files):
                at = f"{where}.{group}[{i}]"
                try:
                    expected = layout.anchor_file(manifest.version, manifest.attempt, f.name)
                except ValueError as exc:
                    raise ManifestError(f"{at}: {exc}") from None
                if f.key != expected:
                    raise ManifestError(f"{at}: key {f.key!r:.200} is not {expected}")
                folded = f.name.lower()  # case-insensitive file systems (macOS) would merge these
                if folded in seen or f.name == ANCHOR_MANIFEST_NAME:
                    raise ManifestError(f"{at}: file name {f.name!r} repeated or reserved")
                seen.add(folded)
                if group == "weights" and not (f.name == WEIGHTS_NAME or _SHARD.fullmatch(f.name)):
                    raise ManifestError(f"{at}: {f.name!r} is not a safetensors shard name")
                if group == "extras" and (f.name == WEIGHTS_NAME or _SHARD.fullmatch(f.name)):
                    raise ManifestError(f"{at}: {f.name!r} is a weights file listed as an extra")
        _verify(trust, signer, where, manifest.version, manifest.run)
        if trust is not None and any(f.sha256 is None for f in manifest.weights + manifest.extras):
            raise UntrustedDocument(f"{where}: a file has no content hash", where)
        return manifest


# -- names and keys ---------------------------------------------------------------------------------


def _check_location(parsed: tuple[int, str] | None, doc: VersionManifest | AnchorManifest, key: str, where: str) -> None:
    """A document read from `key` must be the document that belongs there."""
    if not isinstance(key, str) or not key.startswith(RunLayout(doc.run).root) or parsed != (doc.version, doc.attempt):
        raise ManifestError(
            f"{where}: the manifest of run {doc.run!r} v{doc.version} attempt {doc.attempt} does not belong at {key!r:.200}"
        )


def _check_source(manifest: VersionManifest, where: str) -> None:
    """A plane's version names the bf16 version it quantizes: the same version's manifest key of
    the run's bf16 weights; a bf16 version names none."""
    source = manifest.source
    if (manifest.plane is None) != (source is None):
        raise ManifestError(f"{where}: a plane's version (and only one) names its bf16 source version")
    if source is None:
        return
    if source.version != manifest.version:
        raise ManifestError(f"{where}: source v{source.version} is not v{manifest.version}")
    _check_version_key(RunLayout(manifest.run), source.manifest, source.version, where)


def _check_version_key(layout: RunLayout, key: str, version: int, where: str) -> None:
    parsed = layout.parse_version_manifest(key)
    if parsed is None or parsed[0] != version:
        raise ManifestError(f"{where}: {key!r:.200} is not a v{version} manifest key of {_of(layout)}")


def _check_origin(layout: RunLayout, manifest: VersionManifest, where: str) -> None:
    """A version's lineage must fit its chain: only the first version has no parent; a parent
    one version back is the chain parent itself; an earlier one (a branch) is a restore of it,
    with the same state digest; no more steps or epochs than versions."""
    origin, v = manifest.origin, manifest.version
    if origin.step > v or origin.epoch > v:
        raise ManifestError(f"{where}: step {origin.step} or epoch {origin.epoch} is past version {v}")
    parent = origin.parent
    if parent is None:
        if manifest.parent is not None or origin.step != 0 or origin.restored:
            raise ManifestError(f"{where}: only the first version (step 0, not restored) has no lineage parent")
        return
    if manifest.parent is None:
        raise ManifestError(f"{where}: the first version of the chain cannot have a lineage parent")
    if parent.version >= v:
        raise ManifestError(f"{where}: parent v{parent.version} is not before v{v}")
    _check_version_key(layout, parent.manifest, parent.version, f"{where}.parent")
    if parent.version == v - 1 and parent != manifest.parent:
        raise ManifestError(f"{where}: parent v{parent.version} is not the chain parent's manifest")
    if parent.version < v - 1 and not origin.restored:
        raise ManifestError(f"{where}: a lineage parent before v{v - 1} must be a restore of it")
    if origin.restored and parent.state_digest != manifest.state_digest:
        raise ManifestError(f"{where}: a restored version must have its parent's state digest")
    if not origin.restored and origin.step < 1:
        raise ManifestError(f"{where}: a trained version is at least step 1")


def _check_anchor_ref(layout: RunLayout, ref: Ref, version: int, where: str) -> None:
    if ref.version > version:
        raise ManifestError(f"{where}: anchor v{ref.version} is ahead of v{version}")
    parsed = layout.parse_anchor_manifest(ref.manifest)
    if parsed is None or parsed[0] != ref.version:
        raise ManifestError(f"{where}: {ref.manifest!r:.200} is not a v{ref.version} anchor manifest key of {_of(layout)}")


# -- strict JSON helpers --------------------------------------------------------------------------


def _dump(doc: Mapping[str, Any], key: SigningKey | None = None) -> bytes:
    """The document's bytes: signed in the signature-last layout (`signed_bytes`) when `key` is given."""
    if key is not None:
        return signed_bytes(doc, key)
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _signer(trust: RunTrust | None, data: bytes, where: str) -> PublicKey | None:
    """With a trust: the run key whose signature the raw bytes carry, checked BEFORE anything is
    parsed (a forged document costs no parse, however large); UntrustedDocument otherwise."""
    if trust is None:
        return None
    try:
        return verify_signed_bytes(data, trust.keys, where)
    except (Unsigned, SignatureError) as exc:
        raise UntrustedDocument(str(exc), where) from None


def _verify(trust: RunTrust | None, signer: PublicKey | None, where: str, version: int | None, run: str) -> None:
    """With a trust: the parsed document must be the trusted run's, and the key that signed its
    bytes (`_signer`) must be the key of its `version` (None: the pointer, the newest key)."""
    if trust is None:
        return
    if run != trust.run:
        raise UntrustedDocument(f"{where}: a document of run {run!r}, not {trust.run!r}", where)
    expected = trust.key_for(version)
    if signer != expected:
        signed_by = "unknown" if signer is None else signer.key_id
        raise UntrustedDocument(f"{where}: signed by key {signed_by}, not {expected.key_id} (the run key of its version)", where)


def _plane(doc: Mapping[str, Any], where: str) -> QuantPlane | None:
    """A document's `plane`: absent for the bf16 weights', else a quantized plane's name."""
    if "plane" not in doc:
        return None
    try:
        return check_plane(doc["plane"])
    except ValueError as exc:
        raise ManifestError(f"{where}: {exc}") from None


def _of(layout: RunLayout) -> str:
    return f"run {layout.run!r}" + ("" if layout.plane is None else f" plane {layout.plane}")


def _plane_name(plane: QuantPlane | None) -> str:
    return "the bf16 weights" if plane is None else f"plane {plane}"


def _without_plane(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` without a None `plane` (the bf16 weights' documents keep their bytes)."""
    if doc.get("plane") is None:
        doc.pop("plane", None)
    return doc


def _sha256(doc: Mapping[str, Any], where: str) -> str | None:
    value = doc.get("sha256")
    if value is None:
        return None
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise ManifestError(f"{where}: 'sha256' must be 64 hex digits")
    return value


def _load(data: bytes, fmt: str, where: str) -> dict[str, Any]:
    try:
        doc = load_json(data)
    except ValueError as exc:
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


def _version(doc: Mapping[str, Any], key: str, where: str) -> int:
    value = _int(doc, key, where)
    try:
        version_str(value)
    except ValueError:
        raise ManifestError(f"{where}: '{key}' {value} is not a weight version") from None
    return value


def _run(doc: Mapping[str, Any], where: str) -> str:
    value = doc.get("run")
    try:
        return check_name("run", value)  # type: ignore[arg-type]  # checked: anything else raises
    except ValueError as exc:
        raise ManifestError(f"{where}: {exc}") from None


def _attempt(doc: Mapping[str, Any], where: str) -> str:
    value = doc.get("attempt")
    try:
        return check_attempt(value)  # type: ignore[arg-type]  # checked: anything else raises
    except ValueError as exc:
        raise ManifestError(f"{where}: {exc}") from None


def _float(doc: Mapping[str, Any], key: str, where: str) -> float:
    value = doc.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ManifestError(f"{where}: '{key}' must be a finite number")
    return float(value)


def _time(doc: Mapping[str, Any], key: str, where: str) -> float:
    try:
        return check_timestamp(doc.get(key), f"'{key}'")
    except ValueError as exc:
        raise ManifestError(f"{where}: {exc}") from None


def _digest(doc: Mapping[str, Any], key: str, where: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not _HEX.fullmatch(value):
        raise ManifestError(f"{where}: '{key}' must be a hex digest")
    return value


def _ref(doc: Any, where: str) -> Ref:
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: expected an object")
    return Ref(
        version=_version(doc, "version", where),
        manifest=_str(doc, "manifest", where),
        state_digest=_digest(doc, "state_digest", where),
    )


def _origin(doc: Any, where: str) -> Origin:
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: expected an object")
    restored = doc.get("restored", False)
    if not isinstance(restored, bool):
        raise ManifestError(f"{where}: 'restored' must be true or false")
    return Origin(
        epoch=_int(doc, "epoch", where),
        step=_int(doc, "step", where),
        parent=None if doc.get("parent") is None else _ref(doc["parent"], f"{where}.parent"),
        restored=restored,
    )


def _files(docs: Any, where: str) -> tuple[AnchorFile, ...]:
    if not isinstance(docs, list) or len(docs) > 10_000:
        raise ManifestError(f"{where}: expected a list of files")
    out = []
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise ManifestError(f"{where}[{i}]: expected an object")
        name = _str(doc, "name", f"{where}[{i}]")
        try:
            check_name("file", name)  # one safe path component: it becomes a local file name
        except ValueError as exc:
            raise ManifestError(f"{where}[{i}]: {exc}") from None
        out.append(
            AnchorFile(
                name=name,
                key=_str(doc, "key", f"{where}[{i}]"),
                bytes=_int(doc, "bytes", f"{where}[{i}]"),
                xxh3=_digest(doc, "xxh3", f"{where}[{i}]"),
                sha256=_sha256(doc, f"{where}[{i}]"),
            )
        )
    return tuple(out)
