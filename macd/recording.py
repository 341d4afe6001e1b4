"""Finished groups on their way to the bucket: scored, built into (signed) records, spooled.

Every finished group is written to the on-disk spool first and uploaded from there, so nothing
finished is ever lost. With the run's `dynamic_sampling`, a group whose rewards are all equal is
counted (heartbeat `groups_filtered`) instead of uploaded; the worker's per-version group budget
(`VersionBudget`) counts the groups the trainer can use."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from slime_stoa.protocol.records import RolloutGroup, Sample, SamplingParams, encode_group
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.shell import shell_command
from slime_stoa.protocol.signed_record import sign_record
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.worker_keys import read_worker_key_file
from slime_stoa.tasks import Task, TaskItem

from .config import DaemonConfig
from .curriculum import PromptPicker, has_signal
from .reporting import Reporter
from .spool import Spool

if TYPE_CHECKING:
    from .generate import FinishedGroup

log = logging.getLogger("macd")


def build_group(
    *,
    manifest: RunManifest,
    worker_id: str,
    item: TaskItem,
    prompt: list[int],
    completions: Sequence[Any],
    rewards: list[float],
    version: int,
    digest: str,
    started_at: float,
    finished_at: float,
    signer: SigningKey | None = None,
    tool_task: bool = False,
    plane: str = "bf16",
) -> Callable[[int, int], bytes]:
    """A spool builder: the record's bytes for the seq the spool assigns, signed by the worker
    key `signer` when given (`signed_record`: the envelope the trainer of a signed run requires).
    A `tool_task`'s group (`macd.episodes.EpisodeCompletion`s) carries each sample's mask, turns
    and tool calls (a single-turn sample's: all ones, one turn, none). `plane`: the weight plane the worker sampled with."""
    samples = tuple(
        Sample(
            response_tokens=c.tokens, logprobs=c.logprobs, finish_reason=c.finish_reason, reward=float(r),
            **({"mask": c.mask, "turns": c.turns, "tool_calls": c.tool_calls} if tool_task else {}),
        )
        for c, r in zip(completions, rewards, strict=True)
    )
    sampling = SamplingParams(
        temperature=manifest.temperature, top_p=1.0, max_tokens=manifest.max_tokens, stop=manifest.stop
    )

    def build(seq: int, _timestamp_ms: int) -> bytes:
        record = encode_group(
            RolloutGroup(
                kind="train",
                run=manifest.run,
                task_id=manifest.task,
                prompt_index=item.index,
                prompt_tokens=np.asarray(prompt, dtype=np.int32),
                samples=samples,
                weight_version=version,
                state_digest=digest,
                sampling=sampling,
                worker_id=worker_id,
                seq=seq,
                started_at=started_at,
                finished_at=finished_at,
                plane=plane,
            )
        )
        return record if signer is None else sign_record(record, signer, run=manifest.run)

    return build


class WorkerKeyError(ValueError):
    """The worker key is missing (for a signed run), unreadable, or for another run or worker."""


def load_worker_key(config: DaemonConfig) -> SigningKey | None:
    """The worker key installed by `macd join --worker-key` (`config.worker_key`), or None."""
    path = config.worker_key
    if not path:
        return None
    try:
        entry = read_worker_key_file(Path(path))
    except ValueError as exc:
        raise WorkerKeyError(f"worker key: {exc}") from None
    if entry.run != config.run or entry.worker != config.worker_id:
        raise WorkerKeyError(
            f"worker key {path} is for worker {entry.worker!r} of run {entry.run!r}, this worker is "
            f"{config.worker_id!r} of run {config.run!r}: install this worker's key with `macd join --worker-key FILE`"
        )
    return entry.key


def check_signing(manifest: RunManifest, signer: SigningKey | None, store: str = "STORE_URL") -> None:
    """WorkerKeyError when the run is signed and this worker has no key to sign its records
    (`store`: the run's bucket URL, for the command the message names)."""
    if manifest.run_key is not None and signer is None:
        add = shell_command("stoa", "worker", "add", "NAME", "--store", store, "--run", manifest.run,
                            "--key", "RUN_KEY_FILE", "--out", "FILE")
        raise WorkerKeyError(
            f"run {manifest.run!r} is signed and this worker has no worker key: issue one with "
            f"`{add}` and install it with `macd join --worker-key FILE`"
        )


@dataclass(frozen=True)
class Started:
    """A group's tag in the generator: what it was started with."""

    item: TaskItem
    prompt: list[int]
    version: int
    digest: str
    started_at: float
    restarted: bool = False  # dropped at a swap once already: the next swap waits for it


@dataclass(frozen=True)
class Done:
    """A finished, scored group on its way to the spool."""

    started: Started
    completions: Sequence[Any]
    rewards: list[float]
    keep: bool  # upload it (False: all rewards equal under dynamic sampling)


class VersionBudget:
    """The run's `worker_groups_per_version`: groups with a reward signal (the ones the trainer
    keeps) generated per weight version. The budget renews after `patience_s` without a new
    version, so a trainer that filtered many groups (e.g. all-equal rewards) is never starved."""

    def __init__(self, limit: int | None, patience_s: float) -> None:
        self.limit, self.patience_s = limit, patience_s
        self._groups_at: dict[int, int] = {}
        self._waiting_since: float | None = None

    def count(self, version: int) -> None:
        self._groups_at[version] = self._groups_at.get(version, 0) + 1

    def spent(self, version: int) -> bool:
        """True while `version`'s budget is spent and the trainer may still move on."""
        if not self.limit or self._groups_at.get(version, 0) < self.limit:
            self._waiting_since = None
            return False
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        if now - self._waiting_since >= self.patience_s:
            self._groups_at[version] = 0
            self._waiting_since = None
            return False
        return True


class Recorder:
    """Scores finished groups (`score`, on the generation loop) and spools them in the order they
    finished (`run`, until `close`); counts cohorts: every `batch` groups spooled or filtered.
    A tool task's records carry each sample's mask, turns and tool calls."""

    def __init__(
        self, *, manifest: RunManifest, task: Task, picker: PromptPicker, spool: Spool, reporter: Reporter,
        worker_id: str, signer: SigningKey | None, batch: int, budget: VersionBudget, tool_task: bool,
        plane: str = "bf16",
    ) -> None:
        self.plane = plane  # the weight plane the groups are sampled with (each record names it)
        self.manifest, self.task, self.picker, self.spool, self.reporter = manifest, task, picker, spool, reporter
        self.worker_id, self.signer, self.batch, self.budget, self.tool_task = worker_id, signer, batch, budget, tool_task
        self.cohorts = 0  # every `batch` groups finished (spooled or filtered) make a cohort
        self.recorded = 0  # finished and spooled
        self.filtered = 0  # finished, rewards all equal, not uploaded (dynamic_sampling)
        self._done: asyncio.Queue[Done | None] = asyncio.Queue()
        self._cohort_started = time.monotonic()

    def score(self, group: FinishedGroup) -> None:
        """Reward a finished group and queue it for the spool."""
        started: Started = group.tag
        rewards = [self.task.reward(c.text, started.item.label) for c in group.completions]
        self.picker.record(started.item, rewards)
        signal = has_signal(rewards)
        if signal:  # the budget counts groups the trainer can use (it drops all-equal ones)
            self.budget.count(started.version)
        self._done.put_nowait(Done(started, group.completions, rewards, keep=signal or not self.manifest.dynamic_sampling))

    def close(self) -> None:
        """`run` ends once what is queued is spooled."""
        self._done.put_nowait(None)

    async def run(self) -> None:
        tokens, rewards, filtered = 0, [], 0
        while (group := await self._done.get()) is not None:
            s = group.started
            if group.keep:
                finished_at = self.spool.clock()  # the clock its key is stamped with (the store's: clock.py)
                build = build_group(
                    manifest=self.manifest, worker_id=self.worker_id, item=s.item, prompt=s.prompt,
                    completions=group.completions, rewards=group.rewards, version=s.version, digest=s.digest,
                    started_at=s.started_at + (finished_at - time.time()), finished_at=finished_at,
                    signer=self.signer, tool_task=self.tool_task,
                    plane=self.plane,
                )
                await asyncio.to_thread(self.spool.add, build)
                self.recorded += 1
            else:
                self.filtered += 1
                filtered += 1
            tokens += sum(len(c.tokens) for c in group.completions)
            rewards += group.rewards
            self.reporter.update(groups_spooled=self.spool.depth, groups_filtered=self.filtered,
                                 prompts_solved=self.picker.solved)
            if (self.recorded + self.filtered) % self.batch:
                continue
            self.cohorts += 1
            now = time.monotonic()
            rate = tokens / max(now - self._cohort_started, 1e-9)  # the heartbeat's rate is the reporter's
            log.info(
                "cohort %d: v%d, %d groups, %d tokens, %.0f tok/s, reward mean %.3f%s",
                self.cohorts, s.version, self.batch, tokens, rate, float(np.mean(rewards)),
                f" ({filtered} not uploaded: all rewards equal)" if filtered else "",
            )
            tokens, rewards, filtered, self._cohort_started = 0, [], 0, now
