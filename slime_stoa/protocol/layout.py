"""The bucket layout of a run: the one place that knows the key of every object.

    runs/<run>/run.json                               run manifest (immutable)
    runs/<run>/current.json                           weight pointer (moves by CAS, only forward)
    runs/<run>/anchors/<v>-<a>/manifest.json          full-state anchor: manifest, written last
    runs/<run>/anchors/<v>-<a>/<file>                 its safetensors shards and HF config files
    runs/<run>/versions/<v>-<a>.json                  version manifest: patches that reach v
    runs/<run>/patches/<v>-<a>/<kind>-<base>.pulse    PULSE patch body base -> v
    runs/<run>/rollouts/<ts>-<worker>-<seq>.rec       train rollout-group records (immutable)
    runs/<run>/evals/<ts>-<worker>-<seq>.rec          eval rollout-group records (immutable)
    runs/<run>/workers/<worker>.json                  worker heartbeat
    runs/<run>/registry.json                          worker registry (signed by the run key)
    runs/<run>/tasks/<task>/<split>.jsonl.zst         task data of one split (`task_data`)
    runs/<run>/tasks/<task>/index/<file>              search index chunks, manifest.json last
    runs/<run>/trainer/<name>                         trainer state (cursors, ledgers)
    runs/<run>/eval-requests/<v>-<split>.json         eval request (trainer-written, `eval_request`)
    runs/<run>/planes/<plane>/current.json            a quantized plane's pointer (`RunLayout(run, plane)`)
    runs/<run>/planes/<plane>/{anchors,versions,patches}/...   its anchors, manifests and patches

A quantized plane (`QUANT_PLANES`: "int8", "int4"; `pulse.plane`) is published beside the bf16
weights under its own folder, with the same names inside it as the bf16 weights have under the
run's root: `RunLayout(run, plane)` builds and parses the keys of that plane only, so a key of
another plane (or of the bf16 weights) never parses as one of it.

`<v>` is the version zero-padded to 12 digits, `<a>` the publish attempt (8 hex digits, fresh
for every publish call) and `<ts>` a 13-digit millisecond timestamp, so listing order is version
order and time order. Weight objects carry the attempt so that a publisher that crashed or lost
a race never blocks a version: only the pointer's compare-and-swap decides which attempt became
version v, and the pointer and every manifest name the exact keys they stand on. Rollout keys lead with the time so the trainer
finds new records across all workers with one listing from a cursor (cost grows with new
records, not with the number of workers); within a worker they also sort by sequence. Anyone
holding a worker token can write under the rollouts prefix, so the trainer lists it only between
its cursor and a horizon (the run's clock tolerance, `max_clock_skew_s`, past its clock: a key that does not lead with a
timestamp, or leads with one further ahead, sorts after it and is never listed), moves the cursor
over junk too, and keeps in its state only valid names of registered workers
(`slime_stoa.trainer.consumer.discovery` states what junk can still cost). Workers stamp `<ts>`
with a clock corrected from the store's `Date` header, so honest keys are never far ahead.

Names (`check_name`, `check_worker_id`) are the one grammar for everything that becomes a key
segment or a local file name: run, task, split and file names are 1-64 of `[A-Za-z0-9._-]`,
starting with a letter or digit, not ending with '.', and not a Windows device name; worker ids
are 1-48 of `[a-z0-9-]`, starting with a letter or digit. Every name read back from the bucket
(a manifest's keys and file names, a heartbeat's worker id, a record's run and worker) is checked
against it before use, and the `parse_*` methods give back a key's parts only for keys this
layout could have built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_WORKER = re.compile(r"[a-z0-9][a-z0-9-]{0,47}")
_ATTEMPT = re.compile(r"[0-9a-f]{8}")
_VERSIONED = re.compile(r"(\d{12})-([0-9a-f]{8})")
_ROLLOUT_FILE = re.compile(r"(\d{13})-([a-z0-9][a-z0-9-]{0,47})-(\d{10})\.rec")
_PATCH_FILE = re.compile(r"(step|catchup)-(\d{12})\.pulse")
#: Names Windows reserves for devices, with or without an extension ("NUL", "con.txt"): a file of
#: that name cannot be created or read there, so no key or file name may be one.
_DEVICE = re.compile(r"(con|prn|aux|nul|com[0-9]|lpt[0-9])(\..*)?", re.IGNORECASE)
VERSION_DIGITS = 12
SEQ_DIGITS = 10
ROLLOUT_KINDS = {"train": "rollouts", "eval": "evals"}
#: The quantized weight planes a run may publish beside its bf16 weights (MLX affine, `pulse.plane`).
QuantPlane = Literal["int8", "int4"]
QUANT_PLANES: tuple[QuantPlane, ...] = get_args(QuantPlane)

# Every pattern above is matched with `fullmatch`: `re.match` with `$` also accepts a name that ends
# with a newline ("run\n"), which a key, a path or a log line must never carry.


def check_name(kind: str, name: str) -> str:
    """Validate a run, task or file name used inside keys and as a local file name.

    The grammar: 1-64 of `[A-Za-z0-9._-]`, starting with a letter or digit, not ending with a
    dot, and not a Windows device name. Such a name is one safe path component everywhere: no
    separator (`/`, `\\`), no `.` or `..`, no NUL or other control character, no space, no
    look-alike of any of them (only ASCII is allowed), nothing a file system rewrites.
    """
    if (
        not isinstance(name, str)
        or not _NAME.fullmatch(name)
        or name.endswith(".")
        or _DEVICE.fullmatch(name)
    ):
        raise ValueError(
            f"invalid {kind} name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit, not ending with '.', not a device name (con, nul, ...)"
        )
    return name


def check_worker_id(worker: str) -> str:
    """Validate a worker id: 1-48 of `[a-z0-9-]`, starting with a letter or digit, not a device name."""
    if not isinstance(worker, str) or not _WORKER.fullmatch(worker) or _DEVICE.fullmatch(worker):
        raise ValueError(
            f"invalid worker id {worker!r}: use 1-48 lowercase letters, digits or '-', "
            f"starting with a letter or digit (not a device name such as 'con' or 'nul')"
        )
    return worker


def check_plane(plane: object) -> QuantPlane:
    """`plane` if it names a quantized plane (`QUANT_PLANES`); ValueError otherwise."""
    for known in QUANT_PLANES:
        if plane == known and isinstance(plane, str):
            return known
    raise ValueError(f"quantized plane must be one of {QUANT_PLANES}, got {plane!r:.80}")


def _is_name(name: str) -> bool:
    try:
        check_name("file", name)
    except ValueError:
        return False
    return True


def version_str(version: int) -> str:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0 or version >= 10**VERSION_DIGITS:
        raise ValueError(f"invalid weight version {version!r}")
    return f"{version:0{VERSION_DIGITS}d}"


def check_attempt(attempt: str) -> str:
    if not isinstance(attempt, str) or not _ATTEMPT.fullmatch(attempt):
        raise ValueError(f"invalid publish attempt id {attempt!r}: expected 8 lowercase hex digits")
    return attempt


def versioned(version: int, attempt: str) -> str:
    """`<v>-<a>`: the name of one publish attempt of a version."""
    return f"{version_str(version)}-{check_attempt(attempt)}"


def parse_versioned(name: str) -> tuple[int, str] | None:
    match = _VERSIONED.fullmatch(name) if isinstance(name, str) else None
    return (int(match[1]), match[2]) if match else None


@dataclass(frozen=True, slots=True)
class RolloutKey:
    """The parts of a rollout record key."""

    kind: str
    timestamp_ms: int
    worker: str
    seq: int


@dataclass(frozen=True, slots=True)
class RunLayout:
    """The keys of run `run`; its weight keys (pointer, anchors, version manifests, patches) are
    those of the bf16 weights, or with `plane` those of that quantized plane."""

    run: str
    plane: QuantPlane | None = None

    def __post_init__(self) -> None:
        check_name("run", self.run)
        if self.plane is not None:
            check_plane(self.plane)

    @property
    def root(self) -> str:
        return f"runs/{self.run}/"

    @property
    def planes_prefix(self) -> str:
        """The folder of every quantized plane of the run."""
        return f"{self.root}planes/"

    @property
    def weights_root(self) -> str:
        """The folder of this layout's weights: the run's root (bf16) or its plane's folder."""
        return self.root if self.plane is None else f"{self.planes_prefix}{self.plane}/"

    def on_plane(self, plane: QuantPlane | None) -> RunLayout:
        """The layout of the same run's `plane` (None: its bf16 weights)."""
        return RunLayout(self.run, plane)

    # -- run and weights ---------------------------------------------------------------------
    @property
    def run_manifest(self) -> str:
        return f"{self.root}run.json"

    @property
    def pointer(self) -> str:
        return f"{self.weights_root}current.json"

    def key_rotation(self, seq: int) -> str:
        """Run key rotation `seq` (1, 2, ...), signed by the key before it (`run_trust`)."""
        if isinstance(seq, bool) or not isinstance(seq, int) or not 1 <= seq <= 999_999:
            raise ValueError(f"key rotation number must be 1..999999, got {seq!r}")
        return f"{self.root}keys/{seq:06d}.json"

    @property
    def anchors_prefix(self) -> str:
        return f"{self.weights_root}anchors/"

    def anchor_prefix(self, version: int, attempt: str) -> str:
        return f"{self.anchors_prefix}{versioned(version, attempt)}/"

    def anchor_manifest(self, version: int, attempt: str) -> str:
        return f"{self.anchor_prefix(version, attempt)}manifest.json"

    def anchor_file(self, version: int, attempt: str, name: str) -> str:
        return f"{self.anchor_prefix(version, attempt)}{check_name('file', name)}"

    @property
    def versions_prefix(self) -> str:
        return f"{self.weights_root}versions/"

    def version_manifest(self, version: int, attempt: str) -> str:
        return f"{self.versions_prefix}{versioned(version, attempt)}.json"

    def version_manifests_prefix(self, version: int) -> str:
        """List this prefix to find every attempt's manifest of one version."""
        return f"{self.versions_prefix}{version_str(version)}-"

    @property
    def patches_prefix(self) -> str:
        return f"{self.weights_root}patches/"

    def patch(self, version: int, attempt: str, kind: str, base: int) -> str:
        if kind not in ("step", "catchup"):
            raise ValueError(f"unknown patch kind {kind!r}")
        if base >= version:
            raise ValueError(f"a patch goes forward: base {base} must be below version {version}")
        return f"{self.patches_prefix}{versioned(version, attempt)}/{kind}-{version_str(base)}.pulse"

    # -- reading weight keys back (every key a pointer or manifest names is checked with these) --
    def parse_version_manifest(self, key: str) -> tuple[int, str] | None:
        """(version, attempt) of a version-manifest key of this run; None for any other key."""
        if not isinstance(key, str) or not key.startswith(self.versions_prefix) or not key.endswith(".json"):
            return None
        return parse_versioned(key[len(self.versions_prefix) : -len(".json")])

    def parse_anchor_file(self, key: str) -> tuple[int, str, str] | None:
        """(version, attempt, file name) of a key inside an anchor folder of this run (the manifest
        included); None for any other key, or a file name outside the name grammar."""
        if not isinstance(key, str) or not key.startswith(self.anchors_prefix):
            return None
        head, sep, name = key[len(self.anchors_prefix) :].partition("/")
        parsed = parse_versioned(head)
        if parsed is None or not sep or not _is_name(name):
            return None
        return parsed[0], parsed[1], name

    def parse_anchor_manifest(self, key: str) -> tuple[int, str] | None:
        """(version, attempt) of an anchor-manifest key of this run; None for any other key."""
        parsed = self.parse_anchor_file(key)
        return parsed[:2] if parsed is not None and parsed[2] == "manifest.json" else None

    def parse_patch(self, key: str) -> tuple[int, str, str, int] | None:
        """(version, attempt, kind, base) of a patch key of this run; None for any other key."""
        if not isinstance(key, str) or not key.startswith(self.patches_prefix):
            return None
        head, sep, tail = key[len(self.patches_prefix) :].partition("/")
        parsed = parse_versioned(head)
        match = _PATCH_FILE.fullmatch(tail) if sep else None
        if parsed is None or match is None:
            return None
        return parsed[0], parsed[1], match[1], int(match[2])

    def weight_object_version(self, key: str) -> tuple[int, str] | None:
        """(version, attempt) of any anchor, version-manifest or patch key; None otherwise."""
        for prefix in (self.anchors_prefix, self.versions_prefix, self.patches_prefix):
            if key.startswith(prefix):
                head = key[len(prefix) :].split("/", 1)[0].removesuffix(".json")
                return parse_versioned(head)
        return None

    # -- rollouts ----------------------------------------------------------------------------
    def rollouts_prefix(self, kind: str = "train") -> str:
        if kind not in ROLLOUT_KINDS:
            raise ValueError(f"unknown rollout kind {kind!r}; expected one of {sorted(ROLLOUT_KINDS)}")
        return f"{self.root}{ROLLOUT_KINDS[kind]}/"

    def rollout(self, worker: str, timestamp_ms: int, seq: int, kind: str = "train") -> str:
        check_worker_id(worker)
        if not 0 <= timestamp_ms < 10**13 or not 0 <= seq < 10**SEQ_DIGITS:
            raise ValueError(f"rollout timestamp {timestamp_ms} or sequence {seq} out of range")
        return f"{self.rollouts_prefix(kind)}{timestamp_ms:013d}-{worker}-{seq:010d}.rec"

    def rollout_after(self, timestamp_ms: int, kind: str = "train") -> str:
        """A listing cursor: `start_after` this to see records from `timestamp_ms` on."""
        return f"{self.rollouts_prefix(kind)}{max(timestamp_ms, 0):013d}"

    def parse_rollout(self, key: str) -> RolloutKey | None:
        """Split a rollout key into its parts; None for a key that is not a valid record key."""
        for kind in ROLLOUT_KINDS:
            prefix = self.rollouts_prefix(kind)
            if key.startswith(prefix):
                match = _ROLLOUT_FILE.fullmatch(key[len(prefix) :])
                if match and not _DEVICE.fullmatch(match[2]):
                    return RolloutKey(kind, int(match[1]), match[2], int(match[3]))
        return None

    # -- workers, tasks, trainer -------------------------------------------------------------
    @property
    def workers_prefix(self) -> str:
        return f"{self.root}workers/"

    def heartbeat(self, worker: str) -> str:
        return f"{self.workers_prefix}{check_worker_id(worker)}.json"

    def task_prefix(self, task: str) -> str:
        return f"{self.root}tasks/{check_name('task', task)}/"

    def task_file(self, task: str, name: str) -> str:
        return f"{self.task_prefix(task)}{check_name('file', name)}"

    def task_data(self, task: str, split: str) -> str:
        """The task data of one split (`stoa task prepare` writes it, workers draw prompts from it)."""
        return self.task_file(task, f"{check_name('task split', split)}.jsonl.zst")

    def task_manifest(self, task: str) -> str:
        """The signed task manifest (`protocol.task_manifest`): each task object's size and sha256,
        signed by the run key; written by `stoa task prepare --key`, read before any task object."""
        return self.task_file(task, "task.json")

    def task_index_file(self, task: str, name: str) -> str:
        """An object of the task's search index: `index/manifest.json` (written last) or a chunk."""
        return f"{self.task_prefix(task)}index/{check_name('file', name)}"

    def trainer_file(self, name: str) -> str:
        return f"{self.root}trainer/{check_name('file', name)}"

    # -- eval requests (trainer-written; `protocol.eval_request`) ----------------------------
    @property
    def eval_requests_prefix(self) -> str:
        return f"{self.root}eval-requests/"

    def eval_request(self, version: int, split: str) -> str:
        """The eval request of `version` over a task split: `eval-requests/<v>-<split>.json`."""
        return f"{self.eval_requests_prefix}{version_str(version)}-{check_name('task split', split)}.json"

    def parse_eval_request(self, key: str) -> tuple[int, str] | None:
        """(version, split) of an eval-request key of this run; None for any other key."""
        if not isinstance(key, str) or not key.startswith(self.eval_requests_prefix) or not key.endswith(".json"):
            return None
        head, sep, split = key[len(self.eval_requests_prefix) : -len(".json")].partition("-")
        if not sep or len(head) != VERSION_DIGITS or not head.isdigit() or not head.isascii() or not _is_name(split):
            return None
        return int(head), split

    @property
    def registry(self) -> str:
        """The worker registry: worker keys, signed by the run key (`protocol.registry`)."""
        return f"{self.root}registry.json"
