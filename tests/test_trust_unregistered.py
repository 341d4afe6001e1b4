"""In a signed run, record keys under worker ids the registry does not hold are refused before
download: junk keys cost no GET each, and a worker added since is still learned."""

from __future__ import annotations

from slime_stoa.protocol.store import Store
from tests.test_consumer import Tiny, make_group, now_ms, tiny
from tests.test_signed_records import open_signed_consumer, put, setup_signed_run, signed

__all__ = ["tiny"]  # the session fixture


async def test_keys_of_unregistered_worker_ids_are_not_downloaded(store: Store, store_url: str, tiny: Tiny) -> None:
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    base = now_ms() - 10_000
    honest = await put(store, signed(make_group(tiny, worker="mac-a", seq=0), run.workers["mac-a"]), "mac-a", 0, base + 100)  # after the junk
    for i in range(30):  # junk under three made-up worker ids
        await put(store, b"junk" * 10, f"junk-{i % 3}", i, base + 1 + i)
    consumer = await open_signed_consumer(store, tiny, store_url, run, wait_timeout_s=2.0, registry_refresh_s=3600.0)
    batch = await consumer.next_batch(1, trainer_version=0)
    assert [g.key for g in batch.groups] == [honest]
    await consumer.close()
    counters = consumer.counters
    assert counters["rejected/unknown_key"] == 30
    assert counters["get_requests"] == 1  # the honest record only
