"""Consumer freshness: a trainer refuses a consumer state or a worker registry older than its
newest signed head (`trainer/consumer/heads.py`), resumed or fresh. Each attack puts old genuine
objects back into the bucket; `state_rollback` and `registry_rollback` say whether it worked
(the security report runs them too)."""

from __future__ import annotations

import functools
import logging

import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.registry import revoke_worker, update_registry
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store
from slime_stoa.trainer.consumer.heads import (
    KEEP,
    ConsumerHead,
    head_bytes,
    head_key,
    heads_prefix,
    read_head,
    write_head,
)
from slime_stoa.trainer.consumer.persistence import StateRollback, state_key
from slime_stoa.trainer.consumer.wait import ConsumerTimeout
from tests.test_consumer import Tiny, make_group, now_ms, tiny
from tests.test_signed_records import RUN, open_signed_consumer, put, setup_signed_run, signed

__all__ = ["tiny"]  # the session fixture


async def test_the_newest_verified_head_counts_and_old_ones_go(store: Store) -> None:
    key = SigningKey.generate()
    for seq in range(1, 8):
        await write_head(store, RUN, ConsumerHead(seq, seq * 10), key)
    assert await read_head(store, RUN, [key.public]) == ConsumerHead(7, 70)
    assert len([i async for i in store.list(heads_prefix(RUN))]) == KEEP
    # Junk, a forgery and a genuine head copied under a higher number are all skipped.
    await store.put(head_key(RUN, 99), b"junk")
    await store.put(head_key(RUN, 98), head_bytes(RUN, ConsumerHead(98, 0), SigningKey.generate()))
    await store.put(head_key(RUN, 97), head_bytes(RUN, ConsumerHead(7, 70), key))
    assert await read_head(store, RUN, [key.public]) == ConsumerHead(7, 70)


async def state_rollback(store: Store, store_url: str, tiny: Tiny) -> bool:
    """An old genuine signed consumer state put back before a restart: True if it was resumed from."""
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    base = now_ms() - 10_000
    for seq in range(4):
        await put(store, signed(make_group(tiny, worker="mac-a", seq=seq, prompt_index=seq), run.workers["mac-a"]), "mac-a", seq, base + seq)
    first = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key, wait_timeout_s=1.0)
    await first.next_batch(2, trainer_version=0)
    await first.save_state()
    old = await store.get_bytes(state_key(RUN))  # genuine, signed, and about to be outdated
    await first.next_batch(2, trainer_version=0)
    await first.save_state()
    await first.close()
    await store.put(state_key(RUN), old)
    restarted = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key, wait_timeout_s=1.0)
    try:
        await restarted.load_from_bucket()
    except StateRollback:
        return False
    finally:
        await restarted.close()
    return True


async def registry_rollback(store: Store, store_url: str, tiny: Tiny) -> bool:
    """The registry from before a revocation put back, for a trainer that starts without a saved
    state (its consumer.json gone): True if the revoked worker's record was admitted."""
    run = await setup_signed_run(store, tiny, workers=("mac-a", "mac-b"))
    layout = RunLayout(RUN)
    before = await store.get_bytes(layout.registry)
    await update_registry(store, RUN, run.run_key, functools.partial(revoke_worker, worker="mac-b", now=3.0))
    first = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key, wait_timeout_s=0.5)
    await put(store, signed(make_group(tiny, worker="mac-a", seq=0), run.workers["mac-a"]), "mac-a", 0, now_ms() - 5000)
    await first.next_batch(1, trainer_version=0)  # reads the registry that revokes mac-b
    await first.save_state()
    await first.close()
    await store.delete(state_key(RUN))
    await store.put(layout.registry, before)
    fresh = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key, wait_timeout_s=0.5)
    try:
        assert await fresh.bucket_state() is None
        await put(store, signed(make_group(tiny, worker="mac-b", seq=0, prompt_index=1), run.workers["mac-b"]), "mac-b", 0, now_ms() - 4000)
        try:
            batch = await fresh.next_batch(2, trainer_version=0)  # mac-a's record (not consumed: no state) and mac-b's
        except ConsumerTimeout:
            return False
        return any(g.group.worker_id == "mac-b" for g in batch.groups)
    finally:
        await fresh.close()


async def test_an_old_consumer_state_put_back_is_refused(store: Store, store_url: str, tiny: Tiny) -> None:
    assert not await state_rollback(store, store_url, tiny)


async def test_a_fresh_consumer_refuses_a_registry_older_than_the_head(store: Store, store_url: str, tiny: Tiny) -> None:
    assert not await registry_rollback(store, store_url, tiny)


async def test_a_state_at_the_head_reads_back(store: Store, store_url: str, tiny: Tiny) -> None:
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    first = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key)
    await first.save_state()
    await first.save_state()
    saved = first.state_dict()
    await first.close()
    assert saved["seq"] == 2
    again = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key)
    assert await again.bucket_state() == saved
    await again.close()


async def test_an_old_registry_is_reported_once_per_serial(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    from slime_stoa.judging.signers import Signers
    from slime_stoa.protocol.registry import Registry, add_worker, registry_bytes
    from slime_stoa.protocol.run_trust import RunTrust

    run_key, worker = SigningKey.generate(), SigningKey.generate()
    old = add_worker(Registry(run=RUN), worker="mac-a", name="a", key=worker.public, now=1.0)
    new = revoke_worker(old, "mac-a", now=2.0)
    signers = Signers(store, RUN, RunTrust(RUN, run_key.public), refresh_s=0.0)

    async def direct(op):  # type: ignore[no-untyped-def]
        return await op()

    await store.put(RunLayout(RUN).registry, registry_bytes(new, run_key))
    assert await signers.refresh(signers.clock(), through=direct) == "updated"
    await store.put(RunLayout(RUN).registry, registry_bytes(old, run_key))
    with caplog.at_level(logging.ERROR):
        outcomes = [await signers.refresh(signers.clock(), through=direct) for _ in range(3)]
    assert outcomes == ["rollback"] * 3 and signers.registry.serial == 2
    assert len([r for r in caplog.records if "older than" in r.getMessage()]) == 1
