"""The quickstart on a consumer state or run manifest a bucket writer spoiled
(`quickstart.spoiled`): the wait resumes once repaired, ends at the time limit or on a stop with
one line naming the quickstart's own repairs, and every command in that line parses back to the
run it names.

A real signed consumer on the real store backends; the attacks: an old genuine save of the state
put back, the run manifest deleted or replaced by one of another key.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from slime_stoa.cli import build_parser
from slime_stoa.protocol.cli_fields import field_values
from slime_stoa.protocol.kept import TrainerCopies
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store
from slime_stoa.quickstart.config import QuickstartConfig, quickstart_command
from slime_stoa.quickstart.interrupt import Interrupt, Interrupted
from slime_stoa.quickstart.logfile import pause_lines_to_file
from slime_stoa.quickstart.report import ConsoleReport
from slime_stoa.quickstart.spoiled import (
    PausedTooLong,
    fresh_run,
    manifest_repair_line,
    opened_consumer,
    repair_line,
    resumed_state,
)
from slime_stoa.trainer.consumer import RolloutConsumer, pause
from slime_stoa.trainer.consumer.persistence import state_key
from tests.test_consumer import Tiny, config, tiny
from tests.test_signed_records import RUN, SignedRun, open_signed_consumer, setup_signed_run

__all__ = ["tiny"]  # the session fixture

#: Words of a slime trainer's repairs, which the quickstart's line must not offer.
SLIME_REPAIRS = ("keep_dir", "slime", "heads under")


def parsed(command: str) -> QuickstartConfig:
    """The config `command` (a printed `stoa quickstart` line) makes, through stoa's own parser."""
    argv = shlex.split(command)
    assert argv[:2] == ["stoa", "quickstart"], command
    args = build_parser().parse_args(argv[1:])
    return QuickstartConfig(**field_values(args, QuickstartConfig))


def commands_in(line: str) -> list[str]:
    """The `stoa quickstart ...` commands of a repair line (each ends the clause it is in)."""
    return [m.group(0) for m in re.finditer(r"stoa quickstart [^;]*?(?=; or |\.?$)", line)]


@pytest.mark.parametrize(
    "cfg",
    [
        QuickstartConfig(),
        QuickstartConfig(out=Path("a folder"), minutes=0.5, no_eval=True, workers=1, json=Path("s.json")),
        QuickstartConfig(task="search", store="s3://bucket/p?endpoint=http://127.0.0.1:9000&region=x", lr=1e-5),
        QuickstartConfig(model=Path("my model"), task="gsm8k", data=Path("gsm"), max_tokens=128),
    ],
)
def test_a_printed_command_parses_back_to_its_config(cfg: QuickstartConfig) -> None:
    assert parsed(quickstart_command(cfg)) == cfg
    assert parsed(quickstart_command(cfg, restart_from=7)) == dataclasses.replace(cfg, restart_from=7)


def test_the_repair_line_offers_the_quickstarts_repairs_each_runnable(tmp_path: Path) -> None:
    cfg = QuickstartConfig(out=tmp_path / "qs", minutes=2.0, no_eval=True)
    (tmp_path / "qs-2").mkdir()  # taken: the new run goes to the next free folder
    fresh = fresh_run(cfg)
    assert fresh == {"out": tmp_path / "qs-3"}
    kept = tmp_path / "qs" / "kept" / "runs" / RUN / "trainer" / "consumer.json"
    line = repair_line(cfg, kept=kept, checkpoints=[3, 5, 4], fresh=fresh)
    assert f"{state_key(cfg.run)} in the bucket" in line and str(kept) in line
    assert not any(word in line for word in SLIME_REPAIRS), line
    restart, new = (parsed(c) for c in commands_in(line))
    assert restart == dataclasses.replace(cfg, restart_from=5)  # the newest checkpoint
    assert new == dataclasses.replace(cfg, out=tmp_path / "qs-3")

    # No checkpoint, an unsigned run (no copy kept), a shared bucket: a new run needs a new name.
    shared = dataclasses.replace(cfg, store="s3://bucket/runs?endpoint=http://127.0.0.1:9000")
    line = repair_line(shared, kept=None, checkpoints=[], fresh=fresh_run(shared))
    assert "kept" not in line and "--restart-from" not in line
    (new,) = (parsed(c) for c in commands_in(line))
    assert new == dataclasses.replace(shared, out=tmp_path / "qs-3", run=f"{cfg.run}-3")


def test_the_manifest_repair_line_offers_its_copy_and_a_new_run(tmp_path: Path) -> None:
    cfg = QuickstartConfig(out=tmp_path / "qs", minutes=2.0, no_eval=True)
    kept = TrainerCopies(tmp_path / "qs" / "kept").path(RunLayout(cfg.run).run_manifest)
    line = manifest_repair_line(cfg, kept=kept, fresh=fresh_run(cfg))
    assert str(kept) in line and f"{RunLayout(cfg.run).run_manifest} in the bucket" in line
    assert "--restart-from" not in line  # a restart reads the same manifest: no repair
    assert not any(word in line for word in (*SLIME_REPAIRS, "stoa run create")), line
    (new,) = (parsed(c) for c in commands_in(line))
    assert new == dataclasses.replace(cfg, out=tmp_path / "qs-2")


def test_a_run_folder_without_a_name_gets_a_fresh_one_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert fresh_run(QuickstartConfig(out=Path("."))) == {"out": tmp_path.with_name(f"{tmp_path.name}-2")}


class Spoiled:
    """A signed run whose bucket holds save 1 of the consumer state while its head is at save 2."""

    def __init__(self, store: Store, consumer: RolloutConsumer, newest: bytes) -> None:
        self.store, self.consumer, self.newest = store, consumer, newest

    async def repair(self) -> None:
        await self.store.put(state_key(RUN), self.newest)


async def spoiled(store: Store, store_url: str, tiny: Tiny) -> Spoiled:
    run: SignedRun = await setup_signed_run(store, tiny, workers=("mac-a",))
    first = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key)
    await first.save_state()
    old = await store.get_bytes(state_key(RUN))
    await first.save_state()
    newest = await store.get_bytes(state_key(RUN))
    await first.close()
    await store.put(state_key(RUN), old)
    consumer = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key, poll_interval_s=0.01)
    return Spoiled(store, consumer, newest)


class Notes(ConsoleReport):
    """The quickstart's console report, recorded; `on_note` runs after each note."""

    def __init__(self, on_note: Callable[[], object] = lambda: None) -> None:
        self.out = io.StringIO()
        super().__init__(Console(file=self.out, width=10_000))
        self.on_note = on_note

    def note(self, text: str) -> None:
        super().note(text)
        self.on_note()

    def lines(self) -> list[str]:
        return self.out.getvalue().splitlines()


REPAIR = "put the newest consumer state back; or once stopped, restart: stoa quickstart --restart-from 1"


class TickingClock:
    """A clock that moves one second per reading: a deadline is met after a bounded number of tries."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


async def test_the_wait_resumes_once_the_state_is_repaired(store: Store, store_url: str, tiny: Tiny) -> None:
    s = await spoiled(store, store_url, tiny)
    report = Notes()
    reads = 0

    async def read() -> dict[str, Any] | None:
        nonlocal reads
        reads += 1
        if reads == 2:  # the operator's repair, once paused
            await s.repair()
        return await s.consumer.bucket_state()

    try:
        state = await resumed_state(
            read, minutes=10, repair=REPAIR, deadline=float("inf"), stop=Interrupt(), report=report,
            config=s.consumer.config,
        )
    finally:
        await s.consumer.close()
    assert state is not None and state["seq"] == 2  # the newest save, put back
    (note,) = report.lines()  # one note when the pause starts
    assert "paused:" in note and "an older save put back" in note and f"Repair: {REPAIR}" in note
    assert not any(word in note for word in SLIME_REPAIRS), note
    assert reads == 2


async def test_the_console_shows_one_line_per_pause_the_consumers_lines_go_to_the_log_file(
    store: Store, store_url: str, tiny: Tiny, tmp_path: Path
) -> None:
    """Two tries paused, then repaired: the console (the report and the CLI's root log handler)
    shows the quickstart's one note; the consumer's own lines, in a slime trainer's words, are in
    the run folder's log file only."""
    s = await spoiled(store, store_url, tiny)
    console = io.StringIO()
    handler = logging.StreamHandler(console)  # as `logging.basicConfig` puts one on stderr
    root = logging.getLogger()
    root.addHandler(handler)
    report = Notes()
    reads = 0

    async def read() -> dict[str, Any] | None:
        nonlocal reads
        reads += 1
        if reads == 3:  # the operator's repair, after two paused tries
            await s.repair()
        return await s.consumer.bucket_state()

    try:
        with pause_lines_to_file(tmp_path) as log_file:
            state = await resumed_state(
                read, minutes=10, repair=REPAIR, deadline=float("inf"), stop=Interrupt(), report=report,
                config=s.consumer.config,
            )
    finally:
        root.removeHandler(handler)
        await s.consumer.close()
    assert state is not None and state["seq"] == 2
    (note,) = report.lines()
    assert note.startswith("stoa paused:") and "paused" not in console.getvalue(), console.getvalue()
    logged = log_file.read_text().splitlines()
    assert [m[1] for line in logged if (m := re.search(r"stoa: paused \(try (\d+),", line))] == ["1", "2"], logged
    assert len(logged) == 3 and "stoa: resumed after 2 tries" in logged[2], logged
    assert pause.log.propagate and not pause.log.handlers  # as it was, once the quickstart is done


async def test_the_time_limit_ends_the_wait_with_one_line(store: Store, store_url: str, tiny: Tiny) -> None:
    s = await spoiled(store, store_url, tiny)
    clock = TickingClock()
    report = Notes()
    try:
        with pytest.raises(PausedTooLong) as raised:
            await resumed_state(
                s.consumer.bucket_state, minutes=0.5, repair=REPAIR, deadline=clock.now + 5,
                stop=Interrupt(), report=report, config=s.consumer.config, clock=clock,
            )
    finally:
        await s.consumer.close()
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("the time limit (--minutes 0.5) ran out while paused: the consumer state")
    assert "consumer.json" in message and message.endswith(f"Repair: {REPAIR}")
    assert not any(word in message for word in SLIME_REPAIRS), message
    assert len(report.lines()) == 1
    assert await store.get_bytes(state_key(RUN)) != s.newest  # nothing was saved over the spoiled state


async def test_the_pause_says_the_delay_it_sleeps_when_the_time_limit_cuts_the_backoff(
    store: Store, store_url: str, tiny: Tiny
) -> None:
    """A backoff of 30 s with 0.5 s left of --minutes: the note says the 0.5 s it sleeps, after
    which the next try ends the wait."""
    s = await spoiled(store, store_url, tiny)
    clock = TickingClock()  # the try reads 1001, the sleep 1002: 0.5 s before the deadline
    report = Notes()
    try:
        with pytest.raises(PausedTooLong):
            await resumed_state(
                s.consumer.bucket_state, minutes=0.5, repair=REPAIR, deadline=clock.now + 2.5, stop=Interrupt(),
                report=report, config=dataclasses.replace(s.consumer.config, poll_interval_s=30.0), clock=clock,
            )
    finally:
        await s.consumer.close()
    (note,) = report.lines()
    assert "; next try in 0.5 s, and it waits for the repair" in note and "30" not in note, note


async def test_a_stop_while_paused_says_the_repair(store: Store, store_url: str, tiny: Tiny) -> None:
    s = await spoiled(store, store_url, tiny)
    stop = Interrupt()
    report = Notes(on_note=stop.request)  # Ctrl-C once paused
    try:
        with pytest.raises(Interrupted) as raised:
            await resumed_state(
                s.consumer.bucket_state, minutes=10, repair=REPAIR, deadline=float("inf"), stop=stop,
                report=report, config=s.consumer.config,
            )
    finally:
        await s.consumer.close()
    assert raised.value.next_step == (
        f"the consumer state {state_key(RUN)} in {store_url} is still unusable. Repair: {REPAIR}"
    )


async def test_a_sound_state_is_read_at_once(store: Store, store_url: str, tiny: Tiny) -> None:
    s = await spoiled(store, store_url, tiny)
    await s.repair()
    report = Notes()
    try:
        state = await resumed_state(
            s.consumer.bucket_state, minutes=10, repair=REPAIR, deadline=0.0, stop=Interrupt(),
            report=report, config=s.consumer.config,
        )
    finally:
        await s.consumer.close()
    assert state is not None and state["seq"] == 2
    assert report.lines() == []  # no pause, and a past deadline does not matter to a state that reads


# -- the run manifest, while the consumer opens --------------------------------------------------
MANIFEST = RunLayout(RUN).run_manifest
MANIFEST_REPAIR = "put the run manifest back; or once stopped, start a new run: stoa quickstart --out qs-2"


async def forge_manifest(store: Store, genuine: bytes) -> None:
    """A bucket writer's manifest: the run's own, naming and signed by a key of its own."""
    forger = SigningKey.generate()
    forged = dataclasses.replace(RunManifest.from_bytes(genuine), run_key=forger.public.to_text())
    await store.put(MANIFEST, forged.to_bytes(forger))


def opening(store: Store, store_url: str, tiny: Tiny, run: SignedRun, keep_dir: Path) -> Any:
    """`RolloutConsumer.open` of the signed run with all but the wait's hooks bound, as the
    quickstart binds it: restored later, its own copies kept in `keep_dir` (empty: no copy)."""
    cfg = config(store_url, run_key=run.run_key.public.to_text(), keep_dir=str(keep_dir), poll_interval_s=0.01)
    return functools.partial(
        RolloutConsumer.open, store, cfg, decode=tiny.decode, eos_ids=frozenset({tiny.eos}), prompt_of=tiny.prompt,
        restore=False, state_key=run.run_key,
    )


async def test_the_open_resumes_once_the_manifest_copy_is_back(
    store: Store, store_url: str, tiny: Tiny, tmp_path: Path
) -> None:
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    genuine = await store.get_bytes(MANIFEST)
    await forge_manifest(store, genuine)
    copies = TrainerCopies(tmp_path / "kept")
    report = Notes(on_note=lambda: copies.keep(MANIFEST, genuine))  # the operator's repair, once paused
    open_consumer = opening(store, store_url, tiny, run, copies.folder)
    consumer = await opened_consumer(
        open_consumer, minutes=10, repair=MANIFEST_REPAIR, deadline=float("inf"), stop=Interrupt(), report=report,
        config=open_consumer.args[1],
    )
    await consumer.close()
    assert await store.get_bytes(MANIFEST) == genuine  # the consumer put its copy back itself
    (note,) = report.lines()
    assert note.startswith(f"stoa paused: the run manifest {MANIFEST} in {store_url} is signed by another key"), note
    assert note.endswith(f"Repair: {MANIFEST_REPAIR}"), note
    assert not any(word in note for word in (*SLIME_REPAIRS, "stoa run create")), note


async def test_the_time_limit_ends_the_manifest_wait_with_one_line(
    store: Store, store_url: str, tiny: Tiny, tmp_path: Path
) -> None:
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    await store.delete(MANIFEST)
    clock = TickingClock()
    report = Notes()
    open_consumer = opening(store, store_url, tiny, run, tmp_path / "kept")
    with pytest.raises(PausedTooLong) as raised:
        await opened_consumer(
            open_consumer, minutes=0.5, repair=MANIFEST_REPAIR, deadline=clock.now + 5, stop=Interrupt(),
            report=report, config=open_consumer.args[1], clock=clock,
        )
    message = str(raised.value)
    assert message == (
        f"the time limit (--minutes 0.5) ran out while paused: the run manifest {MANIFEST} in {store_url} is gone "
        f"(deleted). Repair: {MANIFEST_REPAIR}"
    )
    assert len(report.lines()) == 1
    assert not await store.exists(MANIFEST)


async def test_a_stop_while_the_manifest_wait_says_the_repair(
    store: Store, store_url: str, tiny: Tiny, tmp_path: Path
) -> None:
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    await forge_manifest(store, await store.get_bytes(MANIFEST))
    stop = Interrupt()
    open_consumer = opening(store, store_url, tiny, run, tmp_path / "kept")
    with pytest.raises(Interrupted) as raised:
        await opened_consumer(
            open_consumer, minutes=10, repair=MANIFEST_REPAIR, deadline=float("inf"), stop=stop,
            report=Notes(on_note=stop.request), config=open_consumer.args[1],  # Ctrl-C once paused
        )
    assert raised.value.next_step == (
        f"the run manifest {MANIFEST} in {store_url} is still gone or refused. Repair: {MANIFEST_REPAIR}"
    )


async def test_a_pause_met_past_the_time_limit_says_so_once_then_stops(store: Store, store_url: str, tiny: Tiny) -> None:
    s = await spoiled(store, store_url, tiny)
    report = Notes()
    try:
        with pytest.raises(PausedTooLong):
            await resumed_state(
                s.consumer.bucket_state, minutes=0.5, repair=REPAIR, deadline=0.0, stop=Interrupt(),
                report=report, config=s.consumer.config,
            )
    finally:
        await s.consumer.close()
    (note,) = report.lines()
    assert "paused:" in note and "the time limit leaves no time to wait for the repair" in note and "next try" not in note
