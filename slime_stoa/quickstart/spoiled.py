"""A consumer state a bucket writer spoiled, as the quickstart meets it when it resumes a run.

Any worker token can delete or overwrite `consumer.json`, or put an older save of it back. In a
signed run the quickstart keeps its own copy (`<out>/kept`, `protocol/kept.py`) and the trainer
puts that copy back by itself: nothing waits. Without the copy (deleted, or an unsigned run) the
quickstart pauses as the trainer does (`trainer.consumer.pause.until_repaired`), but says the
quickstart's repairs, not a slime trainer's: put the newest state back (its copy included), stop
and restart from a checkpoint (`--restart-from`), or start a new run in a fresh folder; each
command as it runs. The wait ends by itself once the state is repaired; the RL part's time limit
(`--minutes`) and Ctrl-C end it too, each with one line saying what to do.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from slime_stoa.trainer.consumer import ConsumerConfig
from slime_stoa.trainer.consumer.pause import Broken, until_repaired
from slime_stoa.trainer.consumer.persistence import StateRollback, UntrustedState, UnusableState, state_key

from .config import QuickstartConfig, QuickstartError, quickstart_command
from .interrupt import Interrupt, Interrupted

#: What `RolloutConsumer.bucket_state` raises for a state a bucket writer spoiled.
SPOILED = (UntrustedState, UnusableState)


class PausedTooLong(QuickstartError):
    """The RL part's time ran out while the quickstart waited for a spoiled state's repair."""


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
    paused (`until_repaired`, backing off from `config.poll_interval_s`), a note when the pause
    starts, and `repair` in every line. `PausedTooLong` once `clock()` passes `deadline` (the
    end of the RL part's `minutes`); `Interrupted` with `repair` as its next step on a stop
    signal while paused."""
    paused = 0
    where = f"{state_key(config.run)} in {config.store_url}"

    async def attempt() -> dict[str, Any] | None:
        try:
            return await read()
        except SPOILED as exc:
            raise Broken(f"the consumer state {where} is unusable", repair, SpoiledState(spoiled_cause(exc))) from exc

    def on_try(broken: Broken) -> None:
        nonlocal paused
        paused += 1
        if paused == 1:
            report.note(f"paused: {broken}; it waits for the repair until the time limit or Ctrl-C. Repair: {repair}")
        if clock() >= deadline:
            raise PausedTooLong(f"the time limit (--minutes {minutes:g}) ran out while paused: {broken}. Repair: {repair}")

    async def sleep(delay: float) -> None:  # never past the deadline: the next try then ends the wait
        await asyncio.sleep(min(delay, max(deadline - clock(), 0.0)))

    try:
        return await stop.race(until_repaired(attempt, config, on_try=on_try, sleep=sleep))
    except Interrupted as exc:
        if not paused:
            raise
        raise Interrupted(str(exc), next_step=f"the consumer state {where} is still unusable. Repair: {repair}") from None
