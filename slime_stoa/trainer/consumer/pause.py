"""Pausing on an object a bucket writer broke: the consumer waits, says what is wrong and how to
repair it, and resumes by itself once it is repaired.

In single-bucket mode any worker token can delete or overwrite the run manifest or the consumer
state. Without the trainer's own copies (`ConsumerConfig.keep_dir`) the trainer cannot repair such
an object itself, but stopping would hand every token holder an off switch. So the call that met
it is tried again, with a backoff doubling from `poll_interval_s` to `store_retry_max_delay_s`,
and reported in one line at tries 1, 2, 4, 8, ... (not at every try) naming the object and the
repair (the error's text cut to one bounded line: it may quote a bucket writer's object); every try
is counted (`on_try`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from slime_stoa.protocol.printable import printable

from .config import ConsumerConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


class Broken(Exception):
    """What a repairable call raises: `what` is broken (gone, garbage, forged), `repair` says how
    to fix it; `cause` is the error met."""

    def __init__(self, what: str, repair: str, cause: BaseException) -> None:
        super().__init__(f"{what}: {cause}")
        self.what = what
        self.repair = repair
        self.cause = cause


def is_report_try(tries: int) -> bool:
    """Tries 1, 2, 4, 8, ...: the ones reported."""
    return tries > 0 and tries & (tries - 1) == 0


async def until_repaired(
    op: Callable[[], Awaitable[T]],
    config: ConsumerConfig,
    *,
    on_try: Callable[[Broken], object] | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> T:
    """`op()`, tried again while it raises `Broken` (see the module doc); any other error is
    raised at once."""
    tries, delay = 0, config.poll_interval_s
    while True:
        try:
            result = await op()
        except Broken as exc:
            tries += 1
            if on_try is not None:
                on_try(exc)
            if is_report_try(tries):
                # The error may quote what a bucket writer wrote: one bounded line, whatever it is.
                log.error(
                    "stoa: paused (try %d, next in %.1f s): %s. Repair: %s", tries, delay, printable(str(exc)), exc.repair,
                )
            await sleep(delay)
            delay = min(delay * 2, max(config.store_retry_max_delay_s, config.poll_interval_s))
            continue
        if tries:
            log.warning("stoa: resumed after %d tries: what paused the consumer is repaired", tries)
        return result
