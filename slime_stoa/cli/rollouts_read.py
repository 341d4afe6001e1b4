"""Reading a run's rollout records for people (`stoa rollouts`), judged as the trainer judges them.

Each record is read with a bounded GET (the record limit), then checked as the consumer checks it
(`open_record`: worker signature on a signed run, decoding, validation against the run's limits,
its key), against the published weights of its version, and re-scored with the run's task and
tokenizer. A record that fails is still shown, with the reason the consumer gives; a record that
cannot be read at all is reported and skipped. The consumer's saved state adds what the trainer
did with each record: admitted and used, waiting, or from a quarantined worker.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from slime_stoa.judging.scoring import Rescorer
from slime_stoa.judging.signers import Signers
from slime_stoa.protocol.layout import RolloutKey, RunLayout
from slime_stoa.protocol.pulse.history import HistoryError, find_manifest
from slime_stoa.protocol.records import RolloutGroup, Sample
from slime_stoa.protocol.registry import Registry
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.store import NotFound, Store, StoreError
from slime_stoa.protocol.store.capped import TooLarge, read_capped_bytes
from slime_stoa.protocol.validate import RecordLimits, RecordRejected
from slime_stoa.trainer.consumer.admission import check_published, open_record
from slime_stoa.trainer.consumer.config import ConsumerConfig
from slime_stoa.trainer.consumer.pause import Broken
from slime_stoa.trainer.consumer.persistence import read_state
from slime_stoa.trainer.consumer.run_context import open_run_context
from slime_stoa.trainer.consumer.state import ConsumerState

log = logging.getLogger(__name__)

Segment = tuple[Literal["model", "tool"], str]


@dataclass(frozen=True)
class SampleView:
    """One sample as shown: its text in model turns and tool observations, and its numbers."""

    segments: tuple[Segment, ...]
    finish_reason: str
    worker_reward: float
    reward: float | None  # the trainer's re-score; None when the record was refused before it
    tokens: int  # response tokens
    model_tokens: int  # of them sampled by the model
    turns: int
    tool_calls: int
    logprob_mean: float | None  # over the model's tokens
    logprob_min: float | None


@dataclass(frozen=True)
class RecordView:
    """One record as shown: its key's parts, the group (when it decoded), why the trainer refuses
    it (None: it passes), and what the consumer's state says of it."""

    name: str  # the key, relative to the rollouts prefix
    key: RolloutKey
    group: RolloutGroup | None
    prompt: str | None
    label: str | None
    samples: tuple[SampleView, ...]
    refused: tuple[str, str] | None  # (reason, detail)
    consumer: str | None  # the consumer's state on this record or its worker; None: nothing known


@dataclass(frozen=True)
class RecordFilter:
    """Which records to show: weight version, worker, task and a reward condition on any sample."""

    version: int | None = None
    worker: str | None = None
    task: str | None = None
    reward: Callable[[float], bool] | None = None

    def wants_key(self, key: RolloutKey) -> bool:
        return self.worker is None or key.worker == self.worker

    def wants(self, view: RecordView) -> bool:
        g = view.group
        if self.version is not None and (g is None or g.weight_version != self.version):
            return False
        if self.task is not None and (g is None or g.task_id != self.task):
            return False
        if self.reward is not None:
            return any(s.reward is not None and self.reward(s.reward) for s in view.samples)
        return True


def sample_view(sample: Sample, rescorer: Rescorer, reward: float | None) -> SampleView:
    """`sample` split into its runs of model and tool tokens, each decoded."""
    tokens = np.asarray(sample.response_tokens)
    mask = np.asarray(sample.mask, dtype=bool)
    segments: list[Segment] = []
    start = 0
    for end in [*(np.flatnonzero(np.diff(mask.astype(np.int8))) + 1).tolist(), len(tokens)]:
        if end > start:
            run = tokens[start:end]
            is_model = bool(mask[start])
            last = end == len(tokens)
            text = rescorer.completion_text(run, sample.finish_reason) if is_model and last else rescorer.decode(run.tolist())
            segments.append(("model" if is_model else "tool", text))
        start = end
    lp = np.asarray(sample.logprobs, dtype=np.float64)[mask]
    return SampleView(
        segments=tuple(segments),
        finish_reason=sample.finish_reason,
        worker_reward=float(sample.reward),
        reward=reward,
        tokens=len(tokens),
        model_tokens=int(mask.sum()),
        turns=sample.turns,
        tool_calls=sample.tool_calls,
        logprob_mean=float(lp.mean()) if lp.size else None,
        logprob_min=float(lp.min()) if lp.size else None,
    )


def consumer_note(state: ConsumerState | None, name: str, worker: str) -> str | None:
    """What the consumer's saved state says of the record `name` and its worker."""
    if state is None:
        return None
    notes = []
    record = state.quarantine.get(worker)
    if record is not None and record.quarantined:
        notes.append(f"worker {worker} is quarantined ({record.reason}): its records are refused")
    if name in state.ledger:
        notes.append(f"admitted, used {state.ledger[name]} time(s) so far")
    elif name in state.pending:
        notes.append("listed, waiting to be judged")
    elif state.cursor and name > state.cursor:
        notes.append("not yet listed by the trainer")
    elif name in state.seen or (state.cursor and name <= state.cursor):
        notes.append("listed by the trainer and no longer pooled (used up, stale, filtered or refused)")
    return "; ".join(notes) or None


class RunRecords:
    """A run's records, judged (`open`, then `records`)."""

    def __init__(
        self, store: Store, manifest: RunManifest, rescorer: Rescorer, limits: RecordLimits,
        signers: Signers | None, trust: RunTrust | None, state: ConsumerState | None, state_problem: str | None,
    ) -> None:
        self.store, self.manifest, self.rescorer, self.limits = store, manifest, rescorer, limits
        self.signers, self.trust, self.state, self.state_problem = signers, trust, state, state_problem
        self.layout = RunLayout(manifest.run)
        self._digests: dict[int, str | None] = {}
        self.unreadable: list[tuple[str, str]] = []  # (key, why) of records that could not be read

    @classmethod
    async def open(cls, store: Store, run: str, *, tokenizer_dir: Path | None = None) -> RunRecords:
        """Read the run's manifest, task, tokenizer (`tokenizer_dir`, else the latest anchor's),
        registry (signed runs) and the consumer's state."""
        try:
            ctx = await open_run_context(store, ConsumerConfig(store_url=store.url, run=run), tokenizer_dir=tokenizer_dir)
        except Broken as exc:  # a reader does not wait for a repair as the trainer does: the error itself
            raise exc.cause from None
        trust = None if ctx.run_key is None else RunTrust(run, ctx.run_key)
        signers = None
        if trust is not None:
            signers = Signers(store, run, trust, refresh_s=10.0)
            await signers.refresh(signers.clock(), through=lambda op: op())
        state, problem = None, None
        try:
            state, _ = await read_state(store, run, signed_by=None if ctx.run_key is None else [ctx.run_key])
        except (ValueError, StoreError) as exc:
            problem = f"the trainer's saved state was not read: {exc}"
        return cls(store, ctx.manifest, ctx.rescorer, ctx.config.record_limits, signers, trust, state, problem)

    async def _published_digest(self, version: int) -> str | None:
        if version not in self._digests:
            try:
                found = await find_manifest(self.store, self.manifest.run, version, trust=self.trust)
                self._digests[version] = found.state_digest
            except (HistoryError, NotFound, ValueError):
                self._digests[version] = None
        return self._digests[version]

    async def judge(self, name: str, key: RolloutKey, data: bytes) -> RecordView:
        """The record `data` of key `name` as shown (see the module docstring)."""
        note = consumer_note(self.state, name, key.worker)
        try:
            group, _signer = open_record(data, key=key, limits=self.limits, registry=self.registry)
        except RecordRejected as exc:
            return RecordView(name, key, None, None, None, (), (exc.reason, exc.detail), note)
        refused: tuple[str, str] | None = None
        rewards: tuple[float | None, ...] = (None,) * len(group.samples)
        prompt = label = None
        if 0 <= group.prompt_index < len(self.rescorer.task):
            item = self.rescorer.task.item(group.prompt_index)
            prompt, label = item.prompt, item.label
        try:
            digest = await self._published_digest(group.weight_version)
            check_published(group, {} if digest is None else {group.weight_version: digest})
            rewards = self.rescorer.score(group).rewards
        except RecordRejected as exc:
            refused = (exc.reason, exc.detail)
        samples = tuple(sample_view(s, self.rescorer, r) for s, r in zip(group.samples, rewards, strict=True))
        return RecordView(name, key, group, prompt, label, samples, refused, note)

    @property
    def registry(self) -> Registry | None:
        return None if self.signers is None else self.signers.registry

    async def keys(self, record_filter: RecordFilter) -> list[tuple[str, RolloutKey]]:
        """(name, key) of every train record key the filter's worker allows, oldest first; a key
        that is not a record name is reported and skipped."""
        prefix = self.layout.rollouts_prefix()
        found = []
        async for info in self.store.list(prefix):
            key = self.layout.parse_rollout(info.key)
            if key is None:
                self.unreadable.append((info.key, "not a record key name"))
                continue
            if record_filter.wants_key(key):
                found.append((info.key[len(prefix) :], key))
        return found

    async def records(self, record_filter: RecordFilter, *, newest_first: bool, scan: int) -> AsyncIterator[RecordView]:
        """Judged train records the filter wants, reading at most `scan` records."""
        keys = await self.keys(record_filter)
        if newest_first:
            keys.reverse()
        prefix = self.layout.rollouts_prefix()
        for name, key in keys[:scan]:
            try:
                data = await read_capped_bytes(self.store, prefix + name, self.limits.max_record_bytes)
            except (TooLarge, NotFound, StoreError) as exc:
                self.unreadable.append((prefix + name, str(exc)))
                log.warning("skipped %s: %s", prefix + name, exc)
                continue
            view = await self.judge(name, key, data)
            if record_filter.wants(view):
                yield view


__all__ = ["RecordFilter", "RecordView", "RunRecords", "SampleView", "consumer_note", "sample_view"]
