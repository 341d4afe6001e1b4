"""Asking the fleet for an eval: write the request, collect what workers answer, narrow the
request as prompts fill up, and close it (no prompts left) when every prompt has k samples.

A request already in the bucket for the same version and split, with the same k and sampling,
is reused (its records count; its `created_at` is kept); another one is replaced. A request that
does not parse (or, for a signed run, does not verify) is replaced too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from slime_stoa.protocol.eval_request import EvalRequest, EvalRequestError, get_request, parse_request
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import NotFound, Store
from slime_stoa.protocol.store.capped import TooLarge

from .collect import EvalCollector
from .report import PromptResult, VersionResult, answer_matches, task_match

log = logging.getLogger(__name__)


class EvalTimeout(TimeoutError):
    """The fleet did not answer every prompt of an eval request in time."""


async def read_request(store: Store, run: str, key: str, trust: RunTrust | None) -> EvalRequest | None:
    try:
        got = await get_request(store, key)  # at most MAX_REQUEST_BYTES + 1 bytes
    except NotFound:
        return None
    except TooLarge as exc:
        log.warning("stoa eval: replacing the request at %s: %s", key, exc)
        return None
    assert got is not None  # no if_none_match: a read always returns the object
    try:
        return parse_request(got.data, key=key, run=run, trust=trust)
    except EvalRequestError as exc:
        log.warning("stoa eval: replacing the request at %s: %s", key, exc)
        return None


async def post_request(
    store: Store, wanted: EvalRequest, *, signing_key: SigningKey | None, trust: RunTrust | None = None
) -> EvalRequest:
    """Write `wanted` (or reuse the matching request in the bucket); returns `wanted` with the
    `created_at` and `revision` that count (records are listed from that created_at)."""
    found = await read_request(store, wanted.run, wanted.key, trust)
    same = found is not None and (found.k, found.max_tokens, found.temperature) == (wanted.k, wanted.max_tokens, wanted.temperature)
    if found is not None and same:
        wanted = replace(wanted, created_at=found.created_at, revision=found.revision + 1)
    elif found is not None:
        wanted = replace(wanted, revision=found.revision + 1)
    await store.put(wanted.key, wanted.to_bytes(signing_key))
    return wanted


def _matches(task: Any, scored: list[tuple[str, str]]) -> tuple[dict[str, float], ...] | None:
    """Each kept sample's EM and cover-EM when the task reports them (`report.answer_matches`)."""
    rows = [answer_matches(task, text, label) for text, label in scored]
    return None if any(r is None for r in rows) else tuple(r for r in rows if r is not None)


def version_result(collector: EvalCollector, threshold: float) -> VersionResult:
    """The kept samples of every prompt as a `VersionResult` (every prompt must be complete)."""
    request = collector.request
    tool = collector.ctx.task.tool_format is not None  # a tool task's results count tool calls
    prompts = []
    for p in request.prompts:
        groups = collector.kept(p)
        samples = [s for g in groups for s in g.group.samples]
        prompts.append(
            PromptResult(
                prompt_index=p,
                rewards=tuple(r for g in groups for r in g.rewards),
                truncated=tuple(s.finish_reason in ("length", "turns") for s in samples),
                tool_calls=tuple(s.tool_calls for s in samples) if tool else None,
                matches=_matches(collector.ctx.task, [(t, g.label) for g in groups for t in g.texts]),
            )
        )
    return VersionResult(
        request.version, request.split, request.k, tuple(prompts), threshold, match=task_match(collector.ctx.task)
    )


async def await_answers(
    collector: EvalCollector,
    *,
    signing_key: SigningKey | None,
    timeout_s: float | None,
    poll_s: float = 2.0,
    narrow_s: float = 10.0,
    clock=time.monotonic,
    on_progress: Callable[[int], None] | None = None,
) -> EvalCollector:
    """Poll until every prompt has k samples; the request is narrowed to the missing prompts
    every `narrow_s` and closed at the end. EvalTimeout after `timeout_s` (None: no limit).
    `on_progress(done)` after each poll: the prompts that have their k samples."""
    store, posted = collector.store, collector.request
    started = last_narrow = clock()
    open_prompts = posted.prompts
    while True:
        await collector.poll()
        missing = collector.missing()
        if on_progress is not None:
            on_progress(len(collector.request.prompts) - len(missing))
        now = clock()
        if missing != open_prompts and (not missing or now - last_narrow >= narrow_s):
            posted = replace(posted, prompts=missing, revision=posted.revision + 1)
            await store.put(posted.key, posted.to_bytes(signing_key))
            open_prompts, last_narrow = missing, now
        if not missing:
            return collector
        if timeout_s is not None and now - started >= timeout_s:
            raise EvalTimeout(
                f"eval of v{posted.version} ({posted.split}): {len(missing)} of {len(collector.request.prompts)} prompts "
                f"still lack k={posted.k} samples after {timeout_s:.0f} s (rejects: {dict(collector.rejects)}); "
                f"is a worker running at v{posted.version}?"
            )
        await asyncio.sleep(poll_s)
