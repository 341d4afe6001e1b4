"""Retries of a weight publish: store outages waited out, other publish errors retried a few times.

A failed publish never moved the pointer (`Publisher.publish`), so trying it again is safe; a
`PublishConflict` (another publisher owns the run) is never retried.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

from slime_stoa.protocol.store import StoreUnavailable
from slime_stoa.protocol.store.retry import RetryPolicy, through_outages, with_retries

from .publisher import PublishConflict, PublishError

log = logging.getLogger(__name__)

DEFAULT_RETRIES = 3
DEFAULT_BACKOFF_S = 2.0

T = TypeVar("T")


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, (PublishError, StoreUnavailable)) and not isinstance(exc, PublishConflict)


def is_publish_outage(exc: BaseException) -> bool:
    """The store did not answer: directly, or under the PublishError the publisher wraps it in."""
    if isinstance(exc, PublishConflict):
        return False
    return isinstance(exc, StoreUnavailable) or (
        isinstance(exc, PublishError) and isinstance(exc.__cause__, StoreUnavailable)
    )


async def publish_with_retries(
    op: Callable[[], Awaitable[T]],
    *,
    retries: int,
    backoff_s: float,
    what: str,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> T:
    """Await `op()`: a store outage of any length is waited out (the caller pauses, logging
    every minute, and goes on when the store answers); any other `PublishError` is retried up
    to `retries` times.

    The delay between those starts at `backoff_s` and doubles (no jitter: one publisher per
    run). A `PublishConflict` (another publisher owns the run) is raised at once; after the
    last attempt a `PublishError` says how many were made.
    """

    def note(exc: BaseException, attempt: int, delay: float) -> None:
        log.warning("stoa: %s: attempt %d failed (%s); retrying in %.1fs", what, attempt, exc, delay)

    async def attempt() -> T:
        return await through_outages(op, describe=what, is_retryable=is_publish_outage, logger=log, sleep=sleep)

    return await with_retries(
        attempt,
        policy=RetryPolicy(attempts=retries + 1, base_delay=backoff_s, max_delay=math.inf, jitter=False),
        is_retryable=_is_retryable,
        describe=what,
        advice=lambda exc: "The pointer did not move.",
        sleep=sleep,
        on_retry=note,
        gave_up=PublishError,
    )
