"""The run manifest (`runs/<run>/run.json`): everything a worker needs to join a run.

Written once by the operator (`stoa run create`) with put-if-absent; workers and the trainer
read it. The model's weights, config and tokenizer come from the run's anchors, so a Mac needs
nothing but the bucket URL and the run name.

A signed run (`stoa run create --key`) carries its run key's public half (`run_key`) and is
signed by it; workers pin that key at `macd join` and refuse weights it (or a key it rotated
to, `run_trust`) did not sign. A manifest with a `run_key` that its key did not sign does not
parse; a reader that pinned a key (`read_run_manifest(pinned=...)`) refuses a manifest naming
another.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Literal, get_args

from .layout import QUANT_PLANES, QuantPlane, RunLayout, check_name
from .printable import names_shown
from .signing import SIGNATURE_FIELD, PublicKey, SignatureError, SigningKey, sign_document, verify_document
from .store import NotFound, Store
from .store.capped import TooLarge, read_capped_bytes
from .strict_json import load_json

log = logging.getLogger("stoa.run")

FORMAT = "stoa.run/1"
#: What workers serve: bf16 weights, or MLX affine int8 / 4-bit (group size 64) made from them.
#: A quantized plane the run publishes (`planes`) is downloaded and held alone; on a run whose own
#: `plane` is int8 unpublished a worker quantizes the bf16 weights itself (keeping them too); no
#: worker serves a quantized plane the run neither serves nor publishes (its records are refused).
Plane = Literal["bf16", "int8", "int4"]
PLANES: tuple[Plane, ...] = get_args(Plane)
MAX_MODEL_CHARS = 512
MAX_STOP = 16  # the trainer's RecordLimits.max_stop_sequences default
MAX_STOP_CHARS = 256
MAX_COUNT = 2**31 - 1  # every integer field (tokens, group sizes, limits) fits in int32
#: Largest run manifest read: its longest fields (16 stop strings of 256 characters, the model
#: name) take under 30 KiB even with every character escaped.
MAX_RUN_MANIFEST_BYTES = 64 << 10
#: Anchors a run keeps when its manifest does not say (manifests written before the field existed).
DEFAULT_RETAIN_ANCHORS = 2
_INT_FIELDS = (
    "max_tokens", "max_prompt_tokens", "group_size", "staleness_limit", "reuse_limit",
    "worker_groups_per_version", "vocab_size", "retain_anchors", "skip_solved_after",
)


@dataclass(frozen=True, kw_only=True)
class RunManifest:
    run: str  # run name
    model: str  # model reference for people (HF id or path); weights come from the anchors
    task: str  # task name (see slime_stoa.tasks); its data lives under runs/<run>/tasks/<task>/
    task_split: str = "train"  # which task file workers draw prompts from
    plane: Plane = "bf16"  # what workers serve by default: "bf16", "int8" or "int4" (MLX affine, group size 64)
    planes: tuple[QuantPlane, ...] = ()  # quantized planes the trainer publishes beside bf16 (`layout.QUANT_PLANES`)
    temperature: float = 1.0  # sampling temperature; the trainer's --rollout-temperature must match
    top_p: float = 1.0  # always 1: the trainer recomputes sampled-token logprobs exactly
    max_tokens: int = 512  # longest response
    max_prompt_tokens: int = 1024  # prompts longer than this are skipped by workers
    group_size: int = 8  # samples per prompt (slime's --n-samples-per-prompt)
    stop: tuple[str, ...] = ()  # stop sequences besides the tokenizer's end of turn
    staleness_limit: int = 4  # versions a group may lag behind the trainer when used
    reuse_limit: int = 1  # times a group may be used while fresh enough
    worker_groups_per_version: int = 0  # a worker pauses after this many groups with a GRPO signal on one version (0: never)
    # Worker-side dynamic sampling: groups whose rewards are all equal (no GRPO signal) are not
    # uploaded, only counted (the heartbeat's groups_filtered).
    dynamic_sampling: bool = False
    skip_solved_after: int = 0  # a worker skips a prompt once its last this-many groups were all correct (0: never)
    vocab_size: int = 0  # model vocabulary (0: taken from the anchor's config)
    # Weight retention: the publisher keeps the last this-many anchors and every version from
    # the oldest of them on, deleting older weight objects (0: keep every version). A trainer
    # setting (`stoa_retain_anchors`) overrides it.
    retain_anchors: int = DEFAULT_RETAIN_ANCHORS
    created_at: float = field(default_factory=time.time)
    run_key: str | None = None  # the run key's public half, "ed25519:..." (None: an unsigned run)

    def __post_init__(self) -> None:
        # Every field is read from the bucket, which any worker's token can write: check types
        # strictly (no bool for an int, no NaN), then values. Names used in keys follow the layout
        # grammar (`check_name`).
        check_name("run", self.run)
        check_name("task", self.task)
        check_name("task split", self.task_split)
        if not isinstance(self.model, str) or not 0 < len(self.model) <= MAX_MODEL_CHARS or not self.model.isprintable():
            raise ValueError(f"model must be 1-{MAX_MODEL_CHARS} printable characters, got {self.model!r:.80}")
        if not isinstance(self.plane, str) or self.plane not in PLANES:
            raise ValueError(f"plane must be one of {PLANES}, got {self.plane!r}")
        if (
            not isinstance(self.planes, tuple)
            or not all(isinstance(p, str) and p in QUANT_PLANES for p in self.planes)
            or len(set(self.planes)) != len(self.planes)
        ):
            raise ValueError(f"planes must be distinct names of {QUANT_PLANES}, got {self.planes!r:.80}")
        if self.plane == "int4" and "int4" not in self.planes:
            raise ValueError("plane int4 needs the int4 plane published (planes): workers quantize only int8 themselves")
        for name in ("temperature", "top_p", "created_at"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not 0 < self.temperature <= 10:
            raise ValueError(f"temperature must be in (0, 10], got {self.temperature}")
        if self.top_p != 1.0:
            raise ValueError("top_p must be 1.0: the trainer recomputes logprobs of the full distribution")
        for name in ("max_tokens", "max_prompt_tokens", "group_size", "reuse_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in _INT_FIELDS:
            if getattr(self, name) > MAX_COUNT:
                raise ValueError(f"{name} must be <= {MAX_COUNT}, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2: GRPO compares samples within a group")
        if min(self.staleness_limit, self.vocab_size, self.worker_groups_per_version, self.retain_anchors) < 0:
            raise ValueError("staleness_limit, vocab_size, worker_groups_per_version and retain_anchors must be >= 0")
        if not isinstance(self.dynamic_sampling, bool):
            raise ValueError(f"dynamic_sampling must be true or false, got {self.dynamic_sampling!r}")
        if self.skip_solved_after < 0:
            raise ValueError(f"skip_solved_after must be >= 0, got {self.skip_solved_after}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a tuple of non-empty strings")
        if len(self.stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop: at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters")
        if self.run_key is not None:
            PublicKey.from_text(self.run_key)  # ValueError naming the problem

    @property
    def public_key(self) -> PublicKey | None:
        """The run key (None for an unsigned run)."""
        return PublicKey.from_text(self.run_key) if self.run_key is not None else None

    def to_bytes(self, key: SigningKey | None = None) -> bytes:
        """The manifest's JSON; signed by `key`, which must be the manifest's `run_key`, when given
        (a signed run must be written signed: its readers refuse it otherwise)."""
        doc = {"format": FORMAT, **asdict(self)}
        if self.run_key is None:
            del doc["run_key"]  # unsigned runs keep the bytes older readers know
        if not self.planes:
            del doc["planes"]  # likewise runs that publish no quantized plane
        if key is not None:
            if self.run_key != key.public.to_text():
                raise ValueError(f"key {key.key_id} is not this run's run_key")
            doc = sign_document(doc, key)
        return json.dumps(doc, indent=2, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RunManifest:
        try:
            doc = load_json(data, max_bytes=MAX_RUN_MANIFEST_BYTES)
        except ValueError as exc:
            raise ValueError(f"run manifest is not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} run manifest")
        signed = dict(doc)
        doc.pop("format")
        signature = doc.pop(SIGNATURE_FIELD, None)
        run_key = doc.get("run_key")
        if run_key is not None or signature is not None:  # a signed run: its own key signed it
            try:
                verify_document(signed, PublicKey.from_text(run_key), where="run manifest")
            except (SignatureError, ValueError) as exc:
                raise ValueError(f"run manifest with run_key {str(run_key)[:60]!r}: {exc}") from None
        known = {f.name for f in fields(cls)}
        unknown = set(doc) - known
        if unknown:
            raise ValueError(f"run manifest has unknown fields {names_shown(unknown)} (written by a newer stoa?)")
        for name in ("stop", "planes"):
            if isinstance(doc.get(name), list):
                doc[name] = tuple(doc[name])
        try:
            return cls(**doc)
        except TypeError as exc:
            raise ValueError(f"run manifest: {exc}") from None

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.run)

    def offers(self, plane: str) -> bool:
        """Whether the trainer publishes quantized `plane` (a worker on it holds that plane alone)."""
        return plane in self.planes


class RunNotFound(LookupError, ValueError):
    """The bucket has no manifest for the run: it was never created (or the name is wrong)."""


class RunKeyMismatch(ValueError):
    """The run manifest does not carry (and so was not signed by) the run key a reader pinned."""


async def read_run_manifest(store: Store, run: str, *, pinned: str | None = None) -> RunManifest:
    """The manifest of `run` in `store` (`runs/<run>/run.json`): the one reader of it.

    RunNotFound when the run does not exist; ValueError when the manifest does not parse or
    describes another run (or is larger than MAX_RUN_MANIFEST_BYTES: read no further); StoreError
    when the bucket cannot be read. With `pinned` (public key text), RunKeyMismatch unless the
    manifest is signed by that key.
    """
    key = RunLayout(run).run_manifest
    try:
        data = await read_capped_bytes(store, key, MAX_RUN_MANIFEST_BYTES)
    except NotFound:
        raise RunNotFound(
            f"run {run!r} does not exist in {store.url} (no {key}): create it with `stoa run create`"
        ) from None
    except TooLarge as exc:
        raise ValueError(f"{exc} (in {store.url})") from None
    try:
        manifest = RunManifest.from_bytes(data)
    except ValueError as exc:
        raise ValueError(f"{key} in {store.url} is invalid: {exc}") from None
    if manifest.run != run:
        raise ValueError(f"{key} in {store.url} describes run {manifest.run!r}, not {run!r}")
    if pinned is not None and manifest.run_key != pinned:
        found = "no run key (unsigned)" if manifest.run_key is None else f"run key {manifest.public_key.key_id}"  # type: ignore[union-attr]
        raise RunKeyMismatch(
            f"{key} in {store.url} has {found}, not the pinned key {PublicKey.from_text(pinned).key_id}: refusing it"
        )
    return manifest


async def run_retention(store: Store, run: str) -> int:
    """How many anchors `run` keeps (`retain_anchors` of its manifest, 0: all), for the publisher.

    A run without a manifest (a bare publisher, as in tests) keeps DEFAULT_RETAIN_ANCHORS; one
    whose manifest does not parse keeps everything (a warning says why): nothing is deleted on
    the word of an unreadable object. StoreError when the bucket cannot be read.
    """
    try:
        return (await read_run_manifest(store, run)).retain_anchors
    except RunNotFound:
        return DEFAULT_RETAIN_ANCHORS
    except ValueError as exc:
        log.warning("%s; keeping every anchor until it is fixed", exc)
        return 0
