"""What a quickstart run has done so far, kept across reruns (`<out>/progress.json`).

The bucket holds the run's weights and groups, so the learning curve's rewards are read from it;
what only the learner sees (each version's patch size and digest, the logprob gaps it measured,
the worker digests it checked, its run time) is saved here after every published version, so
that the summary and the learning curve of a resumed run cover the whole run, not the rerun.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from slime_stoa.protocol.fsutil import atomic_write

log = logging.getLogger("stoa.quickstart")

PROGRESS_FILE = "progress.json"  # in the run folder
PROGRESS_FORMAT = "stoa.quickstart-progress/1"


@dataclass
class Progress:
    """What the run has done so far (the summary is made from it).

    "Session" fields are this process's; the others cover the whole run (loaded on a resume)."""

    started: float = field(default_factory=time.time)  # session
    rewards: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))  # version -> all rewards
    tool_calls: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))  # version -> per sample
    eval_pass1: dict[int, float] = field(default_factory=dict)  # version -> held-out pass@1
    scored_rewards: list[float] = field(default_factory=list)  # session, per learner step: every group that arrived
    target_reached: bool = False  # session: the train phase stopped at the target
    patch_bytes: dict[int, int] = field(default_factory=dict)  # version -> step patch bytes
    full_bytes: int = 0
    tensors: int = 0  # tensors in the published state
    publish_seconds: list[float] = field(default_factory=list)  # session: the learner's publish of each version
    swap_seconds: dict[tuple[str, int], float] = field(default_factory=dict)  # session: (worker, version) -> sync to serving
    digests: dict[int, str] = field(default_factory=dict)  # version -> published state digest
    seen_states: dict[tuple[str, int], str] = field(default_factory=dict)  # (worker, version) -> digest
    gaps: list[float] = field(default_factory=list)  # |learner - worker| logprob per sequence, same version
    gap_by_version: dict[int, float] = field(default_factory=dict)  # version -> mean gap measured by its step
    groups_used: int = 0  # session
    run_first_version: int = 0  # the run's first RL version (the seed anchor's)
    first_version: int = 0  # session: the version it started from
    last_version: int = 0
    seconds_before: float = 0.0  # run time of the earlier sessions
    warm_start: str = ""

    def version_reward(self, v: int) -> float | None:
        r = self.rewards.get(v)
        return float(np.mean(r)) if r else None

    def reward_first(self) -> float:
        """Mean reward of the groups drawn from the run's first RL version on (the earliest found)."""
        for v in sorted(self.rewards):
            if v >= self.run_first_version:
                return float(np.mean(self.rewards[v]))
        return float("nan")

    def reward_last(self, window: int) -> float:
        versions = sorted(self.rewards)[-window:]
        return float(np.mean([np.mean(self.rewards[v]) for v in versions])) if versions else float("nan")

    def reward_recent_batches(self, window: int) -> float:
        """The target's measure: the mean scored reward of the last `window` learner batches (every
        group that arrived for a step, whatever version drew it). It leads `reward_last`, which
        groups the bucket's rewards by the version that drew them, by the groups still in flight."""
        recent = self.scored_rewards[-window:]
        return float(np.mean(recent)) if len(recent) >= window else float("nan")

    def version_search_rate(self, v: int) -> float | None:
        """Share of the samples drawn from `v` that called the tool at least once."""
        calls = self.tool_calls.get(v)
        return sum(c > 0 for c in calls) / len(calls) if calls else None

    def search_rate_first(self) -> float:
        """The search rate of the groups drawn from the run's first RL version on (the earliest found)."""
        for v in sorted(self.tool_calls):
            if v >= self.run_first_version and self.tool_calls[v]:
                return float(np.mean([c > 0 for c in self.tool_calls[v]]))
        return float("nan")

    def search_rate_last(self, window: int) -> float:
        """The mean search rate of the last `window` versions (as `reward_last`)."""
        versions = [v for v in sorted(self.tool_calls) if self.tool_calls[v]][-window:]
        return float(np.mean([np.mean([c > 0 for c in self.tool_calls[v]]) for v in versions])) if versions else float("nan")

    def digest_mismatches(self) -> int:
        return sum(1 for (_, v), d in self.seen_states.items() if v in self.digests and self.digests[v] != d)

    def record_gaps(self, version: int, gaps: list[float]) -> None:
        """The gaps measured by the step that published `version` (none: not measured there)."""
        if gaps:
            self.gaps.extend(gaps)
            self.gap_by_version[version] = float(np.mean(gaps))

    def seconds(self) -> float:
        """Run time of the whole run so far."""
        return self.seconds_before + time.time() - self.started

    # -- persistence ------------------------------------------------------------------------------
    def to_json(self, run: str) -> bytes:
        doc = {
            "format": PROGRESS_FORMAT,
            "run": run,
            "run_first_version": self.run_first_version,
            "last_version": self.last_version,
            "patch_bytes": {str(v): b for v, b in self.patch_bytes.items()},
            "digests": {str(v): d for v, d in self.digests.items()},
            "seen_states": [[w, v, d] for (w, v), d in sorted(self.seen_states.items())],
            "gaps": self.gaps,
            "gap_by_version": {str(v): g for v, g in self.gap_by_version.items()},
            "seconds": self.seconds(),
            "warm_start": self.warm_start,
            "eval_pass1": {str(v): p for v, p in self.eval_pass1.items()},
        }
        return json.dumps(doc, sort_keys=True).encode()

    def load_history(self, doc: Any, *, run: str, version: int) -> None:
        """Take the whole-run fields of `doc` (a `to_json` document of `run`), keeping only what
        concerns versions up to `version` (the bucket's); ValueError when it is not such a document."""
        if not isinstance(doc, dict) or doc.get("format") != PROGRESS_FORMAT:
            raise ValueError(f"not a {PROGRESS_FORMAT} document")
        if doc.get("run") != run:
            raise ValueError(f"it is of run {doc.get('run')!r}, not {run!r}")
        try:
            first, last = _count(doc["run_first_version"]), _count(doc["last_version"])
            if not first <= last <= version:
                raise ValueError(f"it covers v{first}..v{last}, not a run at v{version}")
            patch_bytes = {v: _count(b) for v, b in _by_version(doc["patch_bytes"], version).items()}
            digests = {v: _text(d) for v, d in _by_version(doc["digests"], version).items()}
            seen = {(_text(w), _count(v)): _text(d) for w, v, d in doc["seen_states"] if _count(v) <= version}
            gaps = [_number(g) for g in doc["gaps"]]
            gap_by_version = {v: _number(g) for v, g in _by_version(doc["gap_by_version"], version).items()}
            seconds = _number(doc["seconds"])
            warm = _text(doc["warm_start"])
            evals = {v: _number(p) for v, p in _by_version(doc.get("eval_pass1", {}), version).items()}
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed ({type(exc).__name__}: {exc})") from None
        self.run_first_version = first
        self.patch_bytes = {**patch_bytes, **self.patch_bytes}
        self.digests = {**digests, **self.digests}
        self.seen_states = {**seen, **self.seen_states}
        self.gaps = gaps + self.gaps
        self.gap_by_version = {**gap_by_version, **self.gap_by_version}
        self.seconds_before = seconds
        self.warm_start = self.warm_start or warm
        self.eval_pass1 = {**evals, **self.eval_pass1}


def save_progress(progress: Progress, path: Path, *, run: str) -> None:
    """Write the run's progress (atomic), after each published version."""
    atomic_write(path, progress.to_json(run))


def load_progress(progress: Progress, path: Path, *, run: str, version: int) -> bool:
    """Resume the whole-run history from `save_progress`'s file (a run at `version` in the
    bucket); False, with a warning, when it is missing or not of this run (the summary then
    covers this session, and the run's first RL version is taken as v0, the quickstart's seed)."""
    try:
        doc = json.loads(path.read_bytes())
        progress.load_history(doc, run=run, version=version)
    except FileNotFoundError:
        log.warning("no %s: the summary covers this session only", path)
        return False
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s; the summary covers this session only", path, exc)
        return False
    return True


def _by_version(doc: Any, version: int) -> dict[int, Any]:
    if not isinstance(doc, dict):
        raise TypeError("expected an object keyed by version")
    out = {}
    for key, value in doc.items():
        v = int(key)
        if 0 <= v <= version:
            out[v] = value
    return out


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"expected a non-negative integer, got {value!r}")
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value
