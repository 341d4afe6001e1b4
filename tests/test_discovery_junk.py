"""Junk in the rollouts prefix (one token holder's attack) costs the consumer nothing that grows
with it: the small form of scripts/bench_junk.py, plus the discovery rules one by one."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import Store, open_store
from slime_stoa.trainer.consumer.discovery import Discovery, advance_cursor, cursor_past, horizon
from slime_stoa.trainer.consumer.state import ConsumerState
from tests.scripts_loader import load_script
from tests.test_consumer import RUN, Tiny, tiny

__all__ = ["tiny"]  # the session fixture

bench = load_script("bench_junk")
PER_WAVE = 4


async def small_form(tiny: Tiny, root: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], list[str]]:
    """scripts/bench_junk.py at 20,000 junk keys of each kind: (junk, control, summary, targets
    missed); the security report takes its `junk_list_ratio` and `junk_state_bytes`."""
    junk, control = await bench.bench_pair(
        tiny, junk=20_000, waves=3, per_wave=PER_WAVE, wait_s=120.0, s3_url=None, root=root
    )
    summary, missed = bench.summarize(junk, control, PER_WAVE)
    return junk, control, summary, missed


async def test_twenty_thousand_junk_keys_of_each_kind_cost_nothing_that_grows(tmp_path: Path, tiny: Tiny) -> None:
    junk, control, summary, missed = await small_form(tiny, tmp_path)
    assert missed == [], (summary, junk, control)
    assert junk["admitted"] == control["admitted"] == 12
    assert junk["get_requests"] == control["get_requests"]  # no junk key is downloaded
    # Each junk key was seen and counted once; none is in the saved state.
    assert junk["rejected"]["unknown_key"] == 20_000
    assert junk["rejected"]["bad_key"] >= 10_000  # those stamped behind the clock, and the first after the horizon


def test_the_cursor_passes_junk_but_never_the_clock_nor_a_record_name() -> None:
    assert cursor_past("1700000000000-X_1.rec") == "1700000000000-X_1.rec"
    assert cursor_past("17000000000x") == "1700000000100"  # no 13-digit name lies in between
    assert "1700000000099-a-0000000000.rec" < "17000000000x" < "1700000000100"
    assert cursor_past("zz-junk") is None and cursor_past("99x") is None
    assert advance_cursor("", "17000000000x", now_ms=1_700_000_000_050) == "1700000000050"
    assert advance_cursor("1700000000200", "17000000000x", now_ms=1_800_000_000_000) == "1700000000200"
    assert horizon(1_000, 500) == "0000000001501" and horizon(10**12, 0) < "zz"


async def test_keys_written_stamped_ahead_are_never_taken_even_when_their_time_comes(tmp_path: Path) -> None:
    root = tmp_path / "bucket"
    root.mkdir()
    layout = RunLayout(RUN)
    async with open_store(f"file://{root}") as store:
        honest = layout.rollout("mac-a", 2_000_000_000_000, 0)
        ahead = layout.rollout("mac-a", 2_000_000_000_000 + 3_600_000, 1)  # written an hour ahead
        for key in (honest, ahead):
            await store.put_if_absent(key, b"x")
        # The store wrote both at this test's real time; the "trainer clock" is the keys' time.
        state = ConsumerState(run=RUN)
        clock = [2_000_000_000.0]
        discovery = _discovery(store, layout, state, clock)
        first = await discovery.tail(100)
        assert [n.name for n in first.new] == []  # both written long before they were stamped
        assert first.future == 1  # the other lies beyond the horizon: not even listed
        clock[0] += 3600.0
        second = await discovery.tail(100)
        assert second.new == [] and second.future == 1 and state.seen == set() and state.pending == {}


def _discovery(store: Store, layout: RunLayout, state: ConsumerState, clock: list[float]) -> Discovery:
    return Discovery(store, layout, state, window_ms=60_000, late_window_ms=0, future_ms=300_000, clock=lambda: clock[0])


async def test_a_sweep_through_junk_goes_in_steps_with_the_tail_between_them(tmp_path: Path) -> None:
    """2,500 junk keys inside the window behind the cursor: a sweep of one page per step lists
    them in three steps (`sweeping` between them), a tail between two steps takes a new honest
    key at once, and the last step finds a late honest key beyond the junk."""
    root = tmp_path / "bucket"
    root.mkdir()
    layout = RunLayout(RUN)
    t = int(time.time() * 1000)  # the folder store stamps what it writes with the real clock
    async with open_store(f"file://{root}") as store:
        await store.put_if_absent(layout.rollout("mac-a", t, 0), b"x")
        state = ConsumerState(run=RUN)
        clock = [t / 1000 + 1.0]
        discovery = _discovery(store, layout, state, clock)
        assert [n.name for n in (await discovery.tail(100)).new] == [layout.rollout("mac-a", t, 0).rsplit("/", 1)[1]]
        write = bench.folder_writer(root)  # junk files laid directly, as the benchmark lays them
        for i in range(2_500):  # junk stamped 20 s behind the cursor
            await write(f"{layout.rollouts_prefix('train')}{t - 20_000:013d}-X_{i:05d}.rec", b"j")
        late = layout.rollout("mac-b", t - 10_000, 0)  # a slow upload, stamped after the junk
        await store.put_if_absent(late, b"x")

        steps = []
        first = await discovery.sweep(max_pages=1)
        steps.append((first.listed, first.requests, first.late, discovery.sweeping))
        fresh = layout.rollout("mac-a", t + 500, 1)
        await store.put_if_absent(fresh, b"x")
        between = await discovery.tail(100)  # the tail runs while the sweep is unfinished
        assert [n.worker for n in between.new] == ["mac-a"] and discovery.sweeping
        while discovery.sweeping:
            step = await discovery.sweep(max_pages=1)
            steps.append((step.listed, step.requests, step.late, discovery.sweeping))
        assert steps == [(1000, 1, 0, True), (1000, 1, 0, True), (503, 1, 1, False)], steps  # the last: junk, late, cursor
        assert late.rsplit("/", 1)[1] in state.seen
        again = await discovery.sweep(max_pages=1)  # a new sweep starts at the window's floor
        assert again.listed == 1000 and again.late == 0 and discovery.sweeping
        stopped_at = discovery._sweep_from
        discovery.forget_sweep()  # a state loaded in place of this one: its sweeps start afresh
        assert not discovery.sweeping
        assert (await discovery.sweep(max_pages=1)).listed == 1000 and discovery._sweep_from == stopped_at  # from the floor


async def test_a_sweep_never_takes_again_a_name_the_tail_forgot_between_its_steps(tmp_path: Path) -> None:
    """A sweep over the whole remembered window, stopped inside it: the tail moves the cursor on
    and forgets the names that left the window; the sweep's next step lists from the new floor,
    not from where it stopped, so a forgotten name is not taken (and downloaded) a second time."""
    root = tmp_path / "bucket"
    root.mkdir()
    layout = RunLayout(RUN)
    t = int(time.time() * 1000)
    async with open_store(f"file://{root}") as store:
        old = layout.rollout("mac-a", t - 50_000, 0)
        await store.put_if_absent(old, b"x")
        await store.put_if_absent(layout.rollout("mac-a", t, 1), b"x")
        state = ConsumerState(run=RUN)
        clock = [t / 1000 + 1.0]
        discovery = _discovery(store, layout, state, clock)
        assert len((await discovery.tail(100)).new) == 2
        write = bench.folder_writer(root)
        for i in range(1_500):  # junk before the old record, inside the window
            await write(f"{layout.rollouts_prefix('train')}{t - 55_000:013d}-X_{i:05d}.rec", b"j")
        first = await discovery.sweep(max_pages=1)
        assert first.late == 0 and discovery.sweeping
        clock[0] += 20.0  # the old record leaves the 60 s window behind the next cursor
        await store.put_if_absent(layout.rollout("mac-b", t + 20_000, 0), b"x")
        assert [n.worker for n in (await discovery.tail(100)).new] == ["mac-b"]
        assert old.rsplit("/", 1)[1] not in state.seen  # forgotten: no listing from the floor returns it
        rest = await discovery.sweep(max_pages=1)
        assert rest.new == [] and not discovery.sweeping
