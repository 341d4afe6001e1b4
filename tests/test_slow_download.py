"""One slow object never holds a batch: a record GET that the network trickles (one byte every
few seconds: no read timeout trips) is cut at the consumer's `download_deadline_s`, the batch
fills from the other records, and the cut record is fetched again later and admitted.

Compared with a control run (no trickle) in work terms: requests and listings, never seconds.
`slow_answer_report` is the measurement the security report takes."""

from __future__ import annotations

import uuid
from typing import Any

from slime_stoa.protocol.store import Store, open_store
from slime_stoa.trainer.consumer import RolloutConsumer
from slime_stoa.trainer.consumer.config import ConsumerConfig
from tests.faultproxy import FaultyProxy, Trickle
from tests.s3server import LocalS3Server
from tests.test_consumer import RUN, Tiny, config, make_group, now_ms, setup_run, tiny, upload

__all__ = ["tiny"]  # the session fixture

RECORDS = 12
BATCH = 4
TRICKLED = 1  # the second oldest record: its GET starts with the first batch's
EVERY_S = 3.0  # one byte every 3 s: the ~1 KB record would take most of an hour
# The batches wait at most this long: a bound on a failure (a held batch), never a measure.
CONSUMER = dict(download_deadline_s=0.5, wait_timeout_s=30.0)


async def run_batches(store: Store, url: str, tiny: Tiny, proxy: FaultyProxy, *, trickle: bool) -> dict[str, Any]:
    """12 honest records (one of them trickled when `trickle`), taken in 3 batches of 4."""
    await setup_run(store, tiny)
    t = now_ms() - 1_000
    names = [await upload(store, make_group(tiny, worker="mac-a", seq=i, prompt_index=i), t + i) for i in range(RECORDS)]
    slow = names[TRICKLED]
    trap: Trickle | None = None
    if trickle:
        trap = proxy.trickle(lambda method, path: method == "GET" and slow in path, EVERY_S)
    consumer = await RolloutConsumer.open(
        store, config(url, **CONSUMER), decode=tiny.decode, eos_ids=frozenset({tiny.eos}), prompt_of=tiny.prompt,
        restore=False,
    )
    batches = []
    try:
        for _ in range(RECORDS // BATCH):
            batch = await consumer.next_batch(BATCH, trainer_version=0)
            batches.append([g.key for g in batch.groups])
        counters = consumer.counters
    finally:
        await consumer.close()
    return {
        "admitted": counters.get("admitted", 0),
        "used": sum(len(b) for b in batches),
        "slow_in_batch": next((i for i, b in enumerate(batches) if slow in b), None),
        "get_requests": counters.get("get_requests", 0),
        "tail_listings": counters.get("tail_listings", 0),
        "downloads_cut": counters.get("downloads_cut", 0),
        "trickled": 0 if trap is None else trap.hits,
    }


async def slow_answer_pair(server: LocalS3Server, bucket: str, tiny: Tiny) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trickled, control) runs, each on its own prefix behind its own proxy."""
    upstream = int(server.endpoint_url.rsplit(":", 1)[1])
    rows = []
    for trickle in (True, False):
        async with FaultyProxy(upstream) as proxy:
            url = f"s3://{bucket}/slow-{uuid.uuid4().hex[:8]}?endpoint={proxy.endpoint}"
            async with open_store(url, credentials=server.credentials()) as store:
                rows.append(await run_batches(store, url, tiny, proxy, trickle=trickle))
    return rows[0], rows[1]


async def slow_answer_report(server: LocalS3Server, bucket: str, tiny: Tiny) -> dict[str, float]:
    """For the security report: the share of the honest records admitted with one trickled."""
    slow, _ = await slow_answer_pair(server, bucket, tiny)
    return {"slow_answer_admitted_ratio": slow["admitted"] / RECORDS}


async def test_a_trickled_record_never_holds_a_batch_and_is_admitted_on_its_retry(
    s3_server: LocalS3Server, s3_bucket: str, tiny: Tiny
) -> None:
    slow, control = await slow_answer_pair(s3_server, s3_bucket, tiny)
    assert slow["trickled"] == 1 and control["trickled"] == 0
    # Every record admitted and used, the trickled one too (after its retry) ...
    assert slow["admitted"] == control["admitted"] == RECORDS, (slow, control)
    assert slow["used"] == control["used"] == RECORDS
    # ... not in the first batch, which it would have held: another record took its slot.
    assert control["slow_in_batch"] == 0 and slow["slow_in_batch"] not in (None, 0), slow
    # The work: one GET more (the retry) and one cut; the listings as in the control.
    assert slow["downloads_cut"] == 1 and control["downloads_cut"] == 0
    assert slow["get_requests"] == control["get_requests"] + 1 == RECORDS + 1
    assert slow["tail_listings"] <= control["tail_listings"] + 1, (slow, control)


def test_the_download_deadline_is_a_checked_setting() -> None:
    assert ConsumerConfig(store_url="file:///b", run=RUN).download_deadline_s == 20.0
    for bad in (0, -1.0, float("nan"), True):
        try:
            ConsumerConfig(store_url="file:///b", run=RUN, download_deadline_s=bad)
        except ValueError as exc:
            assert "download_deadline_s" in str(exc)
        else:
            raise AssertionError(f"download_deadline_s={bad!r} accepted")
