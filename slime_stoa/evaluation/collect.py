"""Collecting the eval records that answer one eval request, trusting none of them.

Each record under `runs/<run>/evals/` is judged like the consumer judges a train record: the
worker signature (signed runs), decoding and validation with limits for eval records of this
run drawn with the request's sampling, the key (kind `eval`, its worker and seq), the weight
version and its published state digest, replays, and a re-score with the split's task and the
run's tokenizer (the worker's reward is never used). Records of another version or outside the
request's prompts are skipped (not rejects); rejects are counted by reason and logged. Per
prompt the first `k` samples, in key order, are kept.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec

from slime_stoa.judging.run_data import load_decoding, read_task
from slime_stoa.judging.scoring import Decode, PromptOf, Rescorer
from slime_stoa.judging.signature import check_signature
from slime_stoa.judging.signers import Signers
from slime_stoa.protocol.eval_request import EvalRequest
from slime_stoa.protocol.layout import RolloutKey, RunLayout
from slime_stoa.protocol.pulse.history import find_manifest
from slime_stoa.protocol.records import RolloutGroup
from slime_stoa.protocol.registry import Registry
from slime_stoa.protocol.run_manifest import RunManifest, read_run_manifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.store import NotFound, Store
from slime_stoa.protocol.validate import RecordLimits, RecordRejected, load_record
from slime_stoa.tasks import Task

log = logging.getLogger(__name__)

SKEW_MS = 10 * 60 * 1000  # records are listed from this long before the request was written


@dataclass(frozen=True)
class EvalContext:
    """What judging eval records of one request needs."""

    manifest: RunManifest
    task: Task  # the split's items
    rescorer: Rescorer
    limits: RecordLimits
    digest: str  # the published state digest of the request's version
    signers: Signers | None  # a signed run's worker registry, as last read; None: unsigned

    @property
    def registry(self) -> Registry | None:
        return None if self.signers is None else self.signers.registry

    async def know_signer(self, data: bytes) -> None:
        """Read the registry again when a record names a key it does not hold (a worker added
        since) or the last read is old; a forged registry is ignored (the last good one kept)."""
        signers = self.signers
        if signers is not None and signers.needs_read(data):
            await signers.refresh(signers.clock(), through=lambda op: op())


async def read_split(store: Store, manifest: RunManifest, split: str) -> Task:
    """The `split` of the run's task (checked to be the task the manifest names)."""
    return await read_task(store, manifest, split)


async def open_eval_context(
    store: Store,
    request: EvalRequest,
    *,
    tokenizer_dir: Path | None = None,
    verify_prompts: bool = True,
    run_key: str | None = None,
    decode: Decode | None = None,
    eos_ids: frozenset[int] = frozenset(),
    prompt_of: PromptOf | None = None,
    registry_refresh_s: float = 10.0,
) -> EvalContext:
    """Read the manifest (which must name the run key `run_key`, "ed25519:...", when given), the
    split, the tokenizer (`tokenizer_dir`, else the anchor's), the version's digest and (signed
    runs) the registry. `decode`/`prompt_of`: injected (tests)."""
    manifest = await read_run_manifest(store, request.run, pinned=run_key)
    task = await read_split(store, manifest, request.split)
    decode, eos_ids, prompt_of, vocab = await load_decoding(
        store, manifest, task, decode=decode, eos_ids=eos_ids, tokenizer_dir=tokenizer_dir, prompt_of=prompt_of,
        verify_prompts=verify_prompts,
    )
    if not vocab:
        raise ValueError(f"the vocabulary size of run {request.run!r} is unknown: set vocab_size in its manifest")
    limits = RecordLimits(
        vocab_size=vocab,
        max_samples=64,
        max_prompt_tokens=manifest.max_prompt_tokens,
        max_response_tokens=request.max_tokens,
        allowed_kinds=frozenset({"eval"}),
        expected_run=request.run,
        expected_sampling=request.sampling(manifest.stop),
    )
    # A signed run: the version's digest only from a manifest the run key signed, and records
    # only from workers its registry holds (re-read as keys appear; a forgery is ignored).
    trust = None if manifest.public_key is None else RunTrust(request.run, manifest.public_key)
    digest = (await find_manifest(store, request.run, request.version, trust=trust)).state_digest
    signers = None
    if trust is not None:
        signers = Signers(store, request.run, trust, refresh_s=registry_refresh_s)
        await signers.refresh(signers.clock(), through=lambda op: op())
    return EvalContext(manifest, task, Rescorer(task, decode, eos_ids, prompt_of), limits, digest, signers)


@dataclass(frozen=True)
class EvalGroup:
    """An accepted eval record (possibly cut to the samples kept), with the trainer's rewards."""

    key: str
    group: RolloutGroup
    prompt: str
    label: str
    texts: tuple[str, ...]
    rewards: tuple[float, ...]

    def head(self, n: int) -> EvalGroup:
        """The first `n` samples."""
        if n >= len(self.rewards):
            return self
        group = msgspec.structs.replace(self.group, samples=self.group.samples[:n])
        return replace(self, group=group, texts=self.texts[:n], rewards=self.rewards[:n])


class NotForRequest(Exception):
    """A well-formed record that answers another request (version or prompt)."""


def judge_eval_record(data: bytes, *, key: RolloutKey, name: str, ctx: EvalContext, request: EvalRequest,
                      wanted: frozenset[int]) -> EvalGroup:
    """An accepted record, NotForRequest, or RecordRejected with a stable reason."""
    record, _signer = check_signature(data, key=key, registry=ctx.registry)
    group = load_record(record, ctx.limits)
    if key.kind != "eval" or group.kind != "eval" or group.worker_id != key.worker or group.seq != key.seq:
        raise RecordRejected("key_mismatch", f"record says worker {group.worker_id!r} seq {group.seq}; its key {name}")
    if group.weight_version != request.version or group.prompt_index not in wanted:
        raise NotForRequest(name)
    if group.state_digest != ctx.digest:
        raise RecordRejected("digest", f"state_digest is not v{request.version}'s published {ctx.digest[:40]}")
    scored = ctx.rescorer.score(group)
    return EvalGroup(name, group, scored.item.prompt, scored.item.label, scored.texts, scored.rewards)


@dataclass
class EvalCollector:
    """The accepted records of one request so far (`poll` lists and judges new ones)."""

    store: Store
    ctx: EvalContext
    request: EvalRequest  # the whole request: every prompt wanted
    listed_from_ms: int | None = None  # default: the request's created_at minus SKEW_MS
    seen: set[str] = field(default_factory=set)
    by_prompt: dict[int, list[EvalGroup]] = field(default_factory=dict)
    rejects: Counter[str] = field(default_factory=Counter)
    skipped: int = 0
    _digests: set[str] = field(default_factory=set)
    _ids: set[tuple[str, int]] = field(default_factory=set)

    @property
    def wanted(self) -> frozenset[int]:
        return frozenset(self.request.prompts)

    def samples_of(self, prompt: int) -> int:
        return sum(len(g.rewards) for g in self.by_prompt.get(prompt, ()))

    def missing(self) -> tuple[int, ...]:
        """Prompts with fewer than k samples, sorted."""
        return tuple(p for p in self.request.prompts if self.samples_of(p) < self.request.k)

    async def poll(self) -> int:
        """List the eval records not seen yet and judge them; returns how many were accepted."""
        layout = RunLayout(self.request.run)
        start_ms = self.listed_from_ms if self.listed_from_ms is not None else int(self.request.created_at * 1000) - SKEW_MS
        accepted = 0
        wanted = self.wanted
        async for info in self.store.list(layout.rollouts_prefix("eval"), start_after=layout.rollout_after(start_ms, "eval")):
            if info.key in self.seen:
                continue
            self.seen.add(info.key)
            name = info.key[len(layout.rollouts_prefix("eval")) :]
            key = layout.parse_rollout(info.key)
            try:
                if key is None:
                    raise RecordRejected("bad_key", f"{name} is not a record name")
                try:
                    data = await self.store.get_bytes(info.key)
                except NotFound:
                    raise RecordRejected("missing", name) from None
                await self.ctx.know_signer(data)
                admitted = judge_eval_record(data, key=key, name=name, ctx=self.ctx, request=self.request, wanted=wanted)
                self._keep(admitted, data)
                accepted += 1
            except NotForRequest:
                self.skipped += 1
            except RecordRejected as exc:
                self.rejects[exc.reason] += 1
                log.warning("stoa eval: refused %s (%s: %s)", name, exc.reason, exc.detail)
        return accepted

    def _keep(self, admitted: EvalGroup, data: bytes) -> None:
        digest = hashlib.sha256(data).hexdigest()
        ident = (admitted.group.worker_id, admitted.group.seq)
        if digest in self._digests or ident in self._ids:
            raise RecordRejected("duplicate", f"{admitted.key} repeats an earlier record")
        self._digests.add(digest)
        self._ids.add(ident)
        self.by_prompt.setdefault(admitted.group.prompt_index, []).append(admitted)

    def kept(self, prompt: int) -> tuple[EvalGroup, ...]:
        """The groups whose samples count for `prompt`: the first k samples, in key order."""
        out, left = [], self.request.k
        for g in sorted(self.by_prompt.get(prompt, ()), key=lambda g: g.key):
            if left <= 0:
                break
            out.append(g.head(left))
            left -= len(out[-1].rewards)
        return tuple(out)
