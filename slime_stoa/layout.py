"""The bucket layout of a run: the one place that knows the key of every object.

    runs/<run>/run.json                               run manifest (immutable)
    runs/<run>/current.json                           weight pointer (moves by CAS, only forward)
    runs/<run>/anchors/<v>/manifest.json              full-state anchor: manifest, written last
    runs/<run>/anchors/<v>/<file>                     its safetensors shards and HF config files
    runs/<run>/versions/<v>.json                      version manifest: patches that reach v
    runs/<run>/patches/<v>/from-<base>.pulse          PULSE patch body base -> v
    runs/<run>/rollouts/<ts>-<worker>-<seq>.rec       train rollout-group records (immutable)
    runs/<run>/evals/<ts>-<worker>-<seq>.rec          eval rollout-group records (immutable)
    runs/<run>/workers/<worker>.json                  worker heartbeat
    runs/<run>/tasks/<task>/<name>                    task data
    runs/<run>/trainer/<name>                         trainer state (cursors, ledgers)

`<v>` is the version zero-padded to 12 digits and `<ts>` a 13-digit millisecond timestamp, so
listing order is version order and time order. Rollout keys lead with the time so the trainer
finds new records across all workers with one listing from a cursor (cost grows with new
records, not with the number of workers); within a worker they also sort by sequence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_WORKER = re.compile(r"^[a-z0-9][a-z0-9-]{0,47}$")
_ROLLOUT_FILE = re.compile(r"^(\d{13})-([a-z0-9][a-z0-9-]{0,47})-(\d{10})\.rec$")
VERSION_DIGITS = 12
ROLLOUT_KINDS = {"train": "rollouts", "eval": "evals"}


def check_name(kind: str, name: str) -> str:
    """Validate a run, task or file name used inside keys."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"invalid {kind} name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit"
        )
    return name


def check_worker_id(worker: str) -> str:
    if not isinstance(worker, str) or not _WORKER.match(worker):
        raise ValueError(
            f"invalid worker id {worker!r}: use 1-48 lowercase letters, digits or '-', "
            f"starting with a letter or digit"
        )
    return worker


def version_str(version: int) -> str:
    if not isinstance(version, int) or version < 0 or version >= 10**VERSION_DIGITS:
        raise ValueError(f"invalid weight version {version!r}")
    return f"{version:0{VERSION_DIGITS}d}"


@dataclass(frozen=True, slots=True)
class RolloutKey:
    """The parts of a rollout record key."""

    kind: str
    timestamp_ms: int
    worker: str
    seq: int


@dataclass(frozen=True, slots=True)
class RunLayout:
    run: str

    def __post_init__(self) -> None:
        check_name("run", self.run)

    @property
    def root(self) -> str:
        return f"runs/{self.run}/"

    # -- run and weights ---------------------------------------------------------------------
    @property
    def run_manifest(self) -> str:
        return f"{self.root}run.json"

    @property
    def pointer(self) -> str:
        return f"{self.root}current.json"

    @property
    def anchors_prefix(self) -> str:
        return f"{self.root}anchors/"

    def anchor_prefix(self, version: int) -> str:
        return f"{self.anchors_prefix}{version_str(version)}/"

    def anchor_manifest(self, version: int) -> str:
        return f"{self.anchor_prefix(version)}manifest.json"

    def anchor_file(self, version: int, name: str) -> str:
        return f"{self.anchor_prefix(version)}{check_name('file', name)}"

    @property
    def versions_prefix(self) -> str:
        return f"{self.root}versions/"

    def version_manifest(self, version: int) -> str:
        return f"{self.versions_prefix}{version_str(version)}.json"

    def parse_version_manifest(self, key: str) -> int | None:
        """The version of a version-manifest key, or None for any other key."""
        tail = key.removeprefix(self.versions_prefix)
        if tail == key or not tail.endswith(".json"):
            return None
        digits = tail[: -len(".json")]
        return int(digits) if len(digits) == VERSION_DIGITS and digits.isdigit() else None

    def parse_anchor_manifest(self, key: str) -> int | None:
        tail = key.removeprefix(self.anchors_prefix)
        digits, sep, rest = tail.partition("/")
        if tail == key or rest != "manifest.json" or len(digits) != VERSION_DIGITS or not digits.isdigit():
            return None
        return int(digits)

    def patches_prefix(self, version: int) -> str:
        return f"{self.root}patches/{version_str(version)}/"

    def patch(self, version: int, base: int) -> str:
        if base >= version:
            raise ValueError(f"a patch goes forward: base {base} must be below version {version}")
        return f"{self.patches_prefix(version)}from-{version_str(base)}.pulse"

    # -- rollouts ----------------------------------------------------------------------------
    def rollouts_prefix(self, kind: str = "train") -> str:
        if kind not in ROLLOUT_KINDS:
            raise ValueError(f"unknown rollout kind {kind!r}; expected one of {sorted(ROLLOUT_KINDS)}")
        return f"{self.root}{ROLLOUT_KINDS[kind]}/"

    def rollout(self, worker: str, timestamp_ms: int, seq: int, kind: str = "train") -> str:
        check_worker_id(worker)
        if not 0 <= timestamp_ms < 10**13 or not 0 <= seq < 10**10:
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
                match = _ROLLOUT_FILE.match(key[len(prefix) :])
                if match:
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

    def trainer_file(self, name: str) -> str:
        return f"{self.root}trainer/{check_name('file', name)}"
