"""Retry policy for remote stores: exponential backoff with full jitter.

Only errors the caller marks as retryable are retried (throttling, 5xx, timeouts, dropped
connections); anything else surfaces at once. After the last attempt the failure becomes
`StoreUnavailable` (or the caller's error type), whose message names the operation and the last
underlying error. This is the one retry loop of stoa: other layers give it their own policy.

Two layers use it on the trainer side. The S3 backend retries each request briefly (`RetryPolicy()`,
a few seconds) and then raises `StoreUnavailable`. Callers that must outlast an outage of any
length (the rollout consumer: pointer reads, listings, record downloads, its state) wrap the
call in `through_outages`, which retries `StoreUnavailable` forever (`attempts=None`) with a
capped, jittered backoff, logs the error when the outage starts and then once a minute, and says
when the store answers again. Everything else, a `StoreConfigError` (bad credentials, missing
bucket) first of all, is raised at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from .base import StoreUnavailable

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """`attempts` tries in all; before try n+1 sleep uniform(0, min(max_delay, base_delay * 2**n)).

    With `jitter=False` the sleep is that cap itself (a fixed doubling backoff). `attempts=None`
    retries forever (for `through_outages`; give it a finite `max_delay`).
    """

    attempts: int | None = 6
    base_delay: float = 0.1
    max_delay: float = 5.0
    jitter: bool = True

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be at least 1 or None, got {self.attempts}")
        if self.base_delay < 0 or self.max_delay < self.base_delay:
            raise ValueError(
                f"RetryPolicy needs 0 <= base_delay <= max_delay, got {self.base_delay}, {self.max_delay}"
            )

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """The sleeps between attempts (`attempts - 1` of them; endless for `attempts=None`),
        each fully jittered."""
        draw = rng or random.Random()
        retries = itertools.count() if self.attempts is None else range(self.attempts - 1)
        for retry in retries:
            cap = min(self.max_delay, self.base_delay * 2.0 ** min(retry, 64))
            yield draw.uniform(0.0, cap) if self.jitter else cap

    def worst_case_seconds(self) -> float:
        """An upper bound on the total sleep (not counting the attempts themselves); inf when
        the policy retries forever."""
        if self.attempts is None:
            return math.inf
        return sum(min(self.max_delay, self.base_delay * 2.0**n) for n in range(self.attempts - 1))


def describe_error(exc: BaseException) -> str:
    """`Type: message` of an error, on one line."""
    text = " ".join(str(exc).split()) or repr(exc)
    return f"{type(exc).__name__}: {text}"


async def with_retries(
    op: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy,
    is_retryable: Callable[[BaseException], bool],
    describe: str,
    advice: Callable[[BaseException], str] | None = None,
    rng: random.Random | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    on_retry: Callable[[BaseException, int, float], object] | None = None,
    gave_up: Callable[[str], Exception] = StoreUnavailable,
) -> T:
    """Run `op()` until it succeeds, fails with a non-retryable error, or attempts run out.

    `describe` names the operation for the final message ("GET key at endpoint"); `advice`, given
    the last error, adds what the user could do about it. Error texts must not hold secrets: the
    ones botocore and aiohttp produce do not. `on_retry(error, attempt, delay)` is called before
    each sleep (to log it); `gave_up(message)` makes the final error (`StoreUnavailable`).
    """
    started = time.monotonic()
    delays = policy.delays(rng)
    attempt = 0
    while True:
        attempt += 1
        try:
            return await op()
        except Exception as exc:
            if not is_retryable(exc):
                raise
            delay = next(delays, None)
            if delay is None:
                message = _gave_up_message(exc, attempt, time.monotonic() - started, describe, advice)
                raise gave_up(message) from exc
            if on_retry is not None:
                on_retry(exc, attempt, delay)
        await sleep(delay)


def _gave_up_message(
    exc: BaseException,
    attempts: int,
    elapsed: float,
    describe: str,
    advice: Callable[[BaseException], str] | None,
) -> str:
    tried = f"{attempts} attempt{'s' if attempts != 1 else ''} over {elapsed:.1f}s"
    message = f"{describe} failed after {tried}; last error: {describe_error(exc)}"
    hint = advice(exc) if advice else ""
    return f"{message}. {hint}" if hint else message


# -- outlasting outages -------------------------------------------------------------------------------
OUTAGE_LOG_INTERVAL_S = 60.0


def outage_policy(max_delay: float = 30.0, *, base_delay: float = 0.5) -> RetryPolicy:
    """Retry forever: full jitter, doubling from `base_delay` up to `max_delay` seconds."""
    if not (math.isfinite(max_delay) and max_delay > 0):
        raise ValueError(f"an outage policy needs a finite max_delay > 0, got {max_delay!r}")
    return RetryPolicy(attempts=None, base_delay=min(base_delay, max_delay), max_delay=max_delay)


def is_outage(exc: BaseException) -> bool:
    """The store did not answer (after the backend's own retries): an outage that may heal.
    A `StoreConfigError` (credentials, bucket, clock) is not one: it never heals by waiting."""
    return isinstance(exc, StoreUnavailable)


class OutageLog:
    """Logs an outage of one operation: at its first failure, then at most every `interval_s`
    seconds (with the latest error and how long it has lasted), and once when it is over."""

    def __init__(
        self,
        describe: str,
        *,
        interval_s: float = OUTAGE_LOG_INTERVAL_S,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.describe = describe
        self.interval_s = interval_s
        self.logger = logger or log
        self.clock = clock
        self.started: float | None = None
        self.failures = 0
        self._next_log = -math.inf

    def failed(self, exc: BaseException, attempt: int, delay: float) -> None:
        now = self.clock()
        if self.started is None:
            self.started = now
        self.failures += 1
        if now >= self._next_log:
            self._next_log = now + self.interval_s
            self.logger.warning(
                "stoa: %s: the store is unavailable (%.0f s so far, %d failed tries); waiting for it, "
                "next try in %.1f s: %s",
                self.describe, now - self.started, self.failures, delay, describe_error(exc),
            )

    def recovered(self) -> None:
        if self.started is not None:
            self.logger.warning(
                "stoa: %s: the store answers again after %.0f s (%d failed tries)",
                self.describe, self.clock() - self.started, self.failures,
            )
            self.started = None
            self.failures = 0
            self._next_log = -math.inf


async def through_outages(
    op: Callable[[], Awaitable[T]],
    *,
    describe: str,
    policy: RetryPolicy | None = None,
    log_interval_s: float = OUTAGE_LOG_INTERVAL_S,
    logger: logging.Logger | None = None,
    is_retryable: Callable[[BaseException], bool] = is_outage,
    rng: random.Random | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
    on_outage: Callable[[BaseException], object] | None = None,
) -> T:
    """`op()`, retried through a store outage of any length (see the module doc).

    `policy` defaults to `outage_policy()` (forever, at most 30 s apart). Errors `is_retryable`
    rejects (a `StoreConfigError`, `NotFound`, a lost compare-and-swap, ...) are raised at once.
    `on_outage(error)` is called at every failed try (to count it).
    """
    watch = OutageLog(describe, interval_s=log_interval_s, logger=logger, clock=clock)

    def failed(exc: BaseException, attempt: int, delay: float) -> None:
        if on_outage is not None:
            on_outage(exc)
        watch.failed(exc, attempt, delay)

    result = await with_retries(
        op,
        policy=policy or outage_policy(),
        is_retryable=is_retryable,
        describe=describe,
        rng=rng,
        sleep=sleep,
        on_retry=failed,
    )
    watch.recovered()
    return result
