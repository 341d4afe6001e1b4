"""Retry policy for remote stores: exponential backoff with full jitter.

Only errors the caller marks as retryable are retried (throttling, 5xx, timeouts, dropped
connections); anything else surfaces at once. After the last attempt the failure becomes
`StoreUnavailable` (or the caller's error type), whose message names the operation and the last
underlying error. This is the one retry loop of stoa: other layers give it their own policy.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from .base import StoreUnavailable

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """`attempts` tries in all; before try n+1 sleep uniform(0, min(max_delay, base_delay * 2**n)).

    With `jitter=False` the sleep is that cap itself (a fixed doubling backoff).
    """

    attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 5.0
    jitter: bool = True

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be at least 1, got {self.attempts}")
        if self.base_delay < 0 or self.max_delay < self.base_delay:
            raise ValueError(
                f"RetryPolicy needs 0 <= base_delay <= max_delay, got {self.base_delay}, {self.max_delay}"
            )

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """The sleeps between attempts (`attempts - 1` of them), each fully jittered."""
        draw = rng or random.Random()
        for retry in range(self.attempts - 1):
            cap = min(self.max_delay, self.base_delay * 2.0**retry)
            yield draw.uniform(0.0, cap) if self.jitter else cap

    def worst_case_seconds(self) -> float:
        """An upper bound on the total sleep (not counting the attempts themselves)."""
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
