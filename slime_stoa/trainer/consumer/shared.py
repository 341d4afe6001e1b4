"""What the parts of one `RolloutConsumer` share: the store and the run's layout, the resolved
config, the clock, the consumer state (its counters), the first fatal store error, and store
calls through outages (`patiently`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import Store, StoreConfigError
from slime_stoa.protocol.store.retry import outage_policy, through_outages

from .config import ConsumerConfig, ResolvedConfig
from .metrics import reject_counter, worker_counter
from .state import ConsumerState, name_worker

log = logging.getLogger(__name__)
T = TypeVar("T")

LOUD_REJECTS = 10  # rejects logged per reason; later ones every 1,000th
#: Refusals that mean the worker's clock is off (its times or its key stamped too far ahead of the
#: trainer's clock): also counted per worker as `worker/<id>/clock_refused`, which `stoa fleet`
#: shows from the saved state, so the Mac's owner learns that its records are lost, and why.
CLOCK_REASONS = frozenset({"timestamps", "future_key"})
CLOCK_REFUSED = "clock_refused"


class Shared:
    def __init__(
        self, store: Store, config: ResolvedConfig, state: ConsumerState, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.config = config
        self.state = state  # replaced as a whole by `RolloutConsumer.load_state_dict`
        self.clock = clock
        self.layout = RunLayout(config.run)
        self.prefix = self.layout.rollouts_prefix("train")
        self.fatal: StoreConfigError | None = None  # a store call met a config error: next_batch raises it
        self._logged: dict[str, int] = {}

    def count(self, name: str, n: int = 1) -> None:
        if n:
            counters = self.state.counters
            counters[name] = counters.get(name, 0) + n

    def reject(self, name: str, reason: str, detail: str) -> None:
        """Count the record `name` rejected for `reason` (and against its worker); log the first
        `LOUD_REJECTS` of each reason, then every 1,000th: a warning, except for a `duplicate`
        (a group identical to one admitted: used once, nothing to act on), which is info."""
        self.count(reject_counter(reason))
        self.count(worker_counter(name_worker(name), "rejected"))
        if reason in CLOCK_REASONS:
            self.count(worker_counter(name_worker(name), CLOCK_REFUSED))
        seen = self._logged[reason] = self._logged.get(reason, 0) + 1
        if seen <= LOUD_REJECTS or seen % 1000 == 0:
            level = logging.INFO if reason == "duplicate" else logging.WARNING
            log.log(level, "stoa: rejected %s (%s, %d so far): %s", self.prefix + name, reason, seen, detail)

    async def patiently(self, op: Callable[[], Awaitable[T]], describe: str) -> T:
        """`op()`, waiting out a store outage of any length (counted `store_outage_retries`)."""
        return await patiently(self.config, op, describe, on_outage=lambda _exc: self.count("store_outage_retries"))


async def patiently(
    config: ConsumerConfig,
    op: Callable[[], Awaitable[T]],
    describe: str,
    *,
    on_outage: Callable[[BaseException], object] | None = None,
) -> T:
    """`op()` through store outages of any length (`retry.through_outages`): the error logged when
    the outage starts and then every `progress_interval_s`, a jittered backoff capped at
    `store_retry_max_delay_s`; a `StoreConfigError` is raised at once."""
    return await through_outages(
        op,
        describe=describe,
        policy=outage_policy(config.store_retry_max_delay_s),
        log_interval_s=config.progress_interval_s,
        logger=log,
        on_outage=on_outage,
    )
