"""A consumer state a bucket writer spoiled, as the quickstart meets it when it resumes a run.

Any worker token can delete or overwrite `consumer.json`, or put an older save of it back. In a
signed run the quickstart keeps its own copy (`<out>/kept`, `protocol/kept.py`) and the trainer
puts that copy back by itself: nothing waits. Without the copy (deleted, or an unsigned run) the
quickstart pauses as the trainer does (`trainer.consumer.pause.until_repaired`), but says the
quickstart's repairs, not a slime trainer's: put the newest state back (its copy included), stop
and restart from a checkpoint (`--restart-from`), or start a new run in a fresh folder; each
command as it runs. The wait ends by itself once the state is repaired; the RL part's time limit
(`--minutes`) and Ctrl-C end it too, each with one line saying what to do.

The run manifest, which any worker token can delete or forge as well, gets the same wait, time
limit and Ctrl-C while the consumer opens (`opened_consumer`): the consumer puts its own copy
(`<out>/kept`) back by itself, so it pauses only when that copy is gone too.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunKeyMismatch, RunNotFound
from slime_stoa.trainer.consumer import ConsumerConfig
from slime_stoa.trainer.consumer.pause import Broken, until_repaired
from slime_stoa.trainer.consumer.persistence import StateRollback, UntrustedState, UnusableState, state_key

from .config import QuickstartConfig, QuickstartError, quickstart_command
from .interrupt import Interrupt, Interrupted

T = TypeVar("T")

#: What `RolloutConsumer.bucket_state` raises for a state a bucket writer spoiled.
SPOILED = (UntrustedState, UnusableState)


class PausedTooLong(QuickstartError):
    """The RL part's time ran out while the quickstart waited for the repair of a spoiled state (or run manifest)."""


class SpoiledState(Exception):
    """What a bucket writer did to the consumer state, in the quickstart's words."""


def spoiled_cause(exc: Exception) -> str:
    """What `exc` (one of `SPOILED`) says the bucket holds. The consumer's own message names a
    slime trainer's repairs, which do not apply here."""
    if isinstance(exc, StateRollback):
        return "an older save put back (older than its newest signed head)"
    if isinstance(exc, UntrustedState):
        return "not signed by the run key (a forgery, or written unsigned)"
    return "not a consumer state of this run (garbage, or another run's)"


def manifest_cause(exc: BaseException) -> str:
    """What the error a `Broken` run manifest carries says the bucket holds. The reader's own
    message names a slime trainer's repairs (`stoa run create`), which do not apply here."""
    if isinstance(exc, RunNotFound):
        return "gone (deleted)"
    if isinstance(exc, RunKeyMismatch):
        return "signed by another key than the run key (a forgery)"
    return "not a run manifest of this run (garbage)"


def fresh_run(cfg: QuickstartConfig) -> dict[str, Any]:
    """The options of a new run beside this one: the first run folder `<out>-2`, `<out>-3`, ...
    that does not exist yet (this folder's worker keys belong to this run), and with --store,
    whose bucket the runs share, a run name of the same number."""
    out = Path(os.path.abspath(cfg.out))  # `--out .` has no name to number
    n = 2
    while out.with_name(f"{out.name}-{n}").exists():
        n += 1
    fresh: dict[str, Any] = {"out": out.with_name(f"{out.name}-{n}")}
    if cfg.store is not None:
        fresh["run"] = f"{cfg.run}-{n}"
    return fresh


def repair_line(cfg: QuickstartConfig, *, kept: Path | None, checkpoints: Sequence[int], fresh: Mapping[str, Any]) -> str:
    """The quickstart's repairs of its spoiled consumer state, each command as it runs. `kept`:
    where its own copy of the state goes (None in an unsigned run: it keeps none);
    `checkpoints`: the versions it can restart from; `fresh`: the options of a new run
    (`fresh_run`). The commands run once this quickstart has stopped (one per run folder)."""
    copy = f" (or its own copy to {kept}: it puts that back itself)" if kept is not None else ""
    ways = [
        f"put the newest consumer state back at {state_key(cfg.run)} in the bucket{copy}: a waiting quickstart "
        "resumes, a stopped one when the same command is run again"
    ]
    if checkpoints:
        restart = quickstart_command(cfg, restart_from=max(checkpoints))
        ways.append(f"once stopped, restart from its newest checkpoint: {restart}")
    ways.append(f"once stopped, start a new run: {quickstart_command(cfg, **fresh)}")
    return "; or ".join(ways)


def manifest_repair_line(cfg: QuickstartConfig, *, kept: Path, fresh: Mapping[str, Any]) -> str:
    """The quickstart's repairs of its run manifest, gone or forged in the bucket while its own
    copy is gone too: that copy back at `kept` (the consumer puts it back in the bucket itself),
    or the signed original back in the bucket; else a new run (`fresh`: `fresh_run`). No
    checkpoint helps: a restart reads the same manifest."""
    return (
        f"put the run manifest back: its copy to {kept} (it puts that back itself), or the signed original at "
        f"{RunLayout(cfg.run).run_manifest} in the bucket: a waiting quickstart resumes, a stopped one when the "
        f"same command is run again; or once stopped, start a new run: {quickstart_command(cfg, **fresh)}"
    )


class Paused:
    """The quickstart's hooks on one `until_repaired` wait: a note when the pause starts (with
    `repair` and the real delay to the next try), `PausedTooLong` at the first try once `clock()`
    passes `deadline` (the end of the RL part's `minutes`), and no sleep past it. `describe`: a
    `Broken` in the quickstart's words."""

    def __init__(
        self,
        *,
        minutes: float,
        repair: str,
        deadline: float,
        report: Any,
        describe: Callable[[Broken], str] = str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.minutes, self.repair, self.deadline = minutes, repair, deadline
        self.report, self.describe, self.clock = report, describe, clock
        self.tries = 0
        self.broken: Broken | None = None  # what the last try met
        self.said = False

    def note(self, broken: Broken, then: str) -> None:
        """The pause's one note (said once), `then` what happens next."""
        if not self.said:
            self.said = True
            self.report.note(f"paused: {self.describe(broken)}; {then}. Repair: {self.repair}")

    def on_try(self, broken: Broken) -> None:
        self.tries += 1
        self.broken = broken
        if self.clock() >= self.deadline:
            self.note(broken, "the time limit leaves no time to wait for the repair")
            raise PausedTooLong(
                f"the time limit (--minutes {self.minutes:g}) ran out while paused: {self.describe(broken)}. "
                f"Repair: {self.repair}"
            )

    async def sleep(self, delay: float) -> None:
        """The backoff's `delay`, cut at the deadline (the next try then ends the wait); the
        pause's note, at its first sleep, says the delay slept, not the backoff's."""
        wait = min(delay, max(self.deadline - self.clock(), 0.0))
        if self.broken is not None:
            self.note(self.broken, f"next try in {wait:.1f} s, and it waits for the repair until the time limit or Ctrl-C")
        await asyncio.sleep(wait)

    async def race(self, stop: Interrupt, wait: Awaitable[T], *, still: str) -> T:
        """`await wait` unless `stop` comes first: then `Interrupted`, whose next step, once
        paused, is `still` (what is still broken) and the repair."""
        try:
            return await stop.race(wait)
        except Interrupted as exc:
            if not self.tries:
                raise
            raise Interrupted(str(exc), next_step=f"{still}. Repair: {self.repair}") from None


async def resumed_state(
    read: Callable[[], Any],
    *,
    minutes: float,
    repair: str,
    deadline: float,
    stop: Interrupt,
    report: Any,
    config: ConsumerConfig,
    clock: Callable[[], float] = time.time,
) -> dict[str, Any] | None:
    """`await read()` (the consumer's `bucket_state`), waiting while it raises one of `SPOILED`:
    paused (`until_repaired`, backing off from `config.poll_interval_s`) with the hooks of
    `Paused`, and `repair` in every line. `PausedTooLong` at the time limit; `Interrupted` with
    `repair` as its next step on a stop signal while paused."""
    where = f"{state_key(config.run)} in {config.store_url}"

    async def attempt() -> dict[str, Any] | None:
        try:
            return await read()
        except SPOILED as exc:
            raise Broken(f"the consumer state {where} is unusable", repair, SpoiledState(spoiled_cause(exc))) from exc

    pause = Paused(minutes=minutes, repair=repair, deadline=deadline, report=report, clock=clock)
    waited = until_repaired(attempt, config, on_try=pause.on_try, sleep=pause.sleep)
    return await pause.race(stop, waited, still=f"the consumer state {where} is still unusable")


async def opened_consumer(
    open_consumer: Callable[..., Awaitable[T]],
    *,
    minutes: float,
    repair: str,
    deadline: float,
    stop: Interrupt,
    report: Any,
    config: ConsumerConfig,
    clock: Callable[[], float] = time.time,
) -> T:
    """`await open_consumer(on_try=..., sleep=...)`: `RolloutConsumer.open` with its other
    arguments bound (`config` among them), its wait for a run manifest a bucket writer deleted
    or forged bounded as `resumed_state`'s is, with `repair` (`manifest_repair_line`)."""
    where = f"{RunLayout(config.run).run_manifest} in {config.store_url}"
    pause = Paused(
        minutes=minutes, repair=repair, deadline=deadline, report=report, clock=clock,
        describe=lambda broken: f"the run manifest {where} is {manifest_cause(broken.cause)}",
    )
    opening = open_consumer(on_try=pause.on_try, sleep=pause.sleep)
    return await pause.race(stop, opening, still=f"the run manifest {where} is still gone or refused")
