"""slime's rollout function restarting on a consumer state a bucket writer spoiled: it never stops.

With one bucket, any worker token can overwrite `runs/<run>/trainer/consumer.json`: with garbage,
with a state signed by another key, or with an old genuine save of the trainer's (a rollback).
Through the real `generate_rollout` and `StoaDataSource` (stand-in slime modules), a restarted
trainer

- with no consumer state in its checkpoint and no `stoa_keep_dir`: pauses, counted
  `paused/consumer_state`, says in one line what is wrong and how to repair it, and resumes by
  itself from the repaired state, with no group used twice;
- with `stoa_keep_dir`: puts its own copy back and carries on at once;
- with its checkpoint's consumer state: resumes from that, and its save writes over the spoiled one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.signing import SigningKey, write_key_file
from slime_stoa.protocol.store import Store
from slime_stoa.trainer.consumer.persistence import parse_state, state_bytes, state_key
from slime_stoa.trainer.slime import rollout
from slime_stoa.trainer.slime.data_source import StoaDataSource
from tests.conftest import async_wait_until
from tests.test_consumer import RUN, Tiny, now_ms, tiny
from tests.test_rollout_resilience import close_session, creds, keys_of, logged, rollout_args, slime
from tests.test_signed_records import SignedRun, setup_signed_run
from tests.test_trust_writer import records

__all__ = ["creds", "slime", "tiny"]  # fixtures

#: Not JSON at all: not a consumer state (an unsigned JSON object would read as a forgery).
GARBAGE = b"\x89 not a consumer state"
#: Tries a test watches the paused rollout make before it repairs the state.
TRIES = 4


async def run_with_two_saves(store: Store, store_url: str, tiny: Tiny, tmp_path: Path, **settings: Any):
    """A signed run with six records; a first trainer takes two batches of two (saving the state
    after each) and stops. Returns (run, args maker, the six keys, the keys used, save 1, save 2)."""
    run: SignedRun = await setup_signed_run(store, tiny, workers=("mac-a",))
    key_file = write_key_file(tmp_path / "run.key", run.run_key)
    await records(store, tiny, run, "mac-a", range(6), now_ms() - 20_000)

    def args(ckpt: str) -> Any:
        return rollout_args(store_url, tiny, save=str(tmp_path / ckpt), stoa_run_key=str(key_file), **settings)

    first = args("ckpt-first")
    source = StoaDataSource(first)
    used = keys_of(await asyncio.to_thread(rollout.generate_rollout, first, 0, source))
    save1 = await store.get_bytes(state_key(RUN))
    used += keys_of(await asyncio.to_thread(rollout.generate_rollout, first, 1, source))
    save2 = await store.get_bytes(state_key(RUN))
    await close_session()
    everything = sorted([o.key async for o in store.list(RunLayout(RUN).rollouts_prefix("train"))])
    assert len(everything) == 6 and len(set(used)) == 4
    return run, args, everything, used, save1, save2


def spoiled(kind: str, save1: bytes, save2: bytes) -> bytes:
    if kind == "rollback":  # an old genuine save of the trainer's, put back
        return save1
    if kind == "forgery":  # the newest state's content, signed by a key that is not the run's
        return state_bytes(parse_state(save2, RUN, None), SigningKey.generate())
    return GARBAGE


def paused(c: Any) -> int:
    return c.counters.get("paused/consumer_state", 0) if c is not None else 0


@pytest.mark.parametrize("kind", ["rollback", "forgery", "garbage"])
async def test_a_restart_on_a_spoiled_state_pauses_until_it_is_repaired(
    store: Store, store_url: str, tiny: Tiny, creds: dict, slime: None, tmp_path: Path,
    caplog: pytest.LogCaptureFixture, kind: str,
) -> None:  # fmt: skip
    caplog.set_level(logging.INFO, logger="slime_stoa")
    _run, args, everything, used, save1, save2 = await run_with_two_saves(store, store_url, tiny, tmp_path)
    await store.put(state_key(RUN), spoiled(kind, save1, save2))
    restarted = args("ckpt-fresh")  # a checkpoint without a consumer state: only the bucket's
    task = asyncio.ensure_future(asyncio.to_thread(rollout.generate_rollout, restarted, 2, StoaDataSource(restarted)))

    def session_paused() -> int:
        s = rollout._SESSION
        return paused(s.consumer if s is not None else None)

    await async_wait_until(lambda: session_paused() >= TRIES or task.done(), message="the restart pausing")
    assert not task.done(), task.exception() if task.done() else None  # paused, not stopped
    lines = logged(caplog, "stoa: paused")
    assert lines and all("\n" not in line for line in lines)  # one line each, at tries 1, 2, 4, ...
    assert "consumer.json" in lines[-1] and "Repair:" in lines[-1] and "keep_dir" in lines[-1]
    await store.put(state_key(RUN), save2)  # the repair: the trainer's newest save back
    out = await asyncio.wait_for(task, 60)
    assert sorted(used + keys_of(out)) == everything  # the other two: none used twice, none skipped
    assert logged(caplog, "resumed from bucket state") and logged(caplog, "resumed after")


@pytest.mark.parametrize("kind", ["rollback", "forgery", "garbage"])
async def test_with_keep_dir_a_restart_puts_its_own_copy_back(
    store: Store, store_url: str, tiny: Tiny, creds: dict, slime: None, tmp_path: Path, kind: str,
) -> None:  # fmt: skip
    run, args, everything, used, save1, save2 = await run_with_two_saves(
        store, store_url, tiny, tmp_path, stoa_keep_dir=str(tmp_path / "kept")
    )
    await store.put(state_key(RUN), spoiled(kind, save1, save2))
    restarted = args("ckpt-fresh")
    out = await asyncio.wait_for(asyncio.to_thread(rollout.generate_rollout, restarted, 2, StoaDataSource(restarted)), 60)
    assert sorted(used + keys_of(out)) == everything
    assert rollout._SESSION is not None and paused(rollout._SESSION.consumer) == 0  # no pause: nothing to wait for
    back = parse_state(await store.get_bytes(state_key(RUN)), RUN, [run.run_key.public])
    assert back.counters["groups_used"] == 6  # the copy went back, then this rollout's save over it


async def test_a_checkpoints_own_state_is_resumed_from_and_the_spoiled_one_written_over(
    store: Store, store_url: str, tiny: Tiny, creds: dict, slime: None, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.INFO, logger="slime_stoa")
    run, args, everything, used, _save1, _save2 = await run_with_two_saves(store, store_url, tiny, tmp_path)
    await store.put(state_key(RUN), GARBAGE)  # not a consumer state: this was raised out before
    restarted = args("ckpt-first")  # the first trainer's checkpoint folder: its consumer state
    out = await asyncio.wait_for(asyncio.to_thread(rollout.generate_rollout, restarted, 2, StoaDataSource(restarted)), 60)
    assert sorted(used + keys_of(out)) == everything
    assert logged(caplog, "resumed from checkpoint state") and logged(caplog, "not a valid consumer state")
    saved = json.loads(await store.get_bytes(state_key(RUN)))
    assert saved["signature"]["key"] == run.run_key.key_id and saved["counters"]["groups_used"] == 6
